"""The MoE fast paths against the plain expert loop."""

from __future__ import annotations

import torch

from dist_glm5.moe import experts_gathered, experts_reference


def test_gathered_equals_reference_including_ep_slices():
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 16, 64, 32, 9, 4
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g)
    full = experts_reference(x, w, ids, lambda e: (w13[e], w2[e]), 0, E)
    torch.testing.assert_close(experts_gathered(x, w, ids, w13, w2, 0), full, rtol=1e-5, atol=1e-5)
    # two expert-parallel ranks, each with half the experts, sum to the whole
    parts = [experts_gathered(x, w, ids, w13[a:a + E // 2], w2[a:a + E // 2], a) for a in (0, E // 2)]
    ref_parts = [experts_reference(x, w, ids, lambda e, a=a: (w13[a + e], w2[a + e]), a, E // 2) for a in (0, E // 2)]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_parts[0] + ref_parts[1], full, rtol=1e-5, atol=1e-5)
