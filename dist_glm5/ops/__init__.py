"""Hot ops behind one interface each, the reference beside the fast path; the backend picks.

`Ops` is what the model is built with (`Glm5Model(..., ops=)`): chosen once, at construction, by
the backend (`dist_glm5.backends`), never switched by walking modules or by mode strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import Tensor

    from dist_glm5.ops.experts import ExpertsOps


@dataclass(frozen=True)
class Ops:
    name: str
    experts: "ExpertsOps"  # routed experts, MXFP4 and dense (ops/experts.py)
    # (scores [..., L] fp32, q_pos [...], topk) -> keep mask [..., L]: each query's top-k causal
    # keys, ties to the earlier key (ops/topk.py)
    select_topk: "Callable[[Tensor, Tensor, int], Tensor]"


def reference_ops() -> Ops:
    """The plain references: what every fast op is tested against."""
    from dist_glm5.ops.experts import REFERENCE
    from dist_glm5.ops.topk import select_topk_bisect

    return Ops("reference", REFERENCE, select_topk_bisect)
