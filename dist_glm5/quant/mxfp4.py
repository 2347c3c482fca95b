"""MXFP4 codec (OCP Microscaling, E2M1 elements, E8M0 block scales): encode and decode.

Layout (what AMD Quark exports and vLLM loads):
  packed [..., K/2] uint8   two E2M1 codes per byte, element 2j in the LOW nibble, 2j+1 in the
                            high one.
  scales [..., K/32] uint8  one E8M0 byte per block of 32 consecutive elements along the LAST
                            (input) dimension; value 2^(byte-127), 0xFF is NaN.
E2M1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.

Two scale rules, each byte-identical to a real encoder (tests/test_mxfp4_oracles.py checks both):

"quark"  AMD Quark's default ("even") rule, as exported by amd-quark 0.13
         (`StaticScaledRealQuantizer.to_real_quantize_params` +
         `maybe_convert_and_transpose_scale`). The block amax is rounded to
         E2M1's one mantissa bit first (add 1<<21 to its fp32 bits, clear the mantissa), then
         X = clamp(floor(log2(.)) - 2, -127, 127); elements RNE(v / 2^X) to E2M1, saturating at 6.
         Byte quirks reproduced (measured on amd-quark 0.13, x86-64 CPU):
           - a value that rounds to zero is written +0 (nibble 0x0), whatever its sign;
           - scale byte = max(X + 127, 1): an all-zero block, and any block with X = -127
             (amax < 1.75 * 2^-125), gets byte 1 while its elements were divided by 2^-127;
           - amax >= 1.75 * 2^127 (rounds to inf) or inf gives X = 127, byte 254;
           - an infinite element is written as code 6 (value 4, not 6): Quark's bit packer reads
             the exponent bits of inf;
           - a block containing NaN gets scale byte 127 and nibble 0x7 everywhere, 0xF for a NaN
             whose sign bit is set.
"ocp"    The OCP spec floor rule X = floor(log2(amax)) - 2, elements RNE(v / 2^X) saturating at
         +-6, byte-identical to torchao's `to_mx(..., ScaleCalculationMode.FLOOR)` (torchao 0.18):
           - the sign of zero is kept: a negative value that rounds to zero (and -0.0) is written
             0x8 (-0), as torchao does and as an IEEE round-to-nearest conversion does. We keep
             this so that served bytes compare equal with torchao's; -0 and +0 decode identically.
           - byte = clamp(X + 127, 0, 255): amax < 2^-124 gives byte 0, but elements are divided
             by 2^-126 (torchao clamps the fp32 scale to the smallest normal);
           - inf amax gives byte 253 (exponent field 255 - 129 + 127), inf elements code 7;
           - a block containing NaN gets byte 255; in it finite values are written +-0, +-inf
             0xB, and a NaN 2..4 by its payload (0x3 for the usual 0x7FC00000) plus its sign bit.
The NaN/inf bytes follow x86-64 NaN propagation (what both oracles do on this machine); weights
with NaN/inf are a bug upstream, the point is only that the codec does not crash and is stable.

Speed: this is the inner loop of a ~1.5 TB converter, so encode works on the 16-bit bf16 bit
pattern with integer ops and one table lookup per element, in row chunks that stay in cache:
  amax       integer max of |bits| (bf16 bits are ordered like the values);
  scale      integer ops on the amax bits (no log2, no float64);
  elements   t = |bits| - (X << 7) is the bf16 pattern of v / 2^X (exact: power-of-two scaling);
             a 1348-entry table maps (clamped t, sign) to the 4-bit code, ties to even included.
fp32 input is first reduced to bf16 with round-to-odd (sticky bit into the last mantissa bit),
which keeps both the scale and the later round-to-nearest-even to 2 significant bits exact.
Blocks that need care (NaN/inf, or amax < 2^-119 where bf16 subnormals break the bit trick)
are redone by a small float path on just those blocks.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Literal

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

Rule = Literal["quark", "ocp"]
RULES: tuple[str, ...] = ("quark", "ocp")
BLOCK = 32

# E2M1 code -> value (codes 8..15 are the negatives, code 8 is -0).
E2M1_VALUES: tuple[float, ...] = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)

# Elements per encode chunk (1 MB of bf16; the temporaries are ~8 B per element).
_CHUNK_ELEMS = 1 << 19

# bf16 bit patterns bounding the lookup table: below 0.125 every code is 0, above 5.0 every code
# is 7 (saturation), so t = bits(v / 2^X) is clamped to [0x3E00, 0x40A1] before the lookup.
_LUT_LO = 0x3E00  # 0.125
_LUT_HI = 0x40A1  # next bf16 after 5.0
_LUT_SPAN = _LUT_HI - _LUT_LO + 1  # 674 positive entries, then 674 negative ones
_BF16_INF = 0x7F80
_BF16_ROUNDS_TO_INF = 0x7F60  # 1.75 * 2^127: Quark's mantissa rounding carries it to inf
# Blocks whose |amax| bf16 bits are below this (exponent field < 8, amax < 2^-119) go to the float
# path: there X <= -121 and a bf16 subnormal element would be mis-scaled by the bit trick.
_TINY_AMAX_BITS = 8 << 7

if sys.byteorder != "little":  # pragma: no cover - the packer reads int16 pairs of bytes
    raise ImportError("dist_glm5.quant.mxfp4 assumes a little-endian host")


def _e2m1_code_of_abs(a: Tensor) -> Tensor:
    """|v / 2^X| (fp32, >= 0) -> E2M1 magnitude code 0..7, round half to even, saturating.

    Each midpoint between neighbouring E2M1 values goes to the even code: 0.25 -> 0, 0.75 -> 1.0,
    1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0. So the code is the number of
    midpoints below a, with ">" at midpoints that round down and ">=" at those that round up.
    inf counts as above every midpoint (code 7); NaN as below all (code 0).
    """
    code = (a > 0.25).to(torch.uint8)
    code += a >= 0.75
    code += a > 1.25
    code += a >= 1.75
    code += a > 2.5
    code += a >= 3.5
    code += a > 5.0
    return code


def _build_luts() -> dict[str, Tensor]:
    """Per rule, the [2 * _LUT_SPAN] uint8 table (clamped bf16 bits of |v/2^X|, sign) -> code."""
    bits = torch.arange(_LUT_LO, _LUT_HI + 1, dtype=torch.int32).to(torch.int16)
    mag = _e2m1_code_of_abs(bits.view(torch.bfloat16).float())
    assert mag[0] == 0 and mag[-1] == 7
    quark_neg = torch.where(mag == 0, mag, mag | 8)  # Quark writes +0 for a value rounding to 0
    ocp_neg = mag | 8  # torchao keeps the sign of zero
    return {"quark": torch.cat([mag, quark_neg]), "ocp": torch.cat([mag, ocp_neg])}


_LUTS = _build_luts()

# Common-path table: indexed directly by (sign-extended bf16 bits) - offset + _WIDE_BASE, which
# folds the clamp and the sign into one lookup. With every block normal, offset = (X << 7) + _LUT_LO
# lies in [384, 31872], so positive values land in [_WIDE_BASE - 31872, _WIDE_BASE + 768] and
# negative ones (bits = |bits| - 32768) in [0, _WIDE_BASE - 32000]: disjoint ranges of one 65K-entry
# table.
_WIDE_BASE = 32768 + 31872
_WIDE_SIZE = _WIDE_BASE + 0x7FFF - _LUT_LO + 1


def _build_wide_luts() -> dict[str, Tensor]:
    i = torch.arange(_WIDE_SIZE, dtype=torch.int64)
    t = i - _WIDE_BASE  # positive values: t = |bits| - offset
    neg = t < -32000
    t = torch.where(neg, t + 32768, t).clamp(0, _LUT_SPAN - 1) + torch.where(neg, _LUT_SPAN, 0)
    return {rule: lut[t] for rule, lut in _LUTS.items()}


_WIDE_LUTS = _build_wide_luts()
# 2^e for e in -127..127 as exact fp32 (2^-127 is subnormal), indexed by e + 127.
_POW2 = torch.tensor([math.ldexp(1.0, e) for e in range(-127, 128)], dtype=torch.float32)
# E8M0 byte -> scale value; 0xFF is NaN.
_E8M0_VALUES = torch.tensor(
    [math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], dtype=torch.float32
)
# packed byte -> (value of low nibble, value of high nibble)
_PAIR_VALUES = torch.tensor(
    [[E2M1_VALUES[b & 15], E2M1_VALUES[b >> 4]] for b in range(256)], dtype=torch.float32
)


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(
            f"unknown MXFP4 scale rule {rule!r}; use one of {RULES} "
            "('quark' = AMD Quark's default even rule, 'ocp' = OCP floor rule as in torchao)"
        )


def _scale_from_amax_bits(amax: Tensor, rule: str) -> tuple[Tensor, Tensor]:
    """amax: bf16 bit pattern of each block's max |v| (int16, [...]).

    Returns (scale byte uint8 [...], X_el int32 [...]) where X_el is the exponent the elements
    are divided by (differs from byte - 127 in the quirky tiny-amax range of both rules).
    """
    a = amax.to(torch.int32)
    is_nan = a > _BF16_INF
    if rule == "quark":
        # Round the amax mantissa to one bit (in bf16 terms 1<<21 of fp32 is 1<<5), keep the
        # exponent.
        e = (a + 0x20) >> 7
        x = torch.clamp(e - 129, -127, 125)  # floor(log2(rounded amax)) - emax, E2M1 emax = 2
        x = torch.where(e >= 255, 127, x)  # rounded to inf: Quark clamps log2 = inf to 127
        byte = torch.clamp(x + 127, min=1)  # Quark's to_e8m0_uint8 floors the scale at 2^-126
        byte = torch.where(is_nan, 127, byte)  # log2(NaN) cast to int16 is 0 on x86 -> 0 + 127
        x_el = x
    else:
        e = a >> 7
        x = torch.clamp(e - 129, -127, 128)
        byte = torch.where(is_nan, 255, x + 127)
        x_el = torch.clamp(x, min=-126)  # torchao clamps the fp32 scale to the smallest normal
    return byte.to(torch.uint8), x_el


def _encode_blocks_float(xb: Tensor, x_el: Tensor, nan_block: Tensor, rule: str) -> Tensor:
    """Float path for a few special blocks: xb [n, 32] (any float dtype), x_el [n] int32,
    nan_block [n] bool -> codes uint8 [n, 32] (sign included).

    Used for blocks with NaN/inf or a tiny amax. Also the readable statement of both rules.
    """
    xf = xb.to(torch.float32)
    neg = xf.view(torch.int32) < 0  # sign bit, also of -0.0 and of NaN
    inv_scale = _POW2.to(xf.device)[(127 - x_el.clamp(-127, 127)).long()]  # 2^-X_el, exact
    a = (xf * inv_scale[:, None]).abs_()  # |v / 2^X|: a power-of-two scaling, one rounding at most
    code = _e2m1_code_of_abs(a)
    is_nan = torch.isnan(xf)
    is_inf = torch.isinf(xf)
    nb = nan_block[:, None]
    if rule == "quark":
        code = torch.where(is_inf, 6, code).to(torch.uint8)  # Pack_fp4 reads inf's bits as code 6
        code |= (neg & (code != 0)).to(torch.uint8) << 3  # rounds to zero -> +0
        # NaN block: every element is divided by a +NaN scale and stays +NaN (code 7), except an
        # input NaN, which x86 propagates with its own sign.
        nan_code = torch.where(is_nan & neg, 15, 7).to(torch.uint8)
    else:
        code |= neg.to(torch.uint8) << 3
        # NaN block: torchao divides by an infinite scale: finite -> +-0, +-inf -> x86's default
        # NaN 0xFFC00000, NaN -> itself made quiet. Its f32->f4 bit trick then turns a NaN's
        # magnitude bits q into ((q - (126 << 23) + (1 << 21) - 1 + 1) >> 22) & 7: 2..4 by payload.
        q = (xf.view(torch.int32) & 0x7FFFFFFF) | 0x00400000
        q = torch.where(is_inf, 0x7FC00000, q)
        nan_neg = neg | is_inf
        nan_code = (((q - 0x3F000000 + 0x200000) >> 22) & 7).to(torch.uint8)
        nan_code = torch.where(is_nan | is_inf, nan_code, 0).to(torch.uint8)
        nan_code |= nan_neg.to(torch.uint8) << 3
    return torch.where(nb, nan_code, code)


def _bf16_bits(x: Tensor) -> Tensor:
    """x [r, K] float -> int16 [r, K]: bf16 bit pattern; fp32 (and fp16 via fp32) rounded to odd.

    Round-to-odd (truncate, then OR the sticky bit into the last mantissa bit) keeps everything
    later rounding needs: the exponent and top mantissa bits are untouched (so both scale rules
    see the same amax), and a round-to-nearest-even to E2M1's 2 significant bits of a value rounded
    to odd with 8 significant bits equals the direct rounding.
    """
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16)
    if x.dtype == torch.float16:
        x = x.to(torch.float32)
    u = x.view(torch.int32)
    s = (u & 0xFFFF) + 0xFFFF  # bit 16 is set iff the 16 dropped bits are not all zero (sticky)
    s |= u
    s >>= 16  # arithmetic: keeps the sign bit in bit 15 of the int16 below
    return s.to(torch.int16)


def _encode_rows(x: Tensor, rule: str, packed_out: Tensor, scales_out: Tensor) -> int:
    """Encode x [r, K] (contiguous) into packed_out [r, K/2] and scales_out [r, K/32].

    Returns the number of blocks sent to the float path.
    """
    r, k = x.shape
    nb = k // BLOCK
    bits = _bf16_bits(x)  # [r, K] int16
    t = bits & 0x7FFF  # |v| bits, ordered like |v|
    amax = t.view(r, nb, BLOCK).amax(dim=-1)  # [r, nb] int16
    lo, hi = (int(v) for v in torch.aminmax(amax))
    rare = lo < _TINY_AMAX_BITS or hi >= _BF16_ROUNDS_TO_INF
    if not rare:
        # Common case, every block normal: X = E - 129 lies in [-121, 125], no clamp applies, and
        # (X << 7) is the exponent field itself, so both byte and offset are 2-3 int16 ops.
        e_bits = (
            (amax + 0x20) if rule == "quark" else amax.clone()
        )  # quark: round the amax mantissa
        e_bits &= ~0x7F  # E << 7
        scales_out.copy_((e_bits >> 7) - 2)  # byte = X + 127 = E - 2
        # index = bits - offset + _WIDE_BASE with
        # offset = (X << 7) + _LUT_LO = (E << 7) - (129 << 7) + _LUT_LO
        idx = bits.view(r, nb, BLOCK).to(torch.int32)
        idx -= e_bits.to(torch.int32).sub_((129 << 7) - _LUT_LO + _WIDE_BASE)[..., None]
        lut = _WIDE_LUTS[rule] if x.device.type == "cpu" else _WIDE_LUTS[rule].to(x.device)
        codes = torch.index_select(lut, 0, idx.view(-1))
        pairs = codes.view(torch.int16)
        pairs = pairs | (pairs >> 4)
        packed_out.view(-1).copy_(pairs)
        return 0
    else:
        byte, x_el = _scale_from_amax_bits(amax, rule)
        scales_out.copy_(byte)
        offset = ((x_el << 7) + _LUT_LO).to(torch.int16)  # [r, nb]

    # t := bf16 bits of |v| / 2^X_el, shifted so that 0.125 is 0; clamp to the table's span.
    t = t.view(r, nb, BLOCK)
    t.sub_(offset[..., None])
    t.clamp_(0, _LUT_SPAN - 1)
    sign = bits.view(r, nb, BLOCK) >> 15  # 0 or -1 (arithmetic shift; a compare to bool is slower)
    sign &= _LUT_SPAN
    t += sign  # negative values index the second half of the table
    lut = _LUTS[rule] if x.device.type == "cpu" else _LUTS[rule].to(x.device)
    codes = torch.index_select(lut, 0, t.view(-1).to(torch.int32))  # [r*K] uint8

    n_special = 0
    if lo < _TINY_AMAX_BITS or hi >= _BF16_INF:
        special = (amax < _TINY_AMAX_BITS) | (amax >= _BF16_INF)  # [r, nb]
        n_special = int(special.sum())
        fixed = _encode_blocks_float(
            x.view(r, nb, BLOCK)[special], x_el[special], amax[special] > _BF16_INF, rule
        )
        codes.view(r, nb, BLOCK)[special] = fixed

    # Two codes -> one byte: as int16 a pair is lo | hi << 8; (c | c >> 4) has lo | hi << 4 in its
    # low byte.
    pairs = codes.view(torch.int16)
    pairs = pairs | (pairs >> 4)
    packed_out.view(-1).copy_(pairs)  # int16 -> uint8 keeps the low byte
    return n_special


def encode(
    w: Tensor, rule: Rule = "quark", rows_per_chunk: int | None = None
) -> tuple[Tensor, Tensor]:
    """Quantise w [..., K] to MXFP4 along its last (input) dimension.

    Returns (packed uint8 [..., K/2], scales uint8 [..., K/32]); see the module docstring for the
    layout and the two rules. Accepts bf16, fp16 or fp32 (values are handled exactly, as fp32).
    Rows are processed `rows_per_chunk` at a time (default: about 512K elements per chunk), so
    the temporaries stay small and in cache whatever the size of w.
    """
    _check_rule(rule)
    if not isinstance(w, Tensor) or w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        got = w.dtype if isinstance(w, Tensor) else type(w).__name__
        raise TypeError(
            f"MXFP4 encode takes a bf16, fp16 or fp32 tensor, got {got}; "
            "convert it with .to(torch.float32) first"
        )
    if w.dim() == 0 or w.shape[-1] % BLOCK != 0:
        shape = tuple(w.shape)
        k = shape[-1] if shape else None
        raise ValueError(
            f"MXFP4 encode needs the last dimension to be a multiple of {BLOCK} (blocks of {BLOCK} "
            f"along the input dimension), got shape {shape} (last dim {k}); pad the input "
            f"dimension with zeros to a multiple of {BLOCK} (or keep this tensor in bf16)"
        )
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    x = w.reshape(-1, k)
    rows = x.shape[0]
    packed = torch.empty(rows, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows, k // BLOCK, dtype=torch.uint8, device=w.device)
    if rows_per_chunk is None:
        rows_per_chunk = max(1, _CHUNK_ELEMS // max(k, 1))
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    n_special = 0
    for start in range(0, rows, rows_per_chunk):
        stop = min(rows, start + rows_per_chunk)
        n_special += _encode_rows(
            x[start:stop].contiguous(), rule, packed[start:stop], scales[start:stop]
        )
    if n_special:
        logger.debug(
            "mxfp4.encode(%s): %d of %d blocks had NaN/inf or amax < 2^-119 (float path)",
            rule,
            n_special,
            scales.numel(),
        )
    return packed.view(*lead, k // 2), scales.view(*lead, k // BLOCK)


def encode_chunked(
    w: Tensor, rule: Rule = "quark", rows_per_chunk: int = 256
) -> tuple[Tensor, Tensor]:
    """encode() with an explicit number of rows per chunk: peak extra memory is the output
    (K/2 + K/32 bytes per row) plus ~8 bytes per element of one chunk."""
    return encode(w, rule, rows_per_chunk=rows_per_chunk)


def decode(
    packed: Tensor,
    scales: Tensor,
    dtype: torch.dtype = torch.bfloat16,
    rows_per_chunk: int | None = None,
) -> Tensor:
    """packed uint8 [..., K/2], scales uint8 [..., K/32] -> values [..., K] in dtype.

    value = E2M1(code) * 2^(byte - 127), computed exactly in fp32 then cast; byte 0xFF gives NaN.
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(
            f"MXFP4 decode takes uint8 packed and scales, got {packed.dtype} and {scales.dtype}"
        )
    if (
        packed.dim() == 0
        or packed.shape[:-1] != scales.shape[:-1]
        or packed.shape[-1] * 2 != scales.shape[-1] * BLOCK
    ):
        raise ValueError(
            f"MXFP4 shapes do not match: packed {tuple(packed.shape)} needs scales "
            f"{tuple(packed.shape[:-1]) + (packed.shape[-1] * 2 // BLOCK,)} (one byte per {BLOCK} "
            f"elements = {BLOCK // 2} packed bytes), got {tuple(scales.shape)}"
        )
    lead, half = tuple(packed.shape[:-1]), packed.shape[-1]
    k = half * 2
    nb = k // BLOCK
    p = packed.reshape(-1, half)
    s = scales.reshape(-1, nb)
    rows = p.shape[0]
    out = torch.empty(rows, k, dtype=dtype, device=packed.device)
    pair_values = _PAIR_VALUES.to(packed.device)
    scale_values = _E8M0_VALUES.to(packed.device)
    if rows_per_chunk is None:
        rows_per_chunk = max(1, _CHUNK_ELEMS // max(k, 1))
    for start in range(0, rows, rows_per_chunk):
        stop = min(rows, start + rows_per_chunk)
        r = stop - start
        vals = torch.index_select(
            pair_values, 0, p[start:stop].reshape(-1).to(torch.int32)
        )  # [r*K/2, 2]
        vals = vals.view(r, nb, BLOCK)
        vals.mul_(
            torch.index_select(scale_values, 0, s[start:stop].reshape(-1).to(torch.int32)).view(
                r, nb, 1
            )
        )
        out[start:stop].copy_(vals.view(r, k))
    return out.view(*lead, k)
