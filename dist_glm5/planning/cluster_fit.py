"""Cluster plans: does a model fit a layout at a context, card by card, and if not, what would.

A layout is nodes x cards per node with memory per card; pipeline stages = nodes (one stage per
node), TP = EP = cards per node inside a stage. The per-card budget comes from planner.worker_memory
(weights by kind, MLA cache, indexer cache, workspace, runtime) plus headroom. Weight formats:
"mxfp4" (routed experts packed, the rest bf16), "fp8" (the official block-FP8 release: every
linear 1 B per weight + one fp32 scale per 128x128 block, norms/embeddings bf16), "bf16".
Figures for Gaudi are computed from these formulas, never measured here.
"""

from __future__ import annotations

from dataclasses import dataclass

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa import DSAConfig
from dist_glm5.planning.partition import partition_layers
from dist_glm5.planning.worker_memory import (
    WorkerMemory,
    stage_expert_bytes,
    stage_weight_bytes,
    worker_memory,
)

GB = 10**9


@dataclass(frozen=True)
class Hardware:
    name: str = "gaudi2"
    memory_per_card: int = 96 * GB
    cards_per_node: int = 8
    backend: str = "hpu"


@dataclass(frozen=True)
class Layout:
    nodes: int = 1
    hw: Hardware = Hardware()

    @property
    def ranks(self) -> int:
        return self.hw.cards_per_node


@dataclass(frozen=True)
class CardPlan:
    stage: int
    layers: range
    memory: WorkerMemory
    headroom: int
    capacity: int
    expert_weights: int = 0  # the routed experts' part of memory.weights

    @property
    def needed(self) -> int:
        return self.memory.total + self.headroom

    @property
    def fits(self) -> bool:
        return self.needed <= self.capacity


def weights_format_of(cfg: ModelConfig) -> str:
    q = cfg.quantization_config or {}
    if cfg.experts_format == "mxfp4" or q.get("quant_method") == "quark":
        return "mxfp4"
    if q.get("quant_method") == "fp8" or q.get("fmt") in ("e4m3", "float8_e4m3fn"):
        return "fp8"
    return "bf16"


def _fp8_weight_bytes(
    cfg: ModelConfig, layers: range, first: bool, last: bool, mtp: bool, tp: int, ep: int
) -> int:
    """The block-FP8 release: bf16-size accounting at 1 B per linear weight plus 4 B per 128x128
    block."""
    bf16 = stage_weight_bytes(
        cfg, layers, first, last, mtp, tp, ep, dtype_bytes=2, experts_format="bf16"
    )
    return int(bf16 / 2 * (1 + 4 / (128 * 128)))


_SPARSE_DSA = DSAConfig(mode="sparse", prefill_attention="windows")  # Gaudi's form


def plan(
    cfg: ModelConfig,
    layout: Layout,
    context: int,
    weights_format: str | None = None,
    batch_tokens: int = 8192,
    chunk_tokens: int = 2048,
    headroom_frac: float = 0.05,
    dsa: DSAConfig = _SPARSE_DSA,
) -> list[CardPlan]:
    """One CardPlan per stage (every card of a stage holds the same amounts)."""
    fmt = weights_format or weights_format_of(cfg)
    if fmt not in ("mxfp4", "fp8", "bf16"):
        raise ValueError(f"weights format {fmt!r}: use mxfp4, fp8 or bf16")
    ranges = partition_layers(cfg, layout.nodes)
    R = layout.ranks
    out = []
    for s, layers in enumerate(ranges):
        first, last = s == 0, s == len(ranges) - 1
        mtp = last and cfg.num_nextn_predict_layers > 0
        mem = worker_memory(
            cfg,
            layers,
            first,
            last,
            mtp,
            cache_tokens=context + batch_tokens,
            chunk_tokens=chunk_tokens,
            context=context,
            tp=R,
            ep=R,
            dtype_bytes=2,
            dsa=dsa,
            backend=layout.hw.backend,
            experts_format="mxfp4" if fmt == "mxfp4" else "bf16",
        )
        if fmt == "fp8":
            mem = WorkerMemory(
                _fp8_weight_bytes(cfg, layers, first, last, mtp, R, R),
                mem.mla_cache,
                mem.indexer_cache,
                mem.workspace,
                mem.runtime,
            )
        experts = stage_expert_bytes(
            cfg, layers, mtp, R, R, 2, "mxfp4" if fmt == "mxfp4" else "bf16"
        )
        if fmt == "fp8":
            experts = experts // 2
        out.append(
            CardPlan(
                s,
                layers,
                mem,
                int(headroom_frac * layout.hw.memory_per_card),
                layout.hw.memory_per_card,
                experts,
            )
        )
    return out


