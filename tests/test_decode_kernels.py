"""The decode step's small C kernels against the torch references they stand beside:
kernels/norm_rope.c (RMSNorm, rotary embedding), kernels/mla_decode.c (the whole sparse MLA
decode: W_uk, attention over the selected rows, W_uv), each also against float64 of the same
math, and kernels/bf16_gemv.c's routed experts against ops/experts' loop; the CPU backend
routing what they do not take to the references; and the shipped model's greedy tokens the same
with the kernels as with the torch forms."""

from __future__ import annotations

import dataclasses
import functools
import platform
import re
import subprocess
from pathlib import Path

import pytest
import torch

from dist_glm5.backends import get_backend
from dist_glm5.kernels import bf16_gemv, mla_decode, norm_rope
from dist_glm5.ops import attention
from dist_glm5.ops.experts import experts_dense_reference
from dist_glm5.ops.linear import einsum_fp32_gemm
from dist_glm5.ops.norm import rms_norm
from dist_glm5.ops.rope import apply_rope


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def test_kernels_build_here():
    # gcc is on every machine we test on: a kernel that does not build is a failure, not a skip
    assert norm_rope.available() and mla_decode.available()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="ISA clones are x86-64's")
@pytest.mark.parametrize("source", ["bf16_gemv.c", "mla_project.c", "mla_decode.c"])
def test_every_parallel_region_has_its_isa_clones(source):
    """OpenMP outlines a parallel region before inlining: a region inside an always-inline
    helper compiled once for the baseline ISA (the decode products ran in SSE2, 1.4-5x slower).
    Every outlined region of these kernels must come in the AVX2+FMA clone too, but those of a
    function written for one ISA (its target macro, BF16DOT, ZMM or AMX_BF16_T: it runs only
    where the CPU has it)."""
    from dist_glm5.kernels import build

    here = Path(build.__file__).parent
    lib = build.build(here / source)
    names = subprocess.run(["nm", str(lib)], capture_output=True, text=True, check=True).stdout
    regions = set(re.findall(r"\b(\w+\._omp_fn\.\d+)", names))
    assert regions, names
    code = "".join((here / f).read_text() for f in (source, "gemv_tiles.h"))
    one_isa = set(re.findall(r"\b(?:BF16DOT|AMX_BF16_T|ZMM)\s+void\s+(\w+)\s*\(", code))
    assert "products16" in one_isa
    for r in regions:
        if r.split(".")[0] in one_isa:
            continue
        assert f"{r}.arch_x86_64_v3" in names, f"{source}: {r} has no AVX2 clone"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_the_references(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 1024), (3, 256), (7, 130)):
        x = torch.randn(*shape, generator=g).to(dtype)
        w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
        got, want = norm_rope.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)
        assert got.dtype == dtype and got.shape == x.shape
        if dtype == torch.bfloat16:  # fp32 statistics differ only in summation order
            assert ulps(got, want).max() <= 1 and (got == want).float().mean() > 0.99
        else:
            torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-7)
        # float64: x / rms(x) * w
        x64 = x.double()
        exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        tol = 2**-7 if dtype == torch.bfloat16 else 1e-6
        assert ((got.double() - exact).abs() <= tol * exact.abs() + 1e-6).all()
    # a slice of a wider row (ckv[:, :kv_lora]) reads its rows by their stride
    wide = torch.randn(4, 160, generator=g).to(dtype)
    w = torch.rand(128, generator=g).to(dtype)
    got = norm_rope.rms_norm(wide[:, :128], w, 1e-6)
    assert torch.allclose(got.float(), rms_norm(wide[:, :128].contiguous(), w, 1e-6).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleave", [True, False])
def test_rope_is_the_references_bit_for_bit(dtype, interleave):
    """Every bf16 product and sum rounded where torch's eager ops round: identical bits."""
    g = torch.Generator().manual_seed(1)
    cos, sin = torch.rand(3, 16, generator=g), torch.rand(3, 16, generator=g)
    views = (
        torch.randn(3, 8, 96, generator=g).to(dtype)[..., 64:],  # q_rot of q (strided heads)
        torch.randn(3, 160, generator=g).to(dtype)[:, None, 128:],  # k_rot of ckv
        torch.randn(3, 64, generator=g).to(dtype)[:, :32],  # the indexer's first dims, 2-D
    )
    for x in views:
        got = norm_rope.apply_rope(x, cos, sin, interleave)
        assert torch.equal(got, apply_rope(x, cos, sin, interleave))
    x = views[0].double()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :16], x[..., 16:])
    c, s = cos.double()[:, None], sin.double()[:, None]
    exact = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    mag = torch.cat([x1.abs() + x2.abs()] * 2, -1)  # bounds each output's terms
    tol = 2**-6 if dtype == torch.bfloat16 else 1e-6  # four bf16 roundings at most
    got = norm_rope.apply_rope(views[0], cos, sin, interleave).double()
    assert ((got - exact).abs() <= tol * mag + 1e-7).all()


