"""The fused selection (kernels/dsa_select.c) against the torch path it replaces: index scores in
capped chunks, the exact top-k with the reference tie rule, the slot list. Keys in blocks
scattered through the store, a partial last block, rows with fewer causal keys than top-k, bf16
and fp32 stores, head counts off the kernel's tile of 4, decode-sized and prefill-sized row
counts, the row blocks `dsa.select_fused` splits a chunk into, and integer-valued data where
scores tie exactly (sums of small integers times a power of two are exact in any order, so the
tie rule itself is compared). Int8 keys (quant/index_q8.py) on the kernel's three paths (AMX and
AVX-512 VNNI where the CPU has them, and the portable one) against the torch form of their
scores."""

from __future__ import annotations

import pytest
import torch

from dist_glm5.kernels import dsa_select as K
from dist_glm5.model import dsa
from dist_glm5.model.kv_cache import KeySlots
from dist_glm5.ops.topk import select_topk_sorted
from dist_glm5.quant import index_q8


def torch_path(q, w, store, keys, q_pos, topk, D):
    s = dsa.index_scores_capped(q, w, store, keys, D, 512 << 20)
    keep = select_topk_sorted(s, q_pos, topk)
    return (keep, *dsa.selected_slots(keep, keys, topk))


def _store(x: torch.Tensor, dtype) -> torch.Tensor:
    """Key rows x as a store of `dtype`, or "int8" (quant/index_q8.py rows)."""
    return index_q8.pack(x.float()) if dtype == "int8" else x.to(dtype)


def _kernel_path(fast: str, uses):
    """A fixture running a test on the kernel's `fast` path (skipped where this CPU lacks it)
    and on its portable one."""

    @pytest.fixture(params=[fast, "portable"])
    def path(request):
        if request.param == fast and not uses(64):
            pytest.skip(f"this CPU has no {fast}: the portable path is the one it runs")
        K.force_portable(request.param == "portable")
        yield request.param
        K.force_portable(False)

    return path


@pytest.fixture(params=["amx", "vnni", "portable"])
def q8_path(request):
    """int8 keys on each of the kernel's three paths: AMX, AVX-512 VNNI (AMX off) and portable
    (each skipped where this CPU lacks it)."""
    if request.param == "amx" and not K.uses_amx(64):
        pytest.skip("this CPU has no AMX-INT8 (or the kernel may not use it)")
    if request.param == "vnni" and not K.uses_vnni(64):
        pytest.skip("this CPU has no AVX-512 VNNI: the portable path is the one it runs")
    with K.int8_path(request.param):
        yield request.param


bf16_path = _kernel_path("bf16dot", K.uses_bf16dot)  # bf16 keys, bf16 queries: AVX512-BF16


