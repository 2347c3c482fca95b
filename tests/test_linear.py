"""The CPU backend's bf16 products in fp32 (ops/linear.py) against torch's own bf16 GEMM: the same
values up to the order of the fp32 additions (at most one bf16 ulp apart, most elements equal), a
single row left to torch's bf16 GEMV, the backend choosing it exactly where the CPU has no bf16
GEMM, and the default model's greedy tokens unchanged by it; the few-row bf16 kernel
(kernels/bf16_gemv.c) against float64 and torch, and the same tokens with it."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dist_glm5.backends import get_backend
from dist_glm5.kernels import bf16_gemv
from dist_glm5.ops import linear as L


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two bf16 tensors of one sign pattern (int16 bit order)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ia - ib).abs()


def test_fp32_products_are_torchs_bf16_gemm_up_to_one_ulp():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).bfloat16()
    w = torch.randn(80, 96, generator=g).bfloat16()
    b = torch.randn(80, generator=g).bfloat16()
    for bias in (None, b):
        got, want = L.linear_fp32_gemm(x, w, bias), torch.nn.functional.linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        same_sign = (got.float() * want.float() > 0) | (got == want)
        assert same_sign.all() and ulps(got, want).max() <= 1
        assert (got == want).float().mean() > 0.9
        # the fp32 form is exact products summed in fp32, rounded once: against float64
        exact = torch.nn.functional.linear(
            x.double(), w.double(), None if bias is None else bias.double()
        )
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


def test_einsum_and_single_rows():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(50, 4, 32, generator=g).bfloat16()
    w = torch.randn(4, 32, 64, generator=g).bfloat16()
    got = L.einsum_fp32_gemm("nhd,hdc->nhc", q, w)
    want = torch.einsum("nhd,hdc->nhc", q, w)
    assert got.dtype == torch.bfloat16 and ulps(got, want).max() <= 1
    # one row (a decode GEMV) and fp32 inputs go to torch as they are: bit for bit
    x1 = torch.randn(1, 64, generator=g).bfloat16()
    w1 = torch.randn(16, 64, generator=g).bfloat16()
    assert torch.equal(L.linear_fp32_gemm(x1, w1), torch.nn.functional.linear(x1, w1))
    xf, wf = torch.randn(9, 64, generator=g), torch.randn(16, 64, generator=g)
    assert torch.equal(L.linear_fp32_gemm(xf, wf), torch.nn.functional.linear(xf, wf))


def test_the_cpu_backend_widens_exactly_where_the_cpu_has_no_bf16_gemm():
    ops = get_backend("cpu").ops()
    native = L.native_bf16_gemm()
    assert bf16_gemv.available()  # gcc is on every machine we test on
    assert ops.linear.func is bf16_gemv.linear  # a few rows: the C kernel
    assert (ops.linear.keywords["fallback"] is L.linear_fp32_gemm) == (not native)
    assert (ops.einsum is L.einsum_fp32_gemm) == (not native)


def test_few_row_kernel_is_the_exact_sum_rounded_once():
    """kernels/bf16_gemv against float64 of the same bf16 values: products exact, sums in fp32,
    rounded once, so within half a bf16 step of the exact value plus fp32's summation error; and
    against torch's bf16 F.linear, at most one step apart and mostly equal. Odd sizes cover the
    kernel's tails (N odd: a lone weight row; K % 8: the scalar tail; rows % 4: a short tile)."""
    g = torch.Generator().manual_seed(3)
    for m, N, K in ((1, 80, 96), (3, 7, 13), (5, 33, 200), (bf16_gemv.ROWS, 64, 1024)):
        x = torch.randn(m, K, generator=g).bfloat16()
        w = torch.randn(N, K, generator=g).bfloat16()
        b = torch.randn(N, generator=g).bfloat16()
        for bias in (None, b):
            got = bf16_gemv.linear(x, w, bias)
            exact = torch.nn.functional.linear(
                x.double(), w.double(), None if bias is None else bias.double()
            )
            fp32_err = K * 2**-23 * (x.double().abs() @ w.double().abs().T)
            half_step = exact.abs() * 2**-8  # rounding to bf16 (8 significant bits) moves this
            assert got.dtype == torch.bfloat16 and got.shape == (m, N)
            assert ((got.double() - exact).abs() <= half_step * 1.01 + fp32_err).all()
            want = torch.nn.functional.linear(x, w, bias)
            # torch's native bf16 GEMM (CPUs with AVX512-BF16) rounds the product to bf16 and
            # again after the bias: one more step apart then (the float64 check above is the
            # bound; this one is the peer)
            steps = 1 if bias is None or not L.native_bf16_gemm() else 2
            assert ulps(got, want).max() <= steps and (got == want).float().mean() > 0.9
    # leading dims kept, a non-contiguous x taken, NaN kept
    x = torch.randn(2, 1, 40, generator=g).bfloat16()[:, :, ::2]
    w = torch.randn(6, 20, generator=g).bfloat16()
    w[2, 3] = float("nan")
    got = bf16_gemv.linear(x, w)
    assert got.shape == (2, 1, 6) and got[..., 2].isnan().all() and not got[..., :2].isnan().any()


