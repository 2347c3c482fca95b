"""The MXFP4 MoE CPU kernel (kernels/mxfp4_moe.c) against an independent fp64 oracle.

The oracle decodes with its own 16-entry E2M1 table and 2^(byte-127) scales (byte 255 = NaN) and
runs the experts loop in float64, so it checks the kernel, the torch reference and the GEMM path
alike. The kernel must build here: gcc is on every developer machine and in CI, so a build
failure FAILS these tests instead of skipping them; so does a code path the CPU supports (its
/proc/cpuinfo flags) that the kernel does not take.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from dist_glm5.kernels import build
from dist_glm5.kernels import mxfp4_moe as K
from dist_glm5.ops.experts import experts_mxfp4_reference

torch.set_num_threads(1)

E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float64,
)
ISAS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")
# the /proc/cpuinfo flags that each path needs (mxfp4_moe.c best_isa)
ISA_FLAGS = {
    "scalar": set(),
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f"},
    "avx512bf16": {"avx512f", "avx512bw", "avx512vbmi", "avx512_bf16"},
    "amx": {"avx512f", "avx512bw", "avx512vbmi", "avx512_bf16", "amx_bf16", "amx_tile"},
}


def cpu_flags() -> set[str] | None:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split()[2:]}


def oracle_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., K/2], [..., K/32] uint8 -> float64 [..., K]; low nibble = even column."""
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
    scale = torch.pow(2.0, scales.double() - 127).masked_fill(scales == 255, float("nan"))
    return E2M1[codes] * scale.repeat_interleave(32, dim=-1)


def oracle_moe(x, ids, tw, w13, s13, w2, s2, emin, emax) -> torch.Tensor:
    xd, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for e in range(emax - emin + 1):
        tok, slot = torch.where(ids.long() == emin + e)
        if len(tok):
            gate, up = F.linear(xd[tok], oracle_decode(w13[e], s13[e])).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, oracle_decode(w2[e], s2[e]))
            out.index_add_(0, tok, y * tw[tok, slot, None].double())
    return out