def case(L, dtype, integers, n=3, H=8, seed=0):
    g = torch.Generator().manual_seed(L + seed)
    # integers: D = 64 makes the score scale 1/8, so every score is exact in any summation order
    bs, D = 16, (64 if integers else 32)
    nblk = -(-L // bs)
    store_blocks = nblk + 7
    if integers:  # many exact ties
        store = _store(torch.randint(-2, 3, (store_blocks * bs, D), generator=g), dtype)
        q = torch.randint(-1, 2, (n, H, D), generator=g).bfloat16()
        w = torch.randint(0, 3, (n, H), generator=g).float()
    else:
        store = _store(torch.randn(store_blocks * bs, D, generator=g), dtype)
        q = torch.randn(n, H, D, generator=g).bfloat16()
        w = torch.randn(n, H, generator=g)
    keys = KeySlots(torch.randperm(store_blocks, generator=g)[:nblk], bs, L)
    if n == 3:  # decode-like rows: the last, an early and the one before last
        q_pos = torch.tensor([L - 1, min(L - 1, 10), max(0, L - 2)])
    else:  # a prefill chunk's rows: the last n positions
        q_pos = torch.arange(max(0, L - n), max(0, L - n) + n).clamp(max=L - 1)
    return q, w, store, keys, q_pos, D


@pytest.mark.parametrize("L", [1, 50, 64, 1000, 5000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("integers", [False, True])
def test_fused_selection_equals_the_torch_path(L, dtype, integers, bf16_path):
    assert K.available(), "gcc is on every machine we run on: the kernel must build"
    q, w, store, keys, q_pos, D = case(L, dtype, integers)
    want = torch_path(q, w, store, keys, q_pos, 64, D)
    got = K.select_rows(q, w, store, keys, q_pos, 64, D)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("L", [1, 50, 64, 1000, 5000])
@pytest.mark.parametrize("integers", [False, True])
def test_int8_keys_select_as_the_torch_form(L, integers, q8_path):
    q, w, store, keys, q_pos, D = case(L, "int8", integers)
    want = torch_path(q, w, store, keys, q_pos, 64, D)
    got = K.select_rows(q, w, store, keys, q_pos, 64, D)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n,H", [(40, 8), (70, 6), (33, 17)])
@pytest.mark.parametrize("integers", [False, True])
def test_prefill_rows_and_odd_head_counts_equal_the_torch_path(n, H, integers, bf16_path):
    # H = 6 and 17 leave heads over from the kernel's tile of 4; n > 1 splits rows over threads
    q, w, store, keys, q_pos, D = case(3000, torch.bfloat16, integers, n=n, H=H, seed=n)
    want = torch_path(q, w, store, keys, q_pos, 64, D)
    got = K.select_rows(q, w, store, keys, q_pos, 64, D)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n,H", [(40, 8), (33, 17), (2, 3)])
def test_int8_keys_prefill_rows_and_odd_head_counts(n, H, q8_path):
    # the VNNI path takes heads 8 at a time: 17 and 3 leave a partial group
    q, w, store, keys, q_pos, D = case(3000, "int8", False, n=n, H=H, seed=n)
    want = torch_path(q, w, store, keys, q_pos, 64, D)
    got = K.select_rows(q, w, store, keys, q_pos, 64, D)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "n,H,D", [(1, 16, 32), (1, 8, 64), (1, 32, 128), (2, 32, 128), (1, 12, 96)]
)
def test_int8_keys_at_the_models_shapes(n, H, D, q8_path):
    """A decode row (and an MTP pair) at the embedded model's indexer (16 heads x 32), the bench
    model's (8 x 64) and GLM-5's (32 x 128), and one off the tiles (12 x 96: a partial head tile
    and K chunk): AMX keeps a lone row's query tiles loaded across the keys."""
    g = torch.Generator().manual_seed(D + n)
    L, bs = 2000, 64
    keys = KeySlots(torch.randperm(40, generator=g)[:32], bs, L)
    store = index_q8.pack(torch.randn(40 * bs, D, generator=g))
    q, w = torch.randn(n, H, D, generator=g), torch.randn(n, H, generator=g)
    q_pos = torch.tensor([L - 1, L - 2][:n])
    want = torch_path(q, w, store, keys, q_pos, 128, D)
    got = K.select_rows(q, w, store, keys, q_pos, 128, D)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_kernel_quantises_queries_as_index_q8():
    """Half-way values (x / scale = k + 0.5: nearest even), the clamp at 127, an all-zero row
    (scale 1), subnormals and huge values: the same ints and scales as index_q8.quantise."""
    g = torch.Generator().manual_seed(4)
    rows = [
        torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 126.5, -126.5, 1.5]),
        torch.zeros(8),
        torch.tensor([1e-40, -3e-39, 2e-39, 0.0, 1e-45, -1e-45, 5e-40, 1e-38]),
        torch.tensor([3e38, -3e38, 1e30, 7.0, -1e38, 2.5e38, 0.0, 1.0]),
    ]
    q = torch.cat([torch.stack(rows), torch.randn(60, 8, generator=g) * 10])
    want_v, want_s = index_q8.quantise(q)
    got_v, got_s = K.quantise(q)
    assert torch.equal(got_v, want_v.float()) and torch.equal(got_s, want_s)