_BOTH_TILES = r"""
import os
import torch
from dist_glm5.kernels import bf16_gemv
g = torch.Generator().manual_seed(5)
for m, N, K in ((1, 80, 96), (3, 7, 45), (6, 33, 200), (10, 12, 64), (32, 64, 1024),
                (17, 21, 128), (31, 40, 64)):
    x = torch.randn(m, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    got = bf16_gemv.linear(x, w)
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2**-8 * 1.01 + K * 2**-23 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all(), (m, N, K)
    flags = open("/proc/cpuinfo").read().split()
    amx = "amx_bf16" in flags and "avx512_bf16" in flags and K % 32 == 0
    env = os.environ
    amx = amx and env["DIST_GLM5_GEMV_AMX"] != "0" and env["DIST_GLM5_GEMV_FP32"] != "1"
    assert bf16_gemv.uses_amx(K) == amx, (K, amx)
    bf16dot = "avx512_bf16" in flags and env["DIST_GLM5_GEMV_FP32"] != "1"
    wide = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
    assert bf16_gemv.uses_zmm() == (wide and not bf16dot and env["DIST_GLM5_GEMV_ZMM"] != "0")
    # a row's bits do not depend on the rows beside it (whichever tile shape took it)
    for i in range(m):
        assert torch.equal(bf16_gemv.linear(x[i : i + 1], w), got[i : i + 1]), (m, i)
print("ok")
"""


@pytest.mark.parametrize(
    "fp32_tiles,amx,zmm", [("1", "0", "0"), ("1", "0", "1"), ("0", "0", "1"), ("0", "1", "1")]
)
def test_every_tile_path_is_the_exact_sum_rounded_once(fp32_tiles, amx, zmm):
    """The 8-lane fp32 tiles (DIST_GLM5_GEMV_FP32=1, DIST_GLM5_GEMV_ZMM=0), where the CPU has
    AVX-512 the 16-lane ones (ZMM=1), where it has AVX512-BF16 the vdpbf16ps ones
    (DIST_GLM5_GEMV_AMX=0), and where it has AMX-BF16 too the AMX tiles (the default there; on
    other CPUs a case runs the best path it has again), each in a fresh process: within the
    float64 bound above, and a row's bits the same alone as among 32 (K = 64 and 1024 take the
    AMX tiles, the other shapes their K % 32 fallback; K = 45 and 13 the 16-lane tiles' tail)."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "DIST_GLM5_GEMV_FP32": fp32_tiles,
        "DIST_GLM5_GEMV_AMX": amx,
        "DIST_GLM5_GEMV_ZMM": zmm,
    }
    r = subprocess.run([sys.executable, "-c", _BOTH_TILES], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_kernel_takes_few_rows_and_falls_back_on_the_rest():
    ops = get_backend("cpu").ops()
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 32, generator=g).bfloat16()
    few = torch.randn(2, 32, generator=g).bfloat16()
    many = torch.randn(bf16_gemv.ROWS + 1, 32, generator=g).bfloat16()
    assert torch.equal(ops.linear(few, w), bf16_gemv.linear(few, w))
    assert torch.equal(ops.linear(many, w), ops.linear.keywords["fallback"](many, w))
    assert not bf16_gemv.fits(few, w.T.contiguous().T)  # a transposed view: torch's path
    assert not bf16_gemv.fits(few.float(), w.float())
    with pytest.raises(RuntimeError, match="few-row bf16"):
        bf16_gemv.linear(many, w)


def test_the_shipped_model_gives_the_same_tokens_and_no_larger_error():
    """The trained default model (bf16 weights): greedy tokens equal with either product, and
    the fp32 form's logits no further from an fp32 run of the same weights than torch's bf16
    GEMM's are."""
    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.model.reference_loop import full_logits, generate
    from dist_glm5.sampling.params import SamplingParams

    d, sparse = ensure_default_model(), DSAConfig(mode="sparse")
    ops = get_backend("cpu").ops()
    wide = dataclasses.replace(ops, linear=L.linear_fp32_gemm, einsum=L.einsum_fp32_gemm)
    plain = dataclasses.replace(ops, linear=L.linear, einsum=L.einsum)
    gemv = dataclasses.replace(
        wide, linear=functools.partial(bf16_gemv.linear, fallback=L.linear_fp32_gemm)
    )
    text = [list(b"import os\n\ndef walk(root):\n    result = []\n    for d, _, fs in os.walk(")]
    P = SamplingParams(max_tokens=24, ignore_eos=True)
    with torch.no_grad():
        truth = full_logits(load_model(d, torch.float32, ops=plain, dsa=sparse), text[0])
        toks, err = [], []
        for o in (wide, plain, gemv):
            m = load_model(d, ops=o, dsa=sparse)
            assert m.dtype == torch.bfloat16  # the shipped weights: the case this is for
            toks.append([x.token_ids for x in generate(m, text, P)])
            err.append((full_logits(m, text[0]) - truth).abs().mean().item())
    assert toks[0] == toks[1] == toks[2]
    assert err[0] <= 1.25 * err[1] and err[2] <= 1.25 * err[1], err
