"""The TPC kernel (kernels/tpc/gaudi2/mxfp4_dequant_bf16_gaudi2.c), modelled on the CPU line by
line, equals our codec's decode bit for bit; and the custom-op loader's contract."""

from __future__ import annotations

import hpu_fake
import pytest
import torch

from dist_glm5.backends.hpu import custom_ops
from dist_glm5.quant.mxfp4 import decode

fake_hf = hpu_fake.fake_hf


def bf16_bits(code: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The kernel's `bf16_bits`, on int64 lanes holding u32 values (same operations, same order)."""
    sign = (code & 8) << 12
    m = code & 7
    ec = m >> 1
    bp = s + ec
    mant = torch.where(m >= 2, m & 1, 0)
    normal = ((bp - 1) << 7) | (mant << 6)
    subnormal = (mant + 2) << (bp + 4)
    mag = torch.where(bp < 2, subnormal, normal)
    mag = torch.where(bp >= 256, 0x7F80, mag)
    mag = torch.where(m == 0, 0, mag)
    return torch.where(s == 255, 0x7FC0, sign | mag)


def tpc_model(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's main(): packed u8 [R, K/2], scales u8 [R, K/32] -> bf16 [R, K], columns in the
    kernel's order. One 'vector' = 64 u32 lanes = 256 packed bytes."""
    R, half = packed.shape
    w = packed.view(R, half // 4, 4).long()
    w = w[..., 0] | w[..., 1] << 8 | w[..., 2] << 16 | w[..., 3] << 24  # u32 lanes, little-endian
    lane = torch.arange(half // 4)
    s = scales.long()[:, lane // 4]  # lanes 4g..4g+3 share scale byte g
    out = torch.empty(R, half // 256, 4, 64, dtype=torch.int64)
    for b in range(4):
        byte = (w >> (8 * b)) & 0xFF
        word = bf16_bits(byte & 0xF, s) | (bf16_bits(byte >> 4, s) << 16)
        out[:, :, b, :] = word.view(R, -1, 64)  # stored at v * 512 + b * 128 bf16 elements
    halves = torch.stack([out & 0xFFFF, out >> 16], -1).reshape(R, -1)  # little-endian bf16
    signed = halves - ((halves >> 15) << 16)  # u16 bit patterns as int16 values
    return signed.to(torch.int16).view(torch.bfloat16)


def test_tpc_model_equals_decode_bit_for_bit_on_every_scale_and_code():
    R, K = 256, 512
    packed = torch.arange(256, dtype=torch.uint8).repeat(R, 1)  # every (lo, hi) code pair
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, K // 32)  # row r: byte r
    got = tpc_model(packed, scales)
    want = decode(packed, scales, torch.bfloat16)[:, custom_ops.input_permutation(K)]
    ok = got[:255].view(torch.int16) == want[:255].view(torch.int16)
    assert bool(ok.all()), f"{int((~ok).sum())} mismatches, first at {(~ok).nonzero()[0]}"
    assert bool(torch.isnan(got[255]).all() and torch.isnan(want[255]).all())  # 0xFF is NaN
    # the cases the kernel special-cases are all covered: subnormal scales, overflow to inf, -0
    assert bool(torch.isinf(got).any()) and (got[0].view(torch.int16) == -32768).any()
    assert (got[:2].float().abs().min() == 0) and (got[1].float().abs().max() < 2**-120)


def test_gemm_over_the_permuted_output_equals_the_gemm_over_decoded_weights():
    from dist_glm5.quant.mxfp4 import encode

    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 1024, generator=g)
    x = torch.randn(3, 1024, generator=g)
    packed, scales = encode(W)
    perm = custom_ops.input_permutation(1024)
    want = x @ decode(packed, scales, torch.float32).T
    got = x[:, perm] @ tpc_model(packed, scales).float().T
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_loader_without_the_library_is_none_and_checks_gc_kernel_path(fake_hf, tmp_path):
    assert custom_ops.load({custom_ops.LIB_ENV: str(tmp_path / "absent.so")}) is None
    lib = tmp_path / "glm5_ops.so"
    lib.write_bytes(b"")
    with pytest.raises(RuntimeError, match="GC_KERNEL_PATH"):
        custom_ops.load({custom_ops.LIB_ENV: str(lib), "GC_KERNEL_PATH": custom_ops.HABANA_TPC})
    loaded = []
    env = {
        custom_ops.LIB_ENV: str(lib),
        "GC_KERNEL_PATH": f"/opt/x/libglm5_tpc.so:{custom_ops.HABANA_TPC}",
    }
    orig = torch.ops.load_library
    torch.ops.load_library = loaded.append
    try:
        with pytest.raises(AttributeError):  # the fake library registers no glm5 op
            custom_ops.load(env)
    finally:
        torch.ops.load_library = orig
    assert loaded == [str(lib)]


def test_permutation_needs_whole_blocks():
    assert sorted(custom_ops.input_permutation(1024).tolist()) == list(range(1024))
    with pytest.raises(ValueError, match="multiple of 512"):
        custom_ops.input_permutation(256)