def _decode_case(dtype, n=3, h=8, nope=64, v=64, c=128, r=32, S=500, k=256, seed=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, nope + r, generator=g).to(dtype)
    w = (torch.randn(h * (nope + v), c, generator=g) * 0.1).to(dtype)
    kv = torch.randn(S, c + r, generator=g).to(dtype)
    slots = torch.randint(0, S, (n, k), generator=g)
    valid = torch.rand(n, k, generator=g) > 0.3
    valid[:, 0] = True  # a row always keeps at least itself
    return q[..., :nope], q[..., nope:].contiguous(), w, kv, slots, valid, nope


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_decode_is_the_torch_form(dtype):
    qn, qr, w, kv, slots, valid, nope = _decode_case(dtype)
    got = mla_decode.absorbed_gathered(qn, qr, w, kv, slots, valid, nope, 0.1, 1 << 29)
    want = attention.absorbed_gathered(
        qn, qr, w, kv, slots, valid, nope, 0.1, 1 << 29, einsum=einsum_fp32_gemm
    )
    exact = attention.absorbed_gathered(
        qn.double(), qr.double(), w.double(), kv.double(), slots, valid, nope, 0.1, 1 << 29
    )
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.bfloat16:
        assert ulps(got, want).max() <= 1 and (got == want).float().mean() > 0.99
        # three bf16 roundings (q_lat, o_lat, out) against float64 throughout
        assert ((got.double() - exact).abs() <= 0.02 * exact.abs().max()).all()
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)


def test_mla_decode_bits_ignore_threads_and_batch():
    """The selected keys go over threads in segments of a fixed size, merged in order: a row's
    bits are the same at any thread count, alone, in a batch or in capped calls. k = 150 leaves
    a short last segment; a row whose first 64 keys are all invalid has a segment with no valid
    key."""
    qn, qr, w, kv, slots, valid, nope = _decode_case(torch.bfloat16, n=4, k=150, seed=3)
    valid[2, :64] = False
    valid[2, 100] = True
    n_threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(
                mla_decode.absorbed_gathered(qn, qr, w, kv, slots, valid, nope, 0.1, 1 << 29)
            )
            for i in range(4):
                alone = mla_decode.absorbed_gathered(
                    qn[i : i + 1], qr[i : i + 1], w, kv, slots[i : i + 1], valid[i : i + 1],
                    nope, 0.1, 1 << 29,
                )  # fmt: skip
                assert torch.equal(alone[0], outs[0][i])
    finally:
        torch.set_num_threads(n_threads)
    assert torch.equal(outs[0], outs[1])
    # a cap of one row's scratch: a call per row (as a prefill chunk's rows go), the same bits;
    # under one row's it says so
    row = mla_decode._kernel.get().mla_decode_row_bytes(8, 128, 32, 150, 1)
    capped = mla_decode.absorbed_gathered(qn, qr, w, kv, slots, valid, nope, 0.1, row)
    assert torch.equal(capped, outs[0])
    with pytest.raises(ValueError, match="exceeds the cap"):
        mla_decode.absorbed_gathered(qn, qr, w, kv, slots, valid, nope, 0.1, row - 1)
    want = attention.absorbed_gathered(
        qn, qr, w, kv, slots, valid, nope, 0.1, 1 << 29, einsum=einsum_fp32_gemm
    )
    assert ulps(outs[0], want).max() <= 1 and (outs[0] == want).float().mean() > 0.99


