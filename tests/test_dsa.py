"""The scaled sparse-DSA path against the dense reference it replaces."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from runtime_util import prompts
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dist_glm5.ops.gather as gather
from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa import DSAConfig, gather_plan
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.model.reference_loop import full_logits, generate
from dist_glm5.ops import reference_ops
from dist_glm5.ops.indexer import select_topk_reference
from dist_glm5.ops.topk import kth_largest_bisect, pack_mask, select_topk_bisect, unpack_mask
from dist_glm5.sampling.params import SamplingParams

INF = float("inf")


@pytest.mark.parametrize(
    "rows",
    [
        torch.randn(6, 257, generator=torch.Generator().manual_seed(0)),
        torch.randint(
            -2, 3, (5, 100), generator=torch.Generator().manual_seed(1)
        ).float(),  # many ties
        torch.full((3, 50), 0.75),  # all equal
        torch.tensor(
            [[-INF] * 8 + [1.0, 2.0], [INF, 3.0, 3.0, -1.0, -INF, 0.0, -0.0, 2.0, 2.0, 1e-45]]
        ),
        torch.tensor([[1e38, -1e38, 1e-38, -1e-38, 3.4e38, -3.4e38, 0.0, 5.0]]),
    ],
)
def test_bisection_kth_equals_torch_topk(rows):
    for k in sorted({1, 2, 3, rows.shape[-1] // 2, rows.shape[-1]}):
        assert torch.equal(kth_largest_bisect(rows, k), rows.topk(k).values[..., -1]), k


def test_bisection_selection_equals_the_reference_tie_rule():
    g = torch.Generator().manual_seed(2)
    for trial in range(30):
        L = int(torch.randint(3, 400, (), generator=g))
        s = torch.randint(-3, 4, (9, L), generator=g).float()  # heavy ties
        if trial % 3 == 0:
            s = torch.randn(9, L, generator=g)
        q = torch.randint(0, L, (9,), generator=g)
        q[0] = 0  # a row with a single valid key (fewer than k)
        for k in (1, 4, 64, 1000):
            assert torch.equal(select_topk_bisect(s, q, k), select_topk_reference(s, q, k)), (
                trial,
                k,
            )


def test_masks_pack_to_bits():
    m = torch.rand(4, 77, generator=torch.Generator().manual_seed(3)) > 0.5
    p = pack_mask(m)
    assert p.dtype == torch.uint8 and p.shape == (4, 10)
    assert torch.equal(unpack_mask(p, 77), m)


W = "windows"  # Gaudi's prefill form; the CPU's default is "rows"
CONFIGS = {
    "rows (the CPU default)": DSAConfig(mode="sparse"),
    "rows, tiny gather cap": DSAConfig(
        mode="sparse", gather_cap_bytes=24 * 1024, indexer_row_chunk=7
    ),
    "union windows": DSAConfig(
        mode="sparse", dense_threshold=0, window=16, union_max_frac=1.0, prefill_attention=W
    ),
    "dense with the selection as mask": DSAConfig(
        mode="sparse", dense_threshold=0, union_max_frac=1e-9, prefill_attention=W
    ),
    "dense below the threshold": DSAConfig(mode="sparse", prefill_attention=W),
    "tiny gather cap": DSAConfig(
        mode="sparse",
        dense_threshold=0,
        window=8,
        gather_cap_bytes=24 * 1024,
        indexer_row_chunk=7,
        prefill_attention=W,
    ),
}


@pytest.fixture(scope="module")
def sparse_models(default_model_dir):
    return {
        name: load_model(default_model_dir, ops=get_backend("cpu").ops(), dsa=c)
        for name, c in CONFIGS.items()
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sparse_logits_and_greedy_tokens_match_reference(default_model, sparse_models, name):
    sp = sparse_models[name]
    ps = prompts([300, 130, 5], seed=4)  # longer and shorter than index_topk=64
    for p in ps[:2]:
        err = (full_logits(sp, p) - full_logits(default_model, p)).abs().max().item()
        assert err <= 1e-4, (name, err)
    P = SamplingParams(
        max_tokens=24, ignore_eos=True
    )  # decode crosses 64 keys for the short prompt too
    assert [g.token_ids for g in generate(sp, ps, P)] == [
        g.token_ids for g in generate(default_model, ps, P)
    ]


def test_sparse_selects_exactly_the_reference_keys(default_model, sparse_models):
    sp = sparse_models["union windows"]
    ids = prompts([200], seed=5)[0]
    keeps = {}
    for name, m in (("ref", default_model), ("sparse", sp)):
        cache = m.new_cache(8, 64)
        b = cache.prepare([Chunk(0, 0, 200)])
        with torch.no_grad():
            x = m.embed(torch.tensor(ids))
            cos, sin = m.rope.lookup(b.positions)
            layer = m.model.layers["0"]
            _, keep = layer.self_attn(layer.input_layernorm(x), b, cache, cos, sin, None)
        keeps[name] = keep[0][0].keep if name == "sparse" else keep[0][0]
    assert keeps["ref"].shape == keeps["sparse"].shape == (200, 200)
    assert torch.equal(keeps["ref"], keeps["sparse"])
    assert keeps["sparse"].sum(-1).max() == 64  # sparsity is real at this length


def test_every_gather_in_a_run_stays_under_the_cap(sparse_models):
    sp = sparse_models["tiny gather cap"]
    gather.GATHER_LOG = []
    try:
        generate(sp, prompts([250, 90], seed=6), SamplingParams(max_tokens=6, ignore_eos=True))
        assert gather.GATHER_LOG and max(gather.GATHER_LOG) <= 24 * 1024
    finally:
        gather.GATHER_LOG = None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class CacheReads(TorchDispatchMode):
    """Sees every aten op; records each one that reads a KV or indexer cache tensor and returns a
    newly allocated tensor (a gather, a copy, anything materialised from the cache): the op and the
    real output's storage bytes. In-place cache writes and views of the cache are not reads."""

    def __init__(self, cache):
        super().__init__()
        stores = (("kv", cache.kv), ("index", cache.index_k))
        self.stores = {_storage(t): kind for kind, d in stores for t in d.values()}
        self.reads: list[tuple[str, str, int]] = []  # (op, which cache, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        read = {self.stores.get(_storage(t)) for t in ins} - {None}
        if read:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and _storage(o) not in self.stores:
                    nbytes = o.untyped_storage().nbytes()
                    self.reads.append((str(func), "+".join(sorted(read)), nbytes))
        return out


