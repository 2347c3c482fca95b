"""DSA selection for Gaudi: the int32-only bisection gives the reference's keep-masks exactly, and a
dispatch guard shows why the reference bisection cannot run in lazy mode (an int64 bound of 2^31,
data-dependent exits) while this one can."""

from __future__ import annotations

import pytest
import torch

from dist_glm5.backends.hpu import indexer
from dist_glm5.backends.hpu.guard import StepGuard
from dist_glm5.ops.indexer import index_scores, select_topk_reference
from dist_glm5.ops.topk import ordered_keys, select_topk_bisect

INF = float("inf")
G = torch.Generator().manual_seed(0)
L = 300
CASES = [
    torch.randn(6, L, generator=G),
    torch.randint(-3, 3, (6, L), generator=G).float(),  # heavy ties
    torch.zeros(6, L),  # all tied
    torch.where(torch.rand(6, L, generator=G) < 0.5, -0.0, 0.0),  # signed zeros tie
    torch.tensor([[INF, -INF, 3.4e38, -3.4e38, 1e-45, -1e-45] * 50] * 6),  # int32 key extremes
]
Q_POS = torch.tensor([0, 10, 63, 64, 200, L - 1])  # rows with fewer keys than topk too


@pytest.mark.parametrize("case", range(len(CASES)))
def test_int32_bisection_equals_reference(case):
    s = CASES[case]
    for k in (1, 64, 128, L - 1, L):
        assert torch.equal(indexer.select_topk(s, Q_POS, k), select_topk_reference(s, Q_POS, k))
    # batched [B, n, L], as the dense path calls it
    s3 = s.view(2, 3, L)
    assert torch.equal(
        indexer.select_topk(s3, Q_POS.view(2, 3), 64),
        select_topk_reference(s3, Q_POS.view(2, 3), 64),
    )


def test_kth_largest_key_at_the_int32_ends():
    keys = ordered_keys(CASES[4])
    for k in (1, 2, 6, 299, 300):
        want = keys.topk(k, dim=-1).values[:, -1]
        assert torch.equal(indexer.kth_largest_key(keys, k), want)


def test_index_scores_bit_equal_reference():
    g = torch.Generator().manual_seed(1)
    q, w = torch.randn(2, 5, 4, 32, generator=g), torch.rand(2, 5, 4, generator=g)
    keys = torch.randn(2, 40, 32, generator=g).to(torch.bfloat16)
    assert torch.equal(indexer.index_scores(q, w, keys, 32), index_scores(q, w, keys, 32))


def test_guard_flags_the_reference_bisection_and_passes_ours():
    s = CASES[0]
    with StepGuard() as ref:
        select_topk_bisect(s, Q_POS, 64)
    assert ref.by_kind("int64"), "the reference's open bound 2^31 must be flagged"
    assert any("ops/topk.py" in v.where for v in ref.by_kind("int64"))
    assert ref.by_kind("data-dependent")  # bool(done.all()), int(in_range.max())
    with StepGuard() as ours:
        indexer.select_topk(s, Q_POS, 64)
    assert ours.violations == [] and ours.ops > 32


def test_guard_caps_cache_gathers_only():
    store, act = torch.zeros(1000, 64), torch.zeros(1000, 64)
    idx = torch.arange(600)
    with StepGuard(100 * 64 * 4, stores=[store]) as g:
        store.index_select(0, idx[:100])  # at the cap: fine
        store.view(-1, 10, 64)[idx[:20]]  # a view of the store, by blocks: 51 KB, over
        act[idx]  # an activation, not a cache store: not capped
    assert [(v.kind, v.op) for v in g.violations] == [("gather", "aten.index.Tensor")]
