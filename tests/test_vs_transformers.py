"""Our model against transformers' GlmMoeDsaForCausalLM on checkpoints its save_pretrained wrote.

Every compared config has index_topk below the prompt length, so DSA selection is active, and
each checks that selection really changes the logits (transformers with the same weights and
index_topk above the sequence length is the no-selection baseline): a selection bug cannot hide
under the tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import require
from hf_tiny import CONFIGS, save_hf_model, selecting

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.model.reference_loop import full_logits, generate
from dist_glm5.sampling.params import SamplingParams

PROMPT_LEN = 72
TOL = 1e-4
COMPARED = selecting(PROMPT_LEN)


def test_compared_configs_cover_every_rope_type_with_selection():
    kinds = {CONFIGS[n].get("rope_parameters", {}).get("rope_type", "default") for n in COMPARED}
    assert kinds == {"default", "linear", "yarn"}, COMPARED


@pytest.fixture(scope="module", params=COMPARED)
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref = save_hf_model(request.param, d)
    return ref, load_model(d, ops=get_backend("cpu").ops()), request.param


def _without_selection(ref, min_topk: int):
    """transformers' model with the same weights and index_topk >= every sequence: dense MLA."""
    transformers = require("transformers")
    cfg = copy.deepcopy(ref.config)
    cfg.index_topk = min_topk
    dense = transformers.GlmMoeDsaForCausalLM(cfg).eval()
    dense.load_state_dict(ref.state_dict())
    return dense


def test_logits_match_at_every_position(pair):
    ref, ours, name = pair
    assert ref.config.index_topk < PROMPT_LEN
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, ref.config.vocab_size, (PROMPT_LEN,), generator=g)
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
        dense = _without_selection(ref, PROMPT_LEN)(ids[None]).logits[0].float()
    got = full_logits(ours, ids.tolist())
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{name}: max abs logit difference {err:.2e}"
    # the selection matters: positions up to index_topk see every key either way, later ones not
    k = ref.config.index_topk
    torch.testing.assert_close(want[:k], dense[:k], rtol=0, atol=TOL)
    effect = (want - dense).abs().max().item()
    assert effect > 100 * TOL, f"{name}: DSA selection moves the logits by only {effect:.2e}"
    assert (got - dense).abs().max().item() > 100 * TOL - TOL


def test_32_greedy_tokens_identical(pair):
    ref, ours, name = pair
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(2, ref.config.vocab_size, (PROMPT_LEN,), generator=g)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    with torch.no_grad():
        want = ref.generate(ids[None], **kw)[0, PROMPT_LEN:].tolist()
        dense = _without_selection(ref, PROMPT_LEN + 32).generate(ids[None], **kw)[0, PROMPT_LEN:]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    got = generate(ours, [ids.tolist()], params)[0].token_ids
    assert got == want, name
    assert dense.tolist() != want, f"{name}: greedy tokens do not depend on DSA selection"


def test_router_selection_and_weights_match(pair):
    ref, ours, name = pair
    layer = next(i for i, t in enumerate(ref.config.mlp_layer_types) if t == "sparse")
    x = torch.randn(40, ref.config.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _, w_ref, i_ref = ref.model.layers[layer].mlp.gate(x)
        w, i = ours.model.layers[str(layer)].mlp.gate(x)
    assert i.dtype == torch.int32
    o_ref, o = torch.sort(i_ref, -1), torch.sort(i.long(), -1)
    assert torch.equal(o_ref.values, o.values)
    torch.testing.assert_close(
        w.gather(1, o.indices), w_ref.gather(1, o_ref.indices), rtol=1e-6, atol=1e-6
    )