_MLA_TILES = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from test_decode_kernels import _decode_case
from dist_glm5.kernels import mla_decode
from dist_glm5.ops import attention
from dist_glm5.ops.linear import einsum_fp32_gemm
a = _decode_case(torch.bfloat16, n=32, seed=4)
got = mla_decode.absorbed_gathered(*a, 0.1, 1 << 29)
want = attention.absorbed_gathered(*a, 0.1, 1 << 29, einsum=einsum_fp32_gemm)
qn, qr, w, kv, slots, valid, nope = a
exact = attention.absorbed_gathered(
    qn.double(), qr.double(), w.double(), kv.double(), slots, valid, nope, 0.1, 1 << 29
)
# the torch form's bits almost everywhere (an output near 0 may differ in sign: no ulps bound);
# three bf16 roundings against float64 throughout
assert (got == want).float().mean() > 0.99
assert ((got.double() - exact).abs() <= 0.02 * exact.abs().max()).all()
for i in (0, 5, 31):  # a row alone: the same bits as among 32 (phase 4's tiles take 1 and 6)
    one = [qn[i : i + 1], qr[i : i + 1], w, kv, slots[i : i + 1], valid[i : i + 1], nope]
    assert torch.equal(mla_decode.absorbed_gathered(*one, 0.1, 1 << 29)[0], got[i])
