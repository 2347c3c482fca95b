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
import torch.nn.functional as F

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
    for lst, buf, shape in (
        (l13, w13, (2 * I, H // 2)),
        (l2, w2, (H, I // 2)),
        (ls13, s13, (2 * I, H // 32)),
        (ls2, s2, (H, I // 32)),
    ):
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


def _op(x, ids, w, w12, w3, s12, s3, lo, hi, **over):
    kw = dict(
        block_size=32,
        permuted_weights=True,
        activation="silu",
        experts_min=lo,
        experts_max=hi,
        is_fp4=True,
        chunk_size=0,
        total_experts=0,
    )
    kw.update(over)
    return torch.ops.hpu.mixture_of_experts.mxfp4_fused_weights(x, ids, w, w12, w3, s12, s3, **kw)


def test_fake_op_reads_the_layout_habanas_test_writes(fake_hf):
    """The fake against a closed form written here from the cited lines of Habana's test (not
    from our codec): byte = code[2j] | code[2j+1] << 4, value = E2M1[code] * 2^(scale - 127) with
    a scale per 32 input columns, rows [gate; up], out = w * (silu(x gate^T) * (x up^T)) down^T
    with the raw router weight, ids global, a slot outside [experts_min, experts_max] adds
    nothing. A swapped reading (high nibble first, [up; gate]) gives another answer."""
    g = torch.Generator().manual_seed(7)
    H, I_, lo = 64, 32, 3
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])

    def packed(rows, cols):
        codes = torch.randint(0, 16, (rows, cols), generator=g)
        scale = torch.randint(124, 129, (rows, cols // 32), generator=g).to(torch.uint8)
        byte = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        value = e2m1[codes] * torch.pow(2.0, scale.float() - 127).repeat_interleave(32, 1)
        return byte, scale, value

    b12, s12, v12 = packed(2 * I_, H)
    b3, s3, v3 = packed(H, I_)
    x = torch.randn(2, H, generator=g)
    ids = torch.tensor([[lo, 9], [9, lo]], dtype=torch.int32)  # 9: another rank's expert
    w = torch.tensor([[0.75, 0.5], [0.25, -1.5]])  # raw, one negative: applied as given
    out = _op(x, ids, w, [b12], [b3], [s12], [s3], lo, lo)

    def closed_form(gate, up, down):
        return torch.tensor([[0.75], [-1.5]]) * ((F.silu(x @ gate.T) * (x @ up.T)) @ down.T)

    want = closed_form(v12[:I_], v12[I_:], v3)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.allclose(out, closed_form(v12[I_:], v12[:I_], v3), rtol=1e-2)  # [up; gate]
    swapped = ((b12 >> 4) | (b12 << 4)).to(torch.uint8)  # the other nibble order
    assert not torch.allclose(_op(x, ids, w, [swapped], [b3], [s12], [s3], lo, lo), want, rtol=1e-2)


def test_fake_op_refuses_what_the_real_op_refuses(fake_hf, monkeypatch):
    """RuntimeError where a source says the real op cannot (eager mode, block size, unpermuted
    weights, an activation outside the kernel's enum, packed shapes); AssertionError where our
    call differs from every known caller's form (int64 ids, a range that is not the list)."""
    w13, s13, w2, s2 = experts(1)
    x, ids, w = routes(1, dtype=torch.bfloat16)
    ids = torch.zeros(T, 1, dtype=torch.int32)
    args = (x, ids, w[:, :1].to(x.dtype), [w13[0]], [w2[0]], [s13[0]], [s2[0]], 0, 0)
    _op(*args)  # lazy mode: a direct call is allowed
    for over, match in (
        (dict(block_size=16), "group size is 32"),
        (dict(permuted_weights=False), "permuted_weights=True is required"),
        (dict(activation="swiglu"), "MoeActivationMode_t"),
    ):
        with pytest.raises(RuntimeError, match=match):
            _op(*args, **over)
    with pytest.raises(RuntimeError, match=r"packed \(64, 16\)"):
        _op(x, ids, args[2], [w13[0][:, :16]], [w2[0]], [s13[0]], [s2[0]], 0, 0)
    with pytest.raises(AssertionError, match="int32"):
        _op(x, ids.long(), *args[2:])
    with pytest.raises(AssertionError, match="expert tensors for the range 0..1"):
        _op(*args[:7], 0, 1)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    with pytest.raises(RuntimeError, match="blocked in eager mode"):
        _op(*args)
    # ... while our wrapper runs it in a compiled region there
    moe.experts_mxfp4(x, ids, w[:, :1], w13, s13, w2, s2, 0, 0)