def _cache_reads_of_a_run(model_dir, cap):
    """Prefill two prompts (250 and 90 tokens, one forward) and decode 4 greedy steps on the
    sparse path with the given gather cap, recording every materialised cache read. The torch
    forms of the selection (ranks that split rows take it) and of the attention (no C kernel),
    which gather index keys and cache rows: the C kernels read both in place and materialise
    none."""
    m = load_model(
        model_dir,
        ops=dataclasses.replace(
            get_backend("cpu").ops(),
            select_rows=None,
            absorbed_gathered=reference_ops().absorbed_gathered,
        ),
        dsa=DSAConfig(
            mode="sparse", dense_threshold=0, window=8, gather_cap_bytes=cap, indexer_row_chunk=7
        ),
    )
    ps = prompts([250, 90], seed=6)
    cache = m.new_cache(32, 16)
    mode = CacheReads(cache)
    with torch.no_grad(), mode:
        b = cache.prepare([Chunk(i, 0, len(p)) for i, p in enumerate(ps)])
        h, _ = m(torch.tensor([t for p in ps for t in p]), b, cache)
        last = torch.tensor([e - 1 for _, e in b.spans])
        for step in range(4):
            nxt = m.logits(m.final_norm(h[last])).argmax(-1)
            b = cache.prepare([Chunk(i, len(p) + step, 1) for i, p in enumerate(ps)])
            h, _ = m(nxt, b, cache)
            last = torch.arange(len(ps))
    return mode.reads