print("ok")
"""


@pytest.mark.parametrize("fp32_tiles,zmm", [("1", "0"), ("1", "1"), ("0", "1")])
def test_mla_decode_on_every_tile_path_of_its_output_projection(fp32_tiles, zmm):
    """Phase 4 (o_lat . W_uv^T) takes gemv_tiles.h's 8-lane fp32 tiles, the 16-lane ones (AVX-512
    without AVX512-BF16) or the vdpbf16ps ones by the CPU and DIST_GLM5_GEMV_FP32 / _ZMM: each in a
    fresh process, against the torch form, 32 rows at once and alone."""
    import os
    import sys

    env = {**os.environ, "DIST_GLM5_GEMV_FP32": fp32_tiles, "DIST_GLM5_GEMV_ZMM": zmm}
    here = str(Path(__file__).parent)
    r = subprocess.run(
        [sys.executable, "-c", _MLA_TILES, here], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_experts_are_the_loops_roundings(threads):
    """Every bf16 rounding where the Python loop's torch ops round: equal to it but for the
    order of the fp32 sums in the products (almost all equal; a one-step difference in the
    gate or up product can carry through silu and the down product to two steps); ids
    outside this rank's range contribute nothing; against float64 of the same math."""
    g = torch.Generator().manual_seed(5)
    T, H, I, E, k = bf16_gemv.ROWS, 256, 96, 16, 4
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    ids = torch.stack([torch.randperm(24, generator=g)[:k] for _ in range(T)]).int()
    tw = torch.rand(T, k, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in (1, 3, T):
            got = bf16_gemv.experts(x[:t], ids[:t], tw[:t], w13, w2, 4, 4 + E - 1)
            want = experts_dense_reference(x[:t], ids[:t], tw[:t], w13, w2, 4, 4 + E - 1)
            assert ulps(got, want).max() <= 2 and (got == want).float().mean() > 0.99
    finally:
        torch.set_num_threads(before)
    exact = experts_dense_reference(x.double(), ids, tw.double(), w13.double(), w2.double(), 4, 19)
    assert ((got.double() - exact).abs() <= 0.03 * exact.abs().max()).all()
    local = (ids >= 4) & (ids <= 19)
    none = ~local.any(1)
    assert (got[none] == 0).all()  # a token none of whose experts are here gets nothing


def test_bf16_experts_bits_depend_on_neither_threads_nor_batch():
    """All touched experts go through one parallel region in phases: a token's result is the
    same bits on 1 and 2 threads, and alone as among the batch."""
    g = torch.Generator().manual_seed(7)
    T, H, I, E, k = bf16_gemv.ROWS, 256, 96, 16, 4
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    tw = torch.rand(T, k, generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(bf16_gemv.experts(x, ids, tw, w13, w2, 0, E - 1))
        assert torch.equal(outs[0], outs[1])
        for t in (0, T - 1):
            alone = bf16_gemv.experts(
                x[t : t + 1], ids[t : t + 1], tw[t : t + 1], w13, w2, 0, E - 1
            )
            assert torch.equal(alone[0], outs[1][t])
    finally:
        torch.set_num_threads(before)


def test_the_backend_routes_what_the_kernels_do_not_take_to_the_references():
    ops = get_backend("cpu").ops()
    g = torch.Generator().manual_seed(3)
    many = torch.randn(norm_rope.ROWS + 1, 64, generator=g).bfloat16()
    w = torch.rand(64, generator=g).bfloat16()
    # RMSNorm takes every row count (its sum of squares is not torch's, so a row must not switch
    # paths with the batch): a row alone gives the bits it gives among many, on 1 or 2 threads
    together = ops.rms_norm(many, w, 1e-5)
    for i in (0, 5):
        assert torch.equal(ops.rms_norm(many[i : i + 1], w, 1e-5)[0], together[i])
    big = torch.randn(4096, 64, generator=g).bfloat16()  # threaded
    assert torch.equal(ops.rms_norm(big, w, 1e-5)[7], ops.rms_norm(big[7:8], w, 1e-5)[0])
    cos, sin = torch.rand(many.shape[0], 16), torch.rand(many.shape[0], 16)
    assert torch.equal(
        ops.apply_rope(many[:, :32], cos, sin, True), apply_rope(many[:, :32], cos, sin, True)
    )
    half = torch.randn(2, 64, generator=g).half()  # no fp16 path: the reference
    assert torch.equal(ops.rms_norm(half, w.half(), 1e-5), rms_norm(half, w.half(), 1e-5))
    qn, qr, w, kv, slots, valid, nope = _decode_case(torch.bfloat16)
    mixed = ops.absorbed_gathered(qn, qr, w, kv.float(), slots, valid, nope, 0.1, 1 << 29)
    ref = attention.absorbed_gathered(qn, qr, w, kv.float(), slots, valid, nope, 0.1, 1 << 29)
    assert mixed.shape == ref.shape  # the torch form took it (mixed dtypes)
    with pytest.raises(RuntimeError, match="no fallback"):
        norm_rope.rms_norm(half, w.half(), 1e-5)
    # more tokens than the experts kernel takes: the loop
    x = torch.randn(bf16_gemv.ROWS + 1, 64, generator=g).bfloat16()
    w13, w2 = torch.randn(4, 32, 64).bfloat16(), torch.randn(4, 64, 16).bfloat16()
    ids, tw = torch.randint(0, 4, (x.shape[0], 2)).int(), torch.rand(x.shape[0], 2)
    want = experts_dense_reference(x, ids, tw, w13, w2, 0, 3, linear=ops.linear)
    assert torch.equal(ops.experts.dense(x, ids, tw, w13, w2, 0, 3), want)


def test_the_shipped_model_gives_the_same_tokens_with_the_kernels():
    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    ops = get_backend("cpu").ops()
    torch_forms = dataclasses.replace(
        ops,
        rms_norm=rms_norm,
        apply_rope=apply_rope,
        absorbed_gathered=functools.partial(attention.absorbed_gathered, einsum=ops.einsum),
        experts=dataclasses.replace(
            ops.experts, dense=functools.partial(experts_dense_reference, linear=ops.linear)
        ),
    )
    text = [list(b"def parse(line):\n    key, _, value = line.partition("), list(b'{"a": [1, ')]
    P = SamplingParams(max_tokens=24, ignore_eos=True)
    toks = []
    with torch.no_grad():
        for o in (ops, torch_forms):
            m = load_model(ensure_default_model(), ops=o, dsa=DSAConfig(mode="sparse"))
            toks.append([x.token_ids for x in generate(m, text, P)])
    assert toks[0] == toks[1]


@pytest.mark.parametrize(
    "E,H,k,groups,keep", [(64, 1024, 8, 1, 1), (256, 520, 8, 8, 4), (16, 36, 4, 4, 2)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_kernel_picks_the_references_experts(E, H, k, groups, keep, dtype):
    """kernels/router.c against model/router.route: the same experts per token (ordered by
    choice, highest first), weights to fp32 rounding; more than ROWS tokens run the reference."""
    from dist_glm5.kernels import router
    from dist_glm5.model.router import route

    g = torch.Generator().manual_seed(E + H)
    W = torch.randn(E, H, generator=g) * 0.05
    b = torch.randn(E, generator=g) * 0.1
    for T in (1, 5, router.ROWS):
        x = torch.randn(T, H, generator=g).to(dtype)
        w, ids = router.route(x, W, b, k, groups, keep, True, 2.5, fallback=route)
        w0, ids0 = route(x, W, b, k, groups, keep, True, 2.5)
        order = ids0.long().sort(-1)
        got = ids.long().sort(-1)
        assert torch.equal(got.values, order.values)
        torch.testing.assert_close(w.gather(1, got.indices), w0.gather(1, order.indices))
        choice = torch.sigmoid(x.float() @ W.T) + b
        picked = choice.gather(1, ids.long())
        assert (picked[:, 1:] <= picked[:, :-1]).all()  # highest choice first
    x = torch.randn(router.ROWS + 1, H, generator=g).to(dtype)
    got = router.route(x, W, b, k, groups, keep, True, 2.5, fallback=route)
    want = route(x, W, b, k, groups, keep, True, 2.5)
    assert all(torch.equal(a, c) for a, c in zip(got, want))


def test_router_kernel_breaks_ties_to_the_lower_expert():
    from dist_glm5.kernels import router

    W = torch.zeros(8, 16)  # every score sigmoid(0) = 0.5
    w, ids = router.route(torch.ones(1, 16), W, torch.zeros(8), 3, 1, 1, True, 1.0)
    assert ids.tolist() == [[0, 1, 2]] and torch.allclose(w, torch.full((1, 3), 1 / 3))
    # ties among the best and across the k-th place: choice order, lower id first in each tie
    bias = torch.tensor([0, 0.1, 0.2, 0, 0, 0.2, 0, 0.1])
    _, ids = router.route(torch.ones(1, 16), W, bias, 3, 1, 1, True, 1.0)
    assert ids.tolist() == [[2, 5, 1]]


def test_bench_mla_decode_measures_the_kernel_beside_its_torch_form(tmp_path):
    """`bench mla-decode` times both forms of the same rows and records how far apart they are."""
    import argparse
    import json

    from bench import mla_decode as bench

    out = tmp_path / "mla.json"
    args = argparse.Namespace(threads=[1], rows=[2], shapes=["small"], repeats=1, output=str(out))
    assert bench.main(args) == 0
    (row,) = json.loads(out.read_text())
    assert row["kernel_us"] > 0 and row["torch_us"] > 0 and row["ratio"] > 0
    h, nope, v, c, r, k = bench.SHAPES["small"]
    assert bench.macs(bench.SHAPES["small"], 2) == 2 * h * (nope * c + k * (c + r) + k * c + c * v)
    assert row["max_abs_diff"] < 0.05  # bf16 outputs of order 1: a few ulps at most