def make_experts(E, H, I, seed=0, lo=120, hi=131, edge=True):
    """Random codes; scale bytes in [lo, hi), plus the edge bytes 0, 1 and 127 in some blocks
    (they stay small next to the others, so nothing overflows)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(lo, hi, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g)
    s2 = torch.randint(lo, hi, (E, H, I // 32), dtype=torch.uint8, generator=g)
    if edge:
        for s in (s13, s2):
            flat = s.view(-1)
            where = torch.randint(0, flat.numel(), (max(3, flat.numel() // 20),), generator=g)
            edge_bytes = torch.tensor([0, 1, 127], dtype=torch.uint8).repeat(len(where))
            flat[where] = edge_bytes[: len(where)]
    return w13, s13, w2, s2


def routes(T, k, lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(lo, hi + 1, (T, k), dtype=torch.int32, generator=g)
    return ids, torch.rand(T, k, generator=g)


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5):
    got, want = got.double(), want.double()
    scale = want.abs().max().item()
    assert scale > 0 and torch.isfinite(got).all()
    err = (got - want).abs().max().item()
    assert err <= rel * scale + 1e-30, f"max|diff| {err:.3g} > {rel} * max|ref| {scale:.3g}"


@pytest.fixture(scope="module")
def kernel():
    assert K.available(), "the MXFP4 MoE kernel did not build (see the warning logged above)"
    yield K
    K.set_isa(None)


def use_isa(kernel, name: str) -> None:
    """Switch the kernel to `name`: skip if the CPU lacks it, FAIL if the CPU has it and the
    kernel still does not take it (a dispatch bug must not pass as a skip)."""
    if kernel.set_isa(name) == name:
        return
    flags = cpu_flags()
    if flags is not None and ISA_FLAGS[name] <= flags:
        pytest.fail(f"the CPU has {sorted(ISA_FLAGS[name])} but the kernel did not take {name}")
    pytest.skip(f"this CPU has no {name}")


@pytest.fixture(params=ISAS)
def isa(request, kernel):
    use_isa(kernel, request.param)
    yield request.param
    kernel.set_isa(None)


@pytest.fixture(params=["avx512bf16", "amx"])
def bf16_isa(request, kernel):
    """The bf16 w13 path: vdpbf16ps, and on AMX-BF16 tiles."""
    use_isa(kernel, request.param)
    kernel.w13_rows()  # counts from here
    yield request.param
    kernel.set_isa(None)


@pytest.mark.parametrize("H,I", [(64, 32), (256, 128), (160, 96)])
@pytest.mark.parametrize("T", [1, 3, 17, 64, 130])
def test_matches_oracle_and_reference(isa, H, I, T):
    E, k, emin = 6, 4, 10
    w = make_experts(E, H, I, seed=H + T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    ids, tw = routes(T, k, emin - 2, emin + E + 1, seed=T)  # some routes go to other ranks
    want = oracle_moe(x, ids, tw, *w, emin, emin + E - 1)
    fused = K.moe_mxfp4(x, ids, tw, *w, emin, emin + E - 1, gemm_min_routes=1 << 30)
    assert fused.dtype == torch.float32 and fused.shape == (T, H)
    assert_close(fused, want)
    assert_close(K.moe_mxfp4(x, ids, tw, *w, emin, emin + E - 1, gemm_min_routes=2), want)
    assert_close(K.moe_mxfp4(x, ids, tw, *w, emin, emin + E - 1), want)  # default threshold
    if T in (3, 130):
        assert_close(experts_mxfp4_reference(x, ids, tw, *w, emin, emin + E - 1), want)


def test_long_rows_go_by_column_chunks(isa):
    """With more than 2 tokens per expert the kernel splits rows into column chunks that keep x
    in L1 (768 inputs for AVX2's groups of 8, 1536 for AVX-512's groups of 4): H = 2048 and
    I = 800 give chunks with a short tail."""
    E, H, I, T = 2, 2048, 800, 19
    w = make_experts(E, H, I, seed=19)
    x = torch.randn(T, H)
    ids, tw = routes(T, 2, 0, E - 1, seed=19)
    got = K.moe_mxfp4(x, ids, tw, *w, 0, E - 1, gemm_min_routes=1 << 30)
    assert_close(got, oracle_moe(x, ids, tw, *w, 0, E - 1))


@pytest.mark.parametrize("byte", [0, 1, 127, 254])
def test_edge_scale_bytes(isa, byte):
    """up rows scaled by 2^(byte-127) (0: subnormal 2^-127), down rows by 2^(127-byte), so the
    output is O(1) and every intermediate stays finite; x is small where 2^127 could overflow.
    Under scale 2^127 only magnitudes <= 1.5 are finite in fp32 (2 * 2^127 is inf), so those
    rows keep codes 0..3 and their signs (mask 0xBB per byte)."""
    E, H, I, T = 2, 96, 64, 5
    w13, s13, w2, s2 = make_experts(E, H, I, seed=byte, edge=False)
    s13[:, :I] = 127
    s13[:, I:] = byte
    s2[:] = 254 - byte
    (w13[:, I:] if byte == 254 else w2).bitwise_and_(0xBB)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    if byte == 254:
        x *= 2.0**-12
    ids, tw = routes(T, 2, 0, E - 1)
    want = oracle_moe(x, ids, tw, w13, s13, w2, s2, 0, E - 1)
    for thr in (1 << 30, 1):
        assert_close(K.moe_mxfp4(x, ids, tw, w13, s13, w2, s2, 0, E - 1, gemm_min_routes=thr), want)


def test_nan_scale_byte_gives_nan_like_the_reference(isa):
    E, H, I, T = 3, 64, 32, 6
    w = make_experts(E, H, I, edge=False)
    w[1][1, 0, 0] = 255  # expert 1, first gate row, first block: NaN
    x = torch.randn(T, H)
    ids = torch.tensor([[0, 1], [0, 2], [1, 2], [2, 0], [1, 1], [2, 2]], dtype=torch.int32)
    tw = torch.rand(T, 2)
    want = experts_mxfp4_reference(x, ids, tw, *w, 0, E - 1)
    got = K.moe_mxfp4(x, ids, tw, *w, 0, E - 1)
    nan_rows = (ids == 1).any(dim=1)
    assert torch.isnan(want[nan_rows]).all() and torch.isnan(got[nan_rows]).all()
    assert_close(got[~nan_rows], want[~nan_rows])


def test_expert_parallel_slices_sum_to_the_full_layer(kernel):
    E, H, I, T, k = 8, 128, 64, 17, 4
    w = make_experts(E, H, I, seed=3)
    x = torch.randn(T, H)
    ids, tw = routes(T, k, 0, E - 1, seed=3)
    full = K.moe_mxfp4(x, ids, tw, *w, 0, E - 1)
    parts = [
        K.moe_mxfp4(x, ids, tw, *(t[lo : hi + 1] for t in w), lo, hi) for lo, hi in ((0, 2), (3, 7))
    ]
    assert_close(parts[0] + parts[1], full)
    assert_close(full, oracle_moe(x, ids, tw, *w, 0, E - 1))


def test_untouched_experts_are_not_read_and_outside_routes_give_zero(kernel):
    E, H, I, T = 4, 64, 32, 9
    w13, s13, w2, s2 = make_experts(E, H, I, seed=5)
    s13[2] = 255  # expert 2 is NaN everywhere: reading it would poison the output
    s2[2] = 255
    x = torch.randn(T, H)
    ids, tw = routes(T, 3, 0, E - 1, seed=5)
    ids[ids == 2] = 3  # no token goes to expert 2
    ids[0] = 40  # token 0 goes to experts of other ranks only
    got = K.moe_mxfp4(x, ids, tw, w13, s13, w2, s2, 0, E - 1)
    assert torch.isfinite(got).all() and (got[0] == 0).all()
    assert_close(got, oracle_moe(x, ids, tw, w13, s13, w2, s2, 0, E - 1))
    nobody = torch.full((T, 3), 99, dtype=torch.int32)
    assert (K.moe_mxfp4(x, nobody, tw, w13, s13, w2, s2, 0, E - 1) == 0).all()


def test_bf16_input_and_loose_dtypes(isa):
    E, H, I, T, k = 4, 128, 64, 17, 3
    w = make_experts(E, H, I, seed=7)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, tw = routes(T, k, 0, E - 1, seed=7)
    tw16 = tw.to(torch.bfloat16)  # router weights may come in any float dtype
    for got, weights in (
        (K.moe_mxfp4(x, ids.long(), tw16, *w, 0, E - 1), tw16.float()),
        (K.moe_mxfp4(x, ids, tw, *w, 0, E - 1, gemm_min_routes=1), tw),
    ):
        want = oracle_moe(x.float(), ids, weights, *w, 0, E - 1)
        assert got.dtype == torch.bfloat16
        # each output is rounded once to bf16 (8 significant bits)
        assert ((got.double() - want).abs() <= 2.0**-8 * want.abs() + 1e-6 * want.abs().max()).all()
    # a non-contiguous x and fp16 router weights
    xt = torch.randn(H, T).t()
    got = K.moe_mxfp4(xt, ids.long(), tw.half(), *w, 0, E - 1)
    assert_close(got, oracle_moe(xt, ids, tw.half().float(), *w, 0, E - 1))


def test_the_activation_is_silu_within_a_few_ulp(isa):
    """silu(g) * u as the forward computes it (AVX-512: a vector exp in place of libm's expf)
    against float64, over the whole range of g, and inf, nan, zeros and subnormals as
    g / (1 + expf(-g)) * u gives them in fp32."""
    g = torch.cat([
        torch.linspace(-110, 110, 4000), torch.randn(2000) * 4,
        torch.tensor([0.0, -0.0, 1e-40, -1e-40, 88.7, 88.8, 89.0, -88.7, -103.0, -104.5, 200.0,
                      -200.0, float("inf"), float("-inf"), float("nan"), 1e30, -1e30]),
    ])  # fmt: skip
    g = torch.cat([g, torch.zeros(-len(g) % 32)])
    u = torch.rand(len(g), generator=torch.Generator().manual_seed(3)) + 0.5
    got = K.silu_mul(g, u).double()
    gd, ud = g.double(), u.double()
    want = gd / (1 + torch.exp(-gd)) * ud
    fp32 = (g / (1 + torch.exp(-g)) * u).double()  # the special values, as fp32 gives them
    finite = torch.isfinite(want) & (want.abs() > 1e-30)
    ulp = want[finite].abs() * 2.0**-23
    assert ((got[finite] - want[finite]).abs() <= 4 * ulp).all()
    special = ~finite
    assert torch.equal(got[special].isnan(), fp32[special].isnan())
    a, b = got[special], fp32[special]
    assert ((a == b) | ((a - b).abs() <= 1e-37) | b.isnan()).all()  # infs equal, tiny ones near


def test_decode_matches_oracle_bit_for_bit(isa):
    g = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (7, 80), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (7, 5), dtype=torch.uint8, generator=g)
    scales[0, :4] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)
    got = K.decode(packed, scales)
    torch.testing.assert_close(
        got, oracle_decode(packed, scales).float(), rtol=0, atol=0, equal_nan=True
    )


def test_gemm_threshold_by_code_path_and_vendor(kernel, monkeypatch):
    """MKL (torch's fp32 GEMM) runs AVX-512 code on Intel CPUs only: elsewhere the AVX-512 paths
    keep every expert in the fused kernel; AVX2 and scalar keep the table, as does a CPU whose
    vendor cannot be read."""
    T = K.GEMM_MIN_ROUTES
    for isa in K.ISA_NAMES:
        assert K.default_gemm_min_routes(isa, "GenuineIntel") == T[isa]
        assert K.default_gemm_min_routes(isa, "") == T[isa]
        want = K.NEVER if isa.startswith(("avx512", "amx")) else T[isa]
        assert K.default_gemm_min_routes(isa, "AuthenticAMD") == want
    # the forward follows it: 40 routes to each of 2 experts, threshold 32 (Intel's avx2 table
    # figure stands in), then an AMD vendor on an AVX-512 path
    E, H, I = 2, 64, 32
    w = make_experts(E, H, I, seed=11)
    x = torch.randn(80, H)
    ids = (torch.arange(80) % E).int()[:, None]
    tw = torch.rand(80, 1)
    gemm_calls = []
    real = K._gemm_experts
    monkeypatch.setattr(K, "_gemm_experts", lambda *a: gemm_calls.append(a[4]) or real(*a))
    monkeypatch.setitem(K.GEMM_MIN_ROUTES, K._isa, 32)
    monkeypatch.setattr(K, "cpu_vendor", lambda: "GenuineIntel")
    want = oracle_moe(x, ids, tw, *w, 0, E - 1)
    assert_close(K.moe_mxfp4(x, ids, tw, *w, 0, E - 1), want)
    assert gemm_calls == [[0, 1]]
    monkeypatch.setattr(K, "cpu_vendor", lambda: "AuthenticAMD")
    assert_close(K.moe_mxfp4(x, ids, tw, *w, 0, E - 1), want)
    assert gemm_calls == [[0, 1]] * (1 if K._isa.startswith(("avx512", "amx")) else 2)


def test_bad_shapes_are_refused(kernel):
    w13, s13, w2, s2 = make_experts(2, 64, 32)
    x, (ids, tw) = torch.randn(3, 64), routes(3, 2, 0, 1)
    with pytest.raises(ValueError, match="span the 2 local experts"):
        K.moe_mxfp4(x, ids, tw, w13, s13, w2, s2, 0, 2)
    with pytest.raises(ValueError, match="shapes"):
        K.moe_mxfp4(torch.randn(3, 96), ids, tw, w13, s13, w2, s2, 0, 1)


def test_library_is_cached_by_hash(kernel, tmp_path):
    path = build.library_path(K.SOURCE, build.DEFAULT_FLAGS, build.compiler())
    assert path.exists() and path.parent == build.cache_dir()
    mtime = path.stat().st_mtime_ns
    assert build.build(K.SOURCE) == path and path.stat().st_mtime_ns == mtime  # not rebuilt


def test_an_edited_header_rebuilds_the_kernels_that_include_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_GLM5_HOME", str(tmp_path))
    (tmp_path / "k.h").write_text("#define V 1\n")
    src = tmp_path / "k.c"
    src.write_text('#include "k.h"\nint v(void) { return V; }\n')
    lib = build.load(src)
    lib.v.restype = ctypes.c_int
    first = build.library_path(src, build.DEFAULT_FLAGS, build.compiler())
    assert lib.v() == 1 and build.local_includes(src) == [tmp_path / "k.h"]
    (tmp_path / "k.h").write_text("#define V 2\n")
    again = build.load(src)
    again.v.restype = ctypes.c_int
    assert build.library_path(src, build.DEFAULT_FLAGS, build.compiler()) != first
    assert again.v() == 2


def test_processes_building_one_library_at_once_compile_it_once(tmp_path):
    # a pipeline's workers start together: one compiles, the others wait for it and load it
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho x >> {tmp_path}/calls\nsleep 1\nexec gcc "$@"\n')
    cc.chmod(0o755)
    src = tmp_path / "k.c"
    src.write_text("int v(void) { return 7; }\n")
    code = (
        "import ctypes, sys; from dist_glm5.kernels import build; "
        f"lib = ctypes.CDLL(str(build.build(__import__('pathlib').Path({str(src)!r})))); "
        "sys.exit(0 if lib.v() == 7 else 1)"
    )
    env = dict(os.environ, DIST_GLM5_HOME=str(tmp_path / "home"), CC=str(cc))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert (tmp_path / "calls").read_text().count("x") == 1


def test_build_failure_warns_once_and_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DIST_GLM5_HOME", str(tmp_path))
    bad = tmp_path / "broken.c"
    bad.write_text("int f( {\n")
    with caplog.at_level(logging.WARNING, logger="dist_glm5.kernels.build"):
        assert build.load(bad) is None
    assert len(caplog.records) == 1 and "broken.c unavailable" in caplog.records[0].getMessage()
    assert not list((tmp_path / "kernels").glob("*.tmp"))  # no half-written file left behind


def test_disabled_kernel_falls_back_to_the_reference():
    # the fallback is passed in (kernels/ imports no ops/); without one, unavailable is an error;
    # the CPU backend then picks the reference itself
    code = textwrap.dedent("""
        import pytest, torch
        from dist_glm5.kernels import mxfp4_moe as K
        from dist_glm5.ops.experts import REFERENCE, cpu_experts_ops, experts_mxfp4_reference
        assert not K.available()
        assert cpu_experts_ops() is REFERENCE
        g = torch.Generator().manual_seed(0)
        w13 = torch.randint(0, 256, (2, 64, 32), dtype=torch.uint8, generator=g)
        s13 = torch.randint(120, 130, (2, 64, 2), dtype=torch.uint8, generator=g)
        w2 = torch.randint(0, 256, (2, 64, 16), dtype=torch.uint8, generator=g)
        s2 = torch.randint(120, 130, (2, 64, 1), dtype=torch.uint8, generator=g)
        x, ids, tw = torch.randn(3, 64), torch.tensor([[0, 1], [1, 5], [0, 0]]), torch.rand(3, 2)
        got = K.moe_mxfp4(x, ids, tw, w13, s13, w2, s2, 0, 1, fallback=experts_mxfp4_reference)
        assert torch.equal(got, experts_mxfp4_reference(x, ids, tw, w13, s13, w2, s2, 0, 1))
        with pytest.raises(RuntimeError, match="no fallback"):
            K.moe_mxfp4(x, ids, tw, w13, s13, w2, s2, 0, 1)
        print("fallback ok")
    """)
    env = dict(os.environ, DIST_GLM5_KERNELS="0")
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "fallback ok" in r.stdout, r.stderr


# ---------------------------------------------------------------- the AVX512-BF16 w13 path
# With bf16 x it computes gate/up with vdpbf16ps, which reads denormal inputs as zero and flushes
# denormal results: the kernel takes it only where neither can happen (mxfp4_moe.c bf16_exact)
# and counts the rows each way (K.w13_rows), so these tests see which path ran.


def fused_fp32(x, ids, tw, w, emin, emax):
    return K.moe_mxfp4(x, ids, tw, *w, emin, emax, gemm_min_routes=1 << 30, out_dtype=torch.float32)


def on_avx512(fn):
    before = K._isa
    K.set_isa("avx512")
    try:
        return fn()
    finally:
        K.set_isa(before)


@pytest.mark.parametrize(
    "H,I,T",
    [(64, 32, 1), (256, 128, 1), (160, 96, 3), (256, 128, 5), (160, 96, 17), (64, 32, 64)]
    + [(2048, 800, 19)],  # column chunks (see test_long_rows_go_by_column_chunks)
)
def test_bf16_path_matches_oracle_and_the_avx512_path(bf16_isa, H, I, T):
    E, k, emin = 6, 4, 10
    w = make_experts(E, H, I, seed=H + T, edge=False)  # scale bytes 120..130: bf16 is exact
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    ids, tw = routes(T, k, emin - 2, emin + E + 1, seed=T)
    got = fused_fp32(x, ids, tw, w, emin, emin + E - 1)
    bf16_rows, fp32_rows, amx_rows = K.w13_counts()
    assert bf16_rows > 0 and fp32_rows == 0, (bf16_rows, fp32_rows)
    # on AMX the experts with at least 3 tokens (mxfp4_moe.c AMX_MIN_TOKENS), their 2I rows
    local = ids[(ids >= emin) & (ids < emin + E)].long() - emin
    crowded = int((torch.bincount(local, minlength=E) >= 3).sum())
    assert amx_rows == (2 * I * crowded if bf16_isa == "amx" else 0), (amx_rows, crowded)
    assert_close(got, oracle_moe(x.float(), ids, tw, *w, emin, emin + E - 1))
    assert_close(got, on_avx512(lambda: fused_fp32(x, ids, tw, w, emin, emin + E - 1)))


def test_fp32_x_never_takes_the_bf16_path(bf16_isa):
    w = make_experts(2, 64, 32, edge=False)
    x, (ids, tw) = torch.randn(5, 64), routes(5, 2, 0, 1)
    assert_close(fused_fp32(x, ids, tw, w, 0, 1), oracle_moe(x, ids, tw, *w, 0, 1))
    assert K.w13_rows() == (0, 2 * 32 * 2)  # both experts' gate and up rows, in fp32


@pytest.mark.parametrize("byte", [0, 1, 2, 127, 254])
def test_bf16_path_edge_scale_bytes(bf16_isa, byte):
    """test_edge_scale_bytes with bf16 x: up rows of scale bytes 0 and 1 (subnormal weights) and
    2 (weights >= 2^-126, but products with x ~ 2^-10 would be subnormal) go to the fp32 kernels;
    the gate rows (byte 127) and up rows of 127 and 254 (up to 1.5 * 2^127) stay on bf16."""
    E, H, I, T = 2, 96, 64, 5
    w13, s13, w2, s2 = make_experts(E, H, I, seed=byte, edge=False)
    s13[:, :I] = 127
    s13[:, I:] = byte
    s2[:] = 254 - byte
    (w13[:, I:] if byte == 254 else w2).bitwise_and_(0xBB)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    if byte == 254:
        x *= 2.0**-12
    x = x.to(torch.bfloat16)
    ids, tw = routes(T, 2, 0, E - 1)
    w = (w13, s13, w2, s2)
    got = fused_fp32(x, ids, tw, w, 0, E - 1)
    bf16_rows, fp32_rows = K.w13_rows()
    assert (bf16_rows, fp32_rows) == ((E * I, E * I) if byte <= 2 else (2 * E * I, 0))
    assert_close(got, oracle_moe(x.float(), ids, tw, *w, 0, E - 1))


def test_bf16_path_nan_scale_byte(bf16_isa):
    E, H, I, T = 3, 64, 32, 6
    w = make_experts(E, H, I, edge=False)
    w[1][1, 0, 0] = 255  # expert 1, first gate row, first block: NaN
    x = torch.randn(T, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [0, 2], [1, 2], [2, 0], [1, 1], [2, 2]], dtype=torch.int32)
    tw = torch.rand(T, 2)
    got = fused_fp32(x, ids, tw, w, 0, E - 1)
    assert K.w13_rows()[1] > 0  # expert 1's gate rows: fp32
    want = oracle_moe(x.float(), ids, tw, *w, 0, E - 1)
    nan_rows = (ids == 1).any(dim=1)
    assert torch.isnan(got[nan_rows]).all()
    assert_close(got[~nan_rows], want[~nan_rows])


def test_bf16_path_denormal_and_tiny_x_fall_back(bf16_isa):
    """Cases where vdpbf16ps would lose everything, so the kernel must not use it: x of bf16
    denormals (read as 0) under large weights; normal x so small that its products with the up
    rows are fp32 denormals (flushed); subnormal up weights under large x. Large or small w2
    scales bring each output back to a finite, nonzero size."""
    E, H, I, T = 2, 64, 32, 4
    w13, s13, w2, s2 = make_experts(E, H, I, seed=2, edge=False)
    g = torch.Generator().manual_seed(2)
    # bf16 denormals: exponent field 0, nonzero fraction (magnitudes 2^-133 .. 2^-127)
    bits = torch.randint(1, 128, (T, H), generator=g) | (
        torch.randint(0, 2, (T, H), generator=g) << 15
    )
    denormal = bits.to(torch.int16).view(torch.bfloat16)
    assert (denormal.float().abs() < 2.0**-126).all() and (denormal != 0).all()
    s13[:] = 250  # weights ~2^123: gate and up ~2^-7
    s2[:] = 127
    ids, tw = routes(T, 2, 0, E - 1, seed=2)
    rows = len(ids.unique()) * I  # gate (or up) rows of the touched experts
    cases = [(denormal, (w13, s13.clone(), w2, s2.clone()), (0, 2 * rows))]

    def magnitudes(lo: float) -> torch.Tensor:  # |x| in [lo, 2 lo), random signs, bf16
        x = torch.randn(T, H, generator=g).sign() * (1 + torch.rand(T, H, generator=g)) * lo
        return x.to(torch.bfloat16)

    # |x| ~ 2^-120 (normal), gate rows ~2^120 (gate O(1)), up rows ~2^-8: products ~2^-128
    tiny = magnitudes(2.0**-120)
    s13_tiny, s2_tiny = s13.clone(), s2.clone()
    s13_tiny[:, :I] = 247
    s13_tiny[:, I:] = 119
    s2_tiny[:] = 250
    cases.append((tiny, (w13, s13_tiny, w2, s2_tiny), (rows, rows)))
    # subnormal up weights (byte 1: 0.5 * 2^-126 is a bf16 denormal, read as 0) times |x| in
    # [2^10, 2^11): the products would be normal, the weights are not
    big = magnitudes(2.0**10)
    s13_big, s2_big = s13.clone(), s2.clone()
    s13_big[:, :I] = 117
    s13_big[:, I:] = 1
    s2_big[:] = 245
    w2_big = w2 & 0xBB  # |codes| <= 1.5: nothing overflows under 2^118
    cases.append((big, (w13, s13_big, w2_big, s2_big), (rows, rows)))
    for x, w, bf16_fp32_rows in cases:
        got = fused_fp32(x, ids, tw, w, 0, E - 1)
        assert K.w13_rows() == bf16_fp32_rows  # the gate rows of the last two stay on bf16
        assert_close(got, oracle_moe(x.float(), ids, tw, *w, 0, E - 1))
