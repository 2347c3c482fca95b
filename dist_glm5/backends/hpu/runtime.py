"""Execution-mode plumbing: lazy mode (mark_step) or compiled regions.

Lazy (PT_HPU_LAZY_MODE=1): ops accumulate into a graph flushed by `mark_step`; one step per
decoder layer bounds the graph (vllm-gaudi does the same with a forward hook). torch.compile is
not supported in lazy mode. Eager + compile (PT_HPU_LAZY_MODE=0): the native MXFP4 op is blocked
in eager (frontend_blocklist), so it must run inside a `torch.compile(backend="hpu_backend")`
region.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from . import _hf


def mark_step() -> None:
    if _hf.is_lazy():
        _hf.core().mark_step()


def compile_region(fn: Callable) -> Callable:
    """fn compiled for the HPU (static shapes: one graph per bucket) when not lazy; fn itself in
    lazy mode. fullgraph: a graph break would leave ops in eager, where the MXFP4 op is blocked.
    Build it once per function, not per call."""
    if _hf.is_lazy():
        return fn
    import torch

    return torch.compile(fn, backend="hpu_backend", dynamic=False, fullgraph=True)


def add_layer_mark_steps(layers: list[nn.Module]) -> list:
    """A mark_step after each decoder layer in lazy mode; returns the hook handles."""
    if not _hf.is_lazy():
        return []
    core = _hf.core()
    return [m.register_forward_hook(lambda *_: core.mark_step()) for m in layers]
