"""Routed experts through the native Gaudi MoE ops, against the recording fake.

Call contract (one call, int32 ids, weights in x's dtype, fixed flags, inclusive EP range,
per-expert VIEWS of our stacked buffers), numerics (the fake's independent decoder + SwiGLU ==
our reference: pins low-nibble-first and [gate; up]), EP slices summing to the whole, and the
execution mode (compiled region outside lazy mode, a direct call in lazy mode).
"""

from __future__ import annotations

import hpu_fake
import pytest
import torch

from dist_glm5.backends.hpu import moe
from dist_glm5.ops.experts import experts_dense_reference, experts_mxfp4_reference
from dist_glm5.quant.mxfp4 import encode

E, H, I, T, K = 8, 64, 32, 5, 4
fake_hf = hpu_fake.fake_hf


def experts(n=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(n, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(n, H, I, generator=g) * 0.2
    return (*encode(w13), *encode(w2))


def routes(n_global, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(n_global, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def test_mxfp4_call_contract_views_not_copies(fake_hf):
    w13, s13, w2, s2 = experts()
    x, ids, w = routes(2 * E)
    moe.experts_mxfp4(x, ids, w.double(), w13, s13, w2, s2, E, 2 * E - 1)
    ((args, kw),) = fake_hf.calls("moe.mxfp4_fused_weights")
    hidden, table, weights, l13, l2, ls13, ls2 = args
    assert hidden is x and table.dtype == torch.int32 and torch.equal(table, ids.int())
    assert weights.dtype == x.dtype
    flags = dict(block_size=32, permuted_weights=True, activation="silu", is_fp4=True)
    assert kw == dict(**flags, experts_min=E, experts_max=2 * E - 1, chunk_size=0, total_experts=0)
    for lst, buf, shape in ((l13, w13, (2 * I, H // 2)), (l2, w2, (H, I // 2)),
                            (ls13, s13, (2 * I, H // 32)), (ls2, s2, (H, I // 32))):  # fmt: skip
        assert len(lst) == E
        for e, v in enumerate(lst):
            assert v.shape == shape and v.dtype == torch.uint8
            assert v.data_ptr() == buf[e].data_ptr()  # a view of the stacked buffer
            assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    # the views are built once per buffer
    moe.experts_mxfp4(x, ids, w, w13, s13, w2, s2, E, 2 * E - 1)
    (args2, _) = fake_hf.calls("moe.mxfp4_fused_weights")[1]
    assert all(a is b for a, b in zip(args2[3], l13))


def test_mxfp4_range_mismatch_is_a_clear_error(fake_hf):
    w13, s13, w2, s2 = experts()
    x, ids, w = routes(E)
    with pytest.raises(ValueError, match="experts_max = experts_min \\+ E_local - 1"):
        moe.experts_mxfp4(x, ids, w, w13, s13, w2, s2, 0, E)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_numerics_equal_reference_and_ep_slices_sum(fake_hf, dtype):
    w13, s13, w2, s2 = experts(2 * E)
    x, ids, w = routes(2 * E, dtype=dtype)
    want = experts_mxfp4_reference(x, ids, w, w13, s13, w2, s2, 0, 2 * E - 1)
    whole = moe.experts_mxfp4(x, ids, w, w13, s13, w2, s2, 0, 2 * E - 1)
    parts = [
        moe.experts_mxfp4(x, ids, w, w13[a:b], s13[a:b], w2[a:b], s2[a:b], a, b - 1)
        for a, b in ((0, E), (E, 2 * E))
    ]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = want.float().abs().max()
    assert whole.dtype == dtype and (whole.float() - want.float()).abs().max() <= tol * scale
    summed = parts[0].float() + parts[1].float()
    assert (summed - want.float()).abs().max() <= 2 * tol * scale


def test_dense_slices_of_64_experts_sum_to_the_reference(fake_hf):
    n = 80
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(n, 16, 32, generator=g), torch.randn(n, 32, 8, generator=g)
    x = torch.randn(T, 32, generator=g)
    ids = torch.stack([torch.randperm(n, generator=g)[:K] + 100 for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    out = moe.experts_dense(x, ids, w, w13, w2, 100, 100 + n - 1)
    want = experts_dense_reference(x, ids, w, w13, w2, 100, 100 + n - 1)
    assert (out - want).abs().max() <= 1e-4 * want.abs().max()
    calls = fake_hf.calls("moe.fused_weights")
    assert [(a[7], a[8], len(a[3])) for a, _ in calls] == [(100, 163, 64), (164, 179, 16)]
    assert all(a[1].dtype == torch.int32 and a[5] is True and a[6] == "silu" for a, _ in calls)
    names = [r[0] for r in fake_hf.RECORD]
    assert names == ["moe.fused_weights", "core.mark_step", "moe.fused_weights"]


@pytest.mark.parametrize("lazy", ["0", "1"])
def test_mode_selection_compiled_region_or_direct_call(fake_hf, monkeypatch, lazy):
    """LAZY=0: the op runs inside a torch.compile(backend="hpu_backend", fullgraph=True) region
    (eager is blocklisted for the real op; fullgraph proves no graph break). LAZY=1: a direct
    call, nothing compiled."""
    monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy)
    w13, s13, w2, s2 = experts()
    x, ids, w = routes(E)
    out = moe.experts_mxfp4(x, ids, w, w13, s13, w2, s2, 0, E - 1)
    names = [r[0] for r in fake_hf.RECORD]
    if lazy == "0":
        assert names.count("compile.hpu_backend") == 1
    else:
        assert "compile.hpu_backend" not in names
    assert names.count("moe.mxfp4_fused_weights") == 1
    want = experts_mxfp4_reference(x, ids, w, w13, s13, w2, s2, 0, E - 1)
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()
