"""The CPU backend's bf16 products in fp32 (ops/linear.py) against torch's own bf16 GEMM: the same
values up to the order of the fp32 additions (at most one bf16 ulp apart, most elements equal), a
single row left to torch's bf16 GEMV, the backend choosing it exactly where the CPU has no bf16
GEMM, and the default model's greedy tokens unchanged by it."""

from __future__ import annotations

import dataclasses

import torch

from dist_glm5.backends import get_backend
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
    assert (ops.linear is L.linear_fp32_gemm) == (not native)
    assert (ops.einsum is L.einsum_fp32_gemm) == (not native)


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
    text = [list(b"import os\n\ndef walk(root):\n    result = []\n    for d, _, fs in os.walk(")]
    P = SamplingParams(max_tokens=24, ignore_eos=True)
    with torch.no_grad():
        truth = full_logits(load_model(d, torch.float32, ops=plain, dsa=sparse), text[0])
        toks, err = [], []
        for o in (wide, plain):
            m = load_model(d, ops=o, dsa=sparse)
            assert m.dtype == torch.bfloat16  # the shipped weights: the case this is for
            toks.append([x.token_ids for x in generate(m, text, P)])
            err.append((full_logits(m, text[0]) - truth).abs().mean().item())
    assert toks[0] == toks[1]
    assert err[0] <= 1.25 * err[1], err
