"""Every exact top-k equals the reference on ties, signed zeros included.

The reference (`select_topk_reference`) is a stable descending float sort: it compares -0.0 and
+0.0 as equal, so among them the earlier key wins. The bisections (ops/topk.py for the CPU, the
int32-only one of backends/hpu/indexer.py) compare int32 keys from `ordered_keys`, which must give
both zeros one key; `select_topk_sorted` compares floats. Checked exhaustively on short rows over
{-0.0, +0.0, +-1.0} and with hypothesis on long rows drawn mostly from a few tied values.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_glm5.backends.hpu import indexer
from dist_glm5.ops.indexer import select_topk_reference
from dist_glm5.ops.topk import (
    key_to_float,
    kth_largest_bisect,
    ordered_keys,
    select_topk_bisect,
    select_topk_sorted,
)

INF = float("inf")
SELECTORS = {
    "bisect": select_topk_bisect,
    "sorted": select_topk_sorted,
    "hpu": indexer.select_topk,
}


def check_all(s: torch.Tensor, q_pos: torch.Tensor, k: int) -> None:
    want = select_topk_reference(s, q_pos, k)
    for name, select in SELECTORS.items():
        got = select(s, q_pos, k)
        assert torch.equal(got, want), (name, k, (got != want).nonzero()[:4].tolist())


def test_zeros_share_one_key_and_order_is_kept():
    x = torch.tensor([-INF, -3.4e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3.4e38, INF])
    k = ordered_keys(x)
    assert k[4] == k[5] == 0 and bool((k[1:] >= k[:-1]).all())
    assert int((k[1:] == k[:-1]).sum()) == 1  # only the two zeros tie
    assert torch.equal(key_to_float(k), x) and not bool(torch.signbit(key_to_float(k[4:5])))
    # every non-NaN bit pattern: keys order as the floats and tie exactly where they are equal
    b = torch.randint(-(2**31), 2**31, (200_000,), generator=torch.Generator().manual_seed(0))
    f = b.to(torch.int32).view(torch.float32)
    f = torch.cat([f[~f.isnan()], torch.tensor([-0.0, 0.0])])
    fs = f.sort().values
    ks = ordered_keys(fs)
    assert bool((ks[1:] >= ks[:-1]).all())
    assert torch.equal(ks[1:] == ks[:-1], fs[1:] == fs[:-1])
    assert int(ks.min()) > -(2**31)  # int32 throughout, no key at the wrap point


def test_exhaustive_short_rows_of_signed_zeros():
    """All 4^6 rows over {-0.0, +0.0, 1.0, -1.0}, every causal length and every k."""
    vals = [-0.0, 0.0, 1.0, -1.0]
    s = torch.tensor(list(itertools.product(vals, repeat=6)))
    for q in range(6):
        q_pos = torch.full((s.shape[0],), q)
        for k in range(1, 7):
            check_all(s, q_pos, k)


def test_all_zero_rows_keep_the_earliest_keys():
    g = torch.Generator().manual_seed(1)
    s = torch.where(torch.rand(8, 500, generator=g) < 0.5, -0.0, 0.0)
    q_pos = torch.tensor([0, 3, 63, 64, 200, 300, 498, 499])
    for k in (1, 64, 128, 499):
        want = select_topk_reference(s, q_pos, k)
        # earliest keys: the first min(k, q + 1) positions of each row
        assert torch.equal(want, torch.arange(500) < torch.clamp(q_pos + 1, max=k)[:, None])
        check_all(s, q_pos, k)


POOL = [-0.0, 0.0, 1.0, -1.0, 2.5, 1e-45, -1e-45, INF, -INF, 3.4e38]


@st.composite
def tied_rows(draw):
    L = draw(st.integers(2, 700))
    rows = draw(st.integers(1, 4))
    # mostly zeros of either sign, the rest from a few values: ties everywhere
    weights = draw(st.lists(st.integers(0, 8), min_size=len(POOL), max_size=len(POOL)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor(weights, dtype=torch.float64) + torch.tensor([20.0, 20.0] + [0.0] * 8)
    idx = torch.multinomial(p, rows * L, replacement=True, generator=g)
    s = torch.tensor(POOL)[idx].view(rows, L)
    q_pos = torch.randint(0, L, (rows,), generator=g)
    k = draw(st.integers(1, L))
    return s, q_pos, k


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tied_rows())
def test_hypothesis_tied_rows_equal_the_reference(case):
    s, q_pos, k = case
    check_all(s, q_pos, k)
    # the k-th value, too (signed zeros compare equal, as torch.topk's do)
    assert torch.equal(kth_largest_bisect(s, k), s.topk(k).values[..., -1])
