"""Gaudi 2 backend: the only package that imports habana_frameworks, and only when chosen.

`load()` applies the bridge's environment defaults (only where unset), imports the stack (the
clear RuntimeError of `_hf.MISSING` on machines without it) and returns the Backend whose ops are
the Gaudi implementations: routed experts through the native MXFP4 MoE op, int32-safe bisection
top-k. The other hot ops of this package (attention.py, indexer.py, norm_rope.py) have the CPU
references' signatures and wait for their fields in `dist_glm5.ops.Ops`.
"""

from __future__ import annotations

import functools

from dist_glm5.backends import Backend

from . import _hf, env


@functools.cache
def hpu_ops():
    from dist_glm5.ops import Ops

    from .indexer import select_topk
    from .moe import HPU_EXPERTS

    return Ops("hpu", HPU_EXPERTS, select_topk)


def load() -> Backend:
    env.apply_defaults()
    _hf.core()  # registers the 'hpu' device and the native ops with torch
    return Backend(name="hpu", device="hpu", dist_backend="hccl", ops=hpu_ops)