def longest_context(
    cfg: ModelConfig, layout: Layout, weights_format: str | None = None, **kw
) -> int:
    """The longest context (multiple of 1024) whose plan fits, or 0."""
    lo, hi = 0, 1 << 21
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        if all(c.fits for c in plan(cfg, layout, mid, weights_format, **kw)):
            lo = mid
        else:
            hi = mid
    return lo


def check(
    cfg: ModelConfig, layout: Layout, context: int, weights_format: str | None = None, **kw
) -> list[CardPlan]:
    """The plan, or a ValueError that says by how much it misses and what would fit."""
    cards = plan(cfg, layout, context, weights_format, **kw)
    worst = max(cards, key=lambda c: c.needed - c.capacity)
    if worst.fits:
        return cards
    over = (worst.needed - worst.capacity) / GB
    fix = []
    best = longest_context(cfg, layout, weights_format, **kw)
    if best:
        fix.append(f"the longest context that fits {layout.nodes} node(s) is {best // 1024}K")
    for n in range(layout.nodes + 1, layout.nodes + 8):
        try:
            if all(c.fits for c in plan(cfg, Layout(n, layout.hw), context, weights_format, **kw)):
                fix.append(f"{n} nodes fit {context // 1024}K")
                break
        except ValueError:
            break
    raise ValueError(
        f"{context // 1024}K context does not fit {layout.nodes} node(s) of "
        f"{layout.hw.cards_per_node} x {layout.hw.memory_per_card / GB:.0f} GB: stage "
        f"{worst.stage} needs {worst.needed / GB:.1f} GB "
        f"per card, {over:.1f} GB more than it has" + (f"; {'; '.join(fix)}" if fix else "")
    )


def table(cards: list[CardPlan], layout: Layout, context: int, fmt: str) -> str:
    rows = [
        f"plan: {layout.nodes} node(s) x {layout.hw.cards_per_node} {layout.hw.name} cards "
        f"({layout.hw.memory_per_card / GB:.0f} GB), {context // 1024}K context, {fmt} weights, "
        f"PP={layout.nodes} TP=EP={layout.ranks} (computed, not measured)",
        f"{'stage':>5} {'layers':>9} {'experts':>8} {'other wt':>9} {'MLA cache':>10} "
        f"{'indexer':>8} {'workspace':>10} {'runtime':>8} {'headroom':>9} {'total':>8} {'of':>5}  "
        "fits",
    ]
    for c in cards:
        m = c.memory
        rows.append(
            f"{c.stage:>5} {c.layers.start:>4}-{c.layers.stop - 1:<4} "
            f"{c.expert_weights / GB:>7.1f}G {(m.weights - c.expert_weights) / GB:>8.1f}G "
            f"{m.mla_cache / GB:>9.1f}G {m.indexer_cache / GB:>7.1f}G {m.workspace / GB:>9.1f}G "
            f"{m.runtime / GB:>7.1f}G {c.headroom / GB:>8.1f}G {c.needed / GB:>7.1f}G "
            f"{c.capacity / GB:>4.0f}G  {'yes' if c.fits else 'NO'}"
        )
    return "\n".join(rows)
