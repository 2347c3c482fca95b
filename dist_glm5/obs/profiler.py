"""Per-process step profiler: named spans, installed on a model from outside (off by default).

`install(model)` puts forward hooks on the model's parts and wraps its selection methods and
all-reduce callables, the way stages/tp.py applies tensor parallelism: the model's forward holds no
profiling code, so it reads like the paper and stays capturable by graph compilers; a model that is
not profiled carries no hooks at all.

Spans nest; the anatomy of a step uses exclusive times (a span minus the spans inside it), so the
parts add up to the step. Categories: experts, router+shared (MoE work outside the expert kernels),
attention, indexer, mlp (dense), all_reduce, transfer, recv_wait (pipeline bubble), sampler, and
the rest of the step as host.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager

from torch import nn


class Profiler:
    def __init__(self) -> None:
        self.enabled = False
        self.events: list[tuple[str, float, float, int]] = []  # name, start s, duration s, depth
        self._open: list[tuple[str, float]] = []

    def begin(self, name: str) -> None:
        if self.enabled:
            self._open.append((name, time.perf_counter()))

    def end(self) -> None:
        if self.enabled and self._open:
            name, t0 = self._open.pop()
            self.events.append((name, t0, time.perf_counter() - t0, len(self._open)))

    @contextmanager
    def span(self, name: str):
        self.begin(name)
        try:
            yield
        finally:
            self.end()

    def take(self) -> list[tuple[str, float, float, int]]:
        ev, self.events, self._open = self.events, [], []
        return ev


PROF = Profiler()


def _hook(mod: nn.Module, name: str, prof: Profiler) -> None:
    mod.register_forward_pre_hook(lambda m, a: prof.begin(name))
    mod.register_forward_hook(lambda m, a, o: prof.end(), always_call=True)


def _wrap(obj, attr: str, name: str, prof: Profiler) -> None:
    fn = getattr(obj, attr, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def timed(*a, **kw):
        with prof.span(name):
            return fn(*a, **kw)

    setattr(obj, attr, timed)


def install(model: nn.Module, prof: Profiler = PROF) -> None:
    """Spans on every decoder layer of `model`: attention (indexer inside it), the dense MLP or the
    MoE (router, experts, shared expert inside it) and the all-reduces after each (set them first:
    install after stages/tp.py)."""
    from dist_glm5.model.layer import DecoderLayer
    from dist_glm5.model.moe import MoE

    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        attn = layer.self_attn
        _hook(attn, "attention", prof)
        if attn.indexer is not None:
            _hook(attn.indexer, "indexer", prof)
        for sel in ("select_dense", "select_sparse"):
            _wrap(attn, sel, "indexer", prof)
        if isinstance(layer.mlp, MoE):
            _hook(layer.mlp, "moe", prof)
            _hook(layer.mlp.gate, "router", prof)
            _hook(layer.mlp.experts, "experts", prof)
            if layer.mlp.shared_experts is not None:
                _hook(layer.mlp.shared_experts, "shared", prof)
        else:
            _hook(layer.mlp, "mlp", prof)
        for red in ("attn_reduce", "mlp_reduce"):
            _wrap(layer, red, "all_reduce", prof)
    # a planned decode step (backends/cpu_plan.py) calls no module: it opens the same spans
    # itself when the model says who profiles it
    model.profiler = prof


def exclusive_times(events: list[tuple[str, float, float, int]]) -> dict[str, float]:
    """Seconds per span name with nested spans subtracted (events of one step, any order)."""
    ev = sorted(events, key=lambda e: (e[1], e[3]))
    out: dict[str, float] = {}
    for name, t0, dur, depth in ev:
        inner = sum(
            d for n, s, d, dep in ev if dep == depth + 1 and s >= t0 and s + d <= t0 + dur + 1e-9
        )
        out[name] = out.get(name, 0.0) + dur - inner
    return out
