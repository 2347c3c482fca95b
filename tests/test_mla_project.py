"""kernels/mla_project.c (`Ops.mla_project`: a decode step's MLA and indexer projections, norms,
ropes and cache writes in one call per layer) against the model composing the same ops
(`MLA._project`, which runs whenever the op is None or declines): the same bits for q, q_rot,
the index queries and head weights and both cache rows, on every layer of the shipped model in
bf16, for 1 to ROWS rows, either rope layout and either cache dtype; what it declines; a slot
outside the cache; and the same greedy tokens and logits with it as without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.default_model import ensure_default_model
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.kernels import mla_project
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.model.mla import MLA
from dist_glm5.model.reference_loop import blocks_needed


def _model(ops, dtype=torch.bfloat16):
    return load_model(ensure_default_model(), dtype, ops=ops, dsa=DSAConfig(mode="sparse"))


@pytest.fixture(scope="module")
def bf16_model():
    ops = get_backend("cpu").ops()
    assert mla_project.available() and ops.mla_project is mla_project.project  # gcc is here
    return _model(ops)


def _both(att: MLA, T: int, store_dtype, seed: int):
    """The fused op and the composed form on the same T rows into two fresh caches of
    store_dtype -> (outputs, cache rows) of each."""
    g = torch.Generator().manual_seed(seed)
    H = att.q_a_proj.in_features
    x = (torch.randn(T, H, generator=g) * 2).bfloat16()
    pos = torch.randint(0, 50_000, (T,), generator=g)
    half = att.rope // 2
    freq = 1e6 ** (-torch.arange(half) / half)
    ang = pos[:, None].double() * freq
    cos, sin = ang.cos().float(), ang.sin().float()
    slots = torch.randperm(200, generator=g)[:T]
    out = []
    for fused in (True, False):
        kv = torch.zeros(200, att.kv_lora + att.rope, dtype=store_dtype)
        ix = (
            None
            if att.indexer is None
            else torch.zeros(200, att.indexer.head_dim, dtype=store_dtype)
        )
        if fused:
            got = att.ops.mla_project(x, att.project_weights(), cos, sin, slots, kv, ix)
        else:
            got = att._project(x, slots, cos, sin, kv, ix)
        out.append((got, kv, ix))
    return out


@pytest.mark.parametrize("store_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleave", [True, False])
def test_fused_projection_is_the_composed_bit_for_bit(bf16_model, store_dtype, interleave):
    layers = [m for m in bf16_model.modules() if isinstance(m, MLA)]
    assert any(a.indexer is not None for a in layers) and any(a.indexer is None for a in layers)
    for li, att in enumerate(layers):
        att.interleave = interleave  # both forms read the module's flags
        if att.indexer is not None:
            att.indexer.interleave = not interleave
        try:
            for T in (1, 3, mla_project.ROWS):
                (f, kv_f, ix_f), (c, kv_c, ix_c) = _both(att, T, store_dtype, seed=10 * li + T)
                assert f is not None, "the kernel declined a bf16 decode step"
                for name, a, b in zip(("q", "q_rot", "iq", "iw"), f, c):
                    if b is None:
                        assert a is None, name
                        continue
                    assert a.dtype == b.dtype and a.shape == b.shape, name
                    assert torch.equal(a, b), f"layer {li}, T={T}: {name} differs"
                assert kv_c.abs().sum() > 0 and torch.equal(kv_f, kv_c), f"layer {li}: kv rows"
                if ix_c is not None:
                    assert ix_c.abs().sum() > 0
                    # the key's LayerNorm is ours (torch's sums run in another order): within
                    # one bf16 rounding
                    d = (ix_f.float() - ix_c.float()).abs()
                    assert (d <= 2**-7 * ix_c.float().abs() + 1e-6).all(), f"layer {li}: keys"
        finally:
            cfg = bf16_model.cfg
            att.interleave = cfg.rope_interleave
            if att.indexer is not None:
                att.indexer.interleave = cfg.indexer_rope_interleave


def test_what_it_declines_and_a_slot_outside_the_cache(bf16_model):
    att = next(m for m in bf16_model.modules() if isinstance(m, MLA) and m.indexer is not None)
    w = att.project_weights()
    H, r = att.q_a_proj.in_features, att.rope
    kv = torch.zeros(20, att.kv_lora + r, dtype=torch.bfloat16)
    ix = torch.zeros(20, att.indexer.head_dim, dtype=torch.bfloat16)

    def call(T, x_dtype=torch.bfloat16, slots=None, store=kv):
        cs = torch.rand(T, r // 2)
        slots = torch.arange(T) if slots is None else slots
        return mla_project.project(torch.randn(T, H).to(x_dtype), w, cs, cs, slots, store, ix)

    assert call(1) is not None
    assert call(mla_project.ROWS + 1) is None  # prefill-sized: the composed ops
    assert call(1, torch.float32) is None  # fp32 models: the composed ops
    assert call(2, store=kv.t().contiguous().t()) is None  # a strided cache
    before = kv.clone()
    with pytest.raises(IndexError, match="outside the cache"):
        call(2, slots=torch.tensor([3, 20]))
    assert torch.equal(kv, before)  # nothing written


def test_the_same_tokens_and_logits_with_it_as_without(bf16_model):
    """Greedy decode of two prompts together on the shipped model in bf16 (sparse path), the
    layers' projections fused, then composed: the same logits, bit for bit."""
    ops = get_backend("cpu").ops()
    off = _model(dataclasses.replace(ops, mla_project=None))
    prompts = [list(b"def parse(line):\n    key, _, value = "), list(b'{"name": "Ada", "age": ')]
    runs = []
    with torch.no_grad():
        for m in (bf16_model, off):
            cache = m.new_cache(blocks_needed([len(p) + 16 for p in prompts], 16), 16)
            last = []
            for i, p in enumerate(prompts):
                h, _ = m(torch.tensor(p), cache.prepare([Chunk(i, 0, len(p))]), cache)
                last.append(int(m.logits(m.final_norm(h[-1:])).argmax()))
            pos, toks, logits = [len(p) for p in prompts], last, []
            for _ in range(12):
                b = cache.prepare([Chunk(i, pos[i], 1) for i in range(len(prompts))])
                h, _ = m(torch.tensor(toks), b, cache)
                lg = m.logits(m.final_norm(h))
                logits.append(lg)
                toks = lg.argmax(-1).tolist()
                pos = [q + 1 for q in pos]
            runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])
