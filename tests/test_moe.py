"""The expert loop: expert-parallel slices sum to the whole, and it equals a dense per-token
evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_glm5.ops.experts import experts_reference


def test_ep_slices_sum_to_the_whole_and_match_dense_math():
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 16, 64, 32, 9, 4
    w13, w2 = (
        torch.randn(E, 2 * I, H, generator=g) / H**0.5,
        torch.randn(E, H, I, generator=g) / I**0.5,
    )
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g)
    full = experts_reference(x, w, ids, lambda e: (w13[e], w2[e]), 0, E)
    dense = torch.stack(
        [
            sum(
                w[t, j] * (F.silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])) @ w2[e].T
                for j, e in enumerate(ids[t].tolist())
            )
            for t in range(T)
        ]
    )
    torch.testing.assert_close(full, dense, rtol=1e-5, atol=1e-5)
    parts = [
        experts_reference(x, w, ids, lambda e, a=a: (w13[a + e], w2[a + e]), a, E // 2)
        for a in (0, E // 2)
    ]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