def test_int8_keys_of_other_widths(q8_path):
    """index_head_dim 128 (GLM-5's) and 132 (past one 64-byte row), and 30 (not a multiple of 4:
    the portable path on every CPU)."""
    for D in (128, 132, 30):
        g = torch.Generator().manual_seed(D)
        L, bs = 700, 64
        keys = KeySlots(torch.randperm(12, generator=g)[:11], bs, L)
        store = index_q8.pack(torch.randn(12 * bs, D, generator=g))
        q, w = torch.randn(2, 5, D, generator=g), torch.rand(2, 5, generator=g)
        q_pos = torch.tensor([L - 1, 300])
        want = torch_path(q, w, store, keys, q_pos, 64, D)
        got = K.select_rows(q, w, store, keys, q_pos, 64, D)
        for a, b in zip(got, want):
            assert torch.equal(a, b), D


def test_bf16_keys_of_other_widths_and_fp32_queries(bf16_path):
    """index_head_dim 128 (GLM-5's), 30 (pairs, not a multiple of 16 dwords) and 33 (odd: the
    portable path on every CPU); and queries that are not bf16 values (an fp32 model's over a bf16
    store), which the AVX512-BF16 path would round: the portable path takes them."""
    for D, qtype in ((128, torch.bfloat16), (30, torch.bfloat16), (33, torch.bfloat16),
                     (64, torch.float32)):  # fmt: skip
        g = torch.Generator().manual_seed(D)
        L, bs = 700, 64
        keys = KeySlots(torch.randperm(12, generator=g)[:11], bs, L)
        store = torch.randn(12 * bs, D, generator=g).bfloat16()
        q, w = torch.randn(2, 5, D, generator=g).to(qtype), torch.rand(2, 5, generator=g)
        q_pos = torch.tensor([L - 1, 300])
        want = torch_path(q, w, store, keys, q_pos, 64, D)
        got = K.select_rows(q, w, store, keys, q_pos, 64, D)
        for a, b in zip(got, want):
            assert torch.equal(a, b), D


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, "int8"])
@pytest.mark.parametrize("integers", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_select_many_equals_the_torch_path_per_sequence(dtype, integers, threads, bf16_path):
    """A decode batch in one call: sequences of 1, 2 and 3 rows (a decode row, an MTP pair,
    a few rows), some with fewer keys than top-k, their block tables apart in one store: each
    sequence's slots and valid equal the torch path's, padded to top-k."""
    from dist_glm5.ops.key_slots import RowsKeys

    topk, bs, D, H = 64, 16, (64 if integers else 32), 8
    lengths, counts = [1, 50, 64, 1000, 5000], [1, 2, 1, 3, 2]
    g = torch.Generator().manual_seed(7)
    blocks = [-(-L // bs) for L in lengths]
    order = torch.randperm(sum(blocks) + 9, generator=g)
    store = _store(
        torch.randint(-2, 3, (len(order) * bs, D), generator=g)
        if integers
        else torch.randn(len(order) * bs, D, generator=g),
        dtype,
    )
    keys, at = [], 0
    for L, nb in zip(lengths, blocks):
        keys.append(KeySlots(order[at : at + nb], bs, L))
        at += nb
    n = max(counts)
    R = sum(counts)
    q = (
        torch.randint(-1, 2, (R, H, D), generator=g)
        if integers
        else torch.randn(R, H, D, generator=g)
    ).bfloat16()
    w = (
        torch.randint(0, 3, (R, H), generator=g).float()
        if integers
        else torch.randn(R, H, generator=g)
    )
    tok = torch.zeros(len(lengths), n, dtype=torch.int64)
    q_pos = torch.zeros(len(lengths), n, dtype=torch.int64)
    r = 0
    for b, (L, c) in enumerate(zip(lengths, counts)):
        tok[b, :c] = torch.arange(r, r + c)
        q_pos[b, :c] = torch.arange(L - c, L).clamp(min=0)
        r += c
    real = torch.cat([torch.arange(b * n, b * n + c) for b, c in enumerate(counts)])
    rows = RowsKeys.of(tok.reshape(-1)[real], q_pos.reshape(-1)[real], counts, keys)
    torch.set_num_threads(threads)
    try:
        slots, valid = K.select_many(q[rows.tok], w[rows.tok], store, rows, topk, D)
    finally:
        torch.set_num_threads(2)
    r = 0
    for c, k in zip(counts, keys):
        qp = rows.q_pos[r : r + c]
        _, ws, wv = torch_path(q[r : r + c], w[r : r + c], store, k, qp, topk, D)
        kk = ws.shape[1]
        assert torch.equal(slots[r : r + c, :kk], ws) and torch.equal(valid[r : r + c, :kk], wv)
        assert not valid[r : r + c, kk:].any()  # padding past the sequence's keys
        r += c


def test_select_fused_in_row_blocks_equals_select_and_slots():
    from dist_glm5.backends import get_backend
    from dist_glm5.model.dsa_config import DSAConfig

    q, w, store, keys, q_pos, D = case(3000, torch.bfloat16, False, n=50, H=8, seed=5)
    cfg = DSAConfig(mode="sparse", gather_cap_bytes=3000 * 9 * 16)  # blocks of 16 rows
    assert dsa.score_rows(cfg, 3000) == 16
    ops = get_backend("cpu").ops()
    keep, slots, valid = dsa.select_fused(q, w, store, keys, q_pos, 64, D, cfg, ops)
    want = dsa.select(q, w, store, keys, q_pos, 64, D, cfg, ops)
    assert torch.equal(keep, want)
    ws, wv = dsa.selected_slots(want, keys, 64)
    assert torch.equal(slots, ws) and torch.equal(valid, wv)


def test_the_model_uses_it_for_prefill_and_decode_and_tokens_are_unchanged(default_model_dir):
    from dataclasses import replace

    from runtime_util import prompts

    from dist_glm5.backends import get_backend
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    ops = get_backend("cpu").ops()
    assert ops.select_rows is K.select_rows and ops.select_many is K.select_many
    calls, batched = [], []

    def spy(*a):
        calls.append(a[0].shape[0])
        return K.select_rows(*a)

    def spy_many(*a):
        batched.append(a[0].shape[0])
        return K.select_many(*a)

    sparse = DSAConfig(mode="sparse")
    fused = load_model(
        default_model_dir, ops=replace(ops, select_rows=spy, select_many=spy_many), dsa=sparse
    )
    plain = load_model(
        default_model_dir, ops=replace(ops, select_rows=None, select_many=None), dsa=sparse
    )
    ps, P = prompts([150, 90], seed=2), SamplingParams(max_tokens=8, ignore_eos=True)
    assert [x.token_ids for x in generate(fused, ps, P)] == [
        x.token_ids for x in generate(plain, ps, P)
    ]
    # prefill: each prompt's rows in one call per full layer; decode: both sequences' rows in
    # one call per full layer
    assert set(calls) == {150, 90} and set(batched) == {2}


def test_vnni_rate_where_the_vnni_path_runs():
    """`bench longctx`'s scan floor divides by vnni_rate: the spin loop it times reports the
    instructions it ran (16 a turn) where int8 keys take the VNNI path; the loop runs none and
    the rate is 0 where they do not. How fast is the bench's business, not this test's."""
    spin = K._kernel.get().dsa_select_vnni_spin
    if K.uses_vnni(32):
        assert spin(1000) == 16_000
    K.force_portable(True)
    try:
        assert spin(1000) == 0
        assert K.vnni_rate() == 0.0
    finally:
        K.force_portable(False)


def test_bench_index_scan_times_every_path_this_cpu_has(tmp_path):
    """`bench index-scan` runs each int8 path this CPU has on the same keys (AMX and VNNI where
    they are, portable always), at every shape, and writes one row per path."""
    import argparse
    import json

    from dist_glm5.bench import index_scan

    p = argparse.ArgumentParser()
    index_scan.register(p)
    out = tmp_path / "scan.json"
    args = p.parse_args(["--contexts", "300", "--threads", "1", "--repeats", "1"])
    args.output = str(out)
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    for name, (H, D, _) in index_scan.SHAPES.items():
        got = {r["path"] for r in rows if r["shape"] == name}
        assert got == set(index_scan.paths(D, H)) and "portable" in got
        assert ("amx" in got) == K.uses_amx(D, H) and ("vnni" in got) == K.uses_vnni(D)
