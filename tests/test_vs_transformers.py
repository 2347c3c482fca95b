"""Our model against transformers' GlmMoeDsaForCausalLM on checkpoints its save_pretrained wrote."""

from __future__ import annotations

import pytest
import torch

from dist_glm5.model.reference_loop import full_logits, generate
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.sampling.params import SamplingParams
from hf_tiny import CONFIGS, save_hf_model

PROMPT_LEN = 72


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref = save_hf_model(request.param, d)
    return ref, load_model(d), request.param


def test_logits_match_at_every_position(pair):
    ref, ours, name = pair
    ids = torch.randint(2, ref.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    got = full_logits(ours, ids.tolist())
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"{name}: max abs logit difference {err:.2e}"


def test_32_greedy_tokens_identical(pair):
    ref, ours, name = pair
    ids = torch.randint(2, ref.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = ref.generate(ids[None], max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, PROMPT_LEN:].tolist()
    got = generate(ours, [ids.tolist()], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
    assert got == want, name


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
    torch.testing.assert_close(w.gather(1, o.indices), w_ref.gather(1, o_ref.indices), rtol=1e-6, atol=1e-6)
