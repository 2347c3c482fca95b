"""Verifying one MTP draft: the rejection sampler (as vLLM's v1 rejection_sampler, one draft).

Greedy rows: the draft is accepted iff it equals the target's argmax; otherwise the target's argmax
is emitted. Sampled rows: accept with probability min(1, p(d) / q(d)); on rejection draw from
normalise(max(p - q, 0)). Either way the emitted token is distributed exactly as p, the target
distribution after the request's own processing; q is the draft distribution the MTP layer
sampled d from (with the same processing).
"""

from __future__ import annotations

import torch


def verify_draft(
    p: torch.Tensor, q: torch.Tensor | None, draft: int, greedy: bool, gen: torch.Generator | None
) -> tuple[bool, int | None]:
    """p, q: [V] probabilities. Returns (accepted, replacement token if rejected)."""
    if greedy:
        target = int(torch.argmax(p))
        return (True, None) if target == draft else (False, target)
    assert q is not None, "a sampled draft needs its proposal distribution"
    pd, qd = float(p[draft]), float(q[draft])
    u = float(torch.rand((), generator=gen))
    if qd > 0 and u < min(1.0, pd / qd):
        return True, None
    residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
        residual = p
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=gen)[0])