def test_measured_cache_reads_stay_under_a_small_cap(default_model_dir):
    """Real allocations, not the plan's arithmetic: every tensor materialised from the KV or
    indexer cache during a sparse prefill + decode stays under a 24 KiB cap, while the same run
    with the default 512 MiB cap materialises larger ones (so the cap is what keeps them small)."""
    cap = 24 * 1024
    small = _cache_reads_of_a_run(default_model_dir, cap)
    big = _cache_reads_of_a_run(default_model_dir, DSAConfig().gather_cap_bytes)
    for reads in (small, big):  # the mode saw gathers from both caches
        assert {(op, kind) for op, kind, _ in reads} >= {
            ("aten.index.Tensor", "kv"),
            ("aten.index.Tensor", "index"),
        }, reads[:5]
    too_big = [r for r in small if r[2] > cap]
    assert not too_big, too_big[:5]
    assert max(n for *_, n in big) > 2 * cap, max(n for *_, n in big)  # negative control


@pytest.mark.parametrize("context", [131072, 652288])
@pytest.mark.parametrize("tp,batch,chunk", [(8, 64, 2048), (1, 256, 8192)])
def test_no_gather_exceeds_the_cap_at_real_glm5_shapes(context, tp, batch, chunk):
    cfg = (
        ModelConfig()
    )  # GLM-5: hidden 6144, 64 heads, kv_lora 512 + rope 64, indexer 32 x 128, top-2048
    cap = DSAConfig(mode="sparse").gather_cap_bytes
    plan = gather_plan(cfg, context, chunk, DSAConfig(mode="sparse"), tp=tp, batch=batch)
    assert len(plan) >= 8
    too_big = [(w, b) for w, b in plan if b > cap]
    assert not too_big, too_big


def test_no_nan_with_padding_blocks(default_model, sparse_models):
    ps = prompts([3, 200, 1, 65], seed=7)  # decode groups pad short sequences up to the longest
    for m in (default_model, sparse_models["union windows"]):
        cache = m.new_cache(32, 16)
        with torch.no_grad():
            b = cache.prepare([Chunk(i, 0, len(p)) for i, p in enumerate(ps)])
            h, _ = m(torch.tensor([t for p in ps for t in p]), b, cache)
            assert torch.isfinite(h).all()
            b = cache.prepare(
                [Chunk(i, len(p), 1) for i, p in enumerate(ps)]
            )  # one padded decode group
            h, _ = m(torch.tensor([1, 2, 3, 4]), b, cache)
            assert torch.isfinite(h).all() and torch.isfinite(m.logits(m.final_norm(h))).all()


def test_selected_slots_and_cache_sized_index_chunks_equal_the_plain_forms():
    """The decode/rows gather list from a top-k of the mask bytes equals the kept positions in
    key order (rows keeping fewer than k, padding repeating the first pick), and index scores in
    cache-sized key chunks equal one unchunked call, bit for bit."""
    from dist_glm5.model import dsa as D
    from dist_glm5.ops.indexer import index_scores
    from dist_glm5.ops.key_slots import KeySlots

    g = torch.Generator().manual_seed(0)
    L, k, bs = 700, 64, 16
    table = torch.randperm(64, generator=g)[: -(-L // bs)]
    keys = KeySlots(table, bs, L)
    keep = torch.zeros(5, L, dtype=torch.bool)
    for r, n in enumerate((64, 64, 3, 1, 40)):
        keep[r, torch.randperm(L, generator=g)[:n]] = True
    slots, valid = D.selected_slots(keep, keys, k)
    for r in range(5):
        pos = keep[r].nonzero().squeeze(1)
        n = pos.numel()
        assert torch.equal(valid[r], torch.arange(k) < n)
        assert torch.equal(slots[r, :n], keys.at(pos))
        assert (slots[r, n:] == keys.at(pos[:1])).all()
    store = torch.randn(64 * bs, 32, generator=g).bfloat16()
    q, w = torch.randn(9, 16, 32, generator=g).bfloat16(), torch.randn(9, 16, generator=g)
    whole = index_scores(q, w, store[keys.range(0, L)], 32)
    before = D.SCORE_CACHE_BYTES
    try:
        D.SCORE_CACHE_BYTES = 9 * 16 * 4 * 48  # 48 keys per chunk: not a block multiple
        assert torch.equal(D.index_scores_capped(q, w, store, keys, 32, 1 << 30), whole)
    finally:
        D.SCORE_CACHE_BYTES = before
