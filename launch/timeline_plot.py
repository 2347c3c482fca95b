"""Profile timelines as PNG images, drawn with matplotlib's Agg renderer (no display needed).

One row per worker (stage, rank); a worker's spans nest by depth inside its row, each level a
thinner bar drawn over its parent, so the step shows as the widest bar and the work inside it on
top. The x axis is milliseconds from the first span; colours are per span category, with a legend.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

log = logging.getLogger(__name__)

Span = Sequence  # (name, start s, duration s, depth): what the profiler records

# Span category -> (legend label, colour); the order is the legend's.
CATEGORIES: dict[str, tuple[str, str]] = {
    "step": ("step (host)", "#dcdcdc"),
    "attention": ("attention", "#1f77b4"),
    "indexer": ("indexer (DSA)", "#ff7f0e"),
    "moe": ("MoE glue", "#e377c2"),
    "router": ("router", "#9467bd"),
    "experts": ("routed experts", "#d62728"),
    "shared": ("shared expert", "#8c564b"),
    "mlp": ("dense MLP", "#7f7f7f"),
    "all_reduce": ("all-reduce", "#bcbd22"),
    "transfer": ("stage transfer", "#17becf"),
    "recv_wait": ("waiting for the previous stage", "#ffffff"),
    "sampler": ("sampler", "#2ca02c"),
}
_OTHER = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354", "#756bb1"]
_HATCHED = {"recv_wait"}  # white bars: hatched so that they show against the white background
_ROW = 0.84  # height of a depth-0 bar, in rows
_SHRINK = 0.72  # each nesting level is this much thinner than its parent


def plot_timeline(
    path: str | Path, spans: Mapping[tuple[int, int], Sequence[Span]], title: str
) -> Path | None:
    """Write a PNG timeline of `spans` (per (stage, rank): (name, start s, duration s, depth)).

    Rows top to bottom in (stage, rank) order; returns the path, or None if there is no span.
    """
    path = Path(path)
    rows = sorted(k for k, evs in spans.items() if evs)
    if not rows:
        log.warning("no profiler spans to draw for %s", path)
        return None
    t0 = min(float(e[1]) for k in rows for e in spans[k])
    t1 = max(float(e[1]) + float(e[2]) for k in rows for e in spans[k])
    extra = iter(_OTHER * 4)
    colours = {n: c for n, (_, c) in CATEGORIES.items()}
    # (row, depth, name) -> [(start ms, length ms)]: one broken_barh call per group
    bars: dict[tuple[int, int, str], list[tuple[float, float]]] = {}
    for i, k in enumerate(rows):
        for name, start, dur, depth in spans[k]:
            if name not in colours:
                colours[name] = next(extra, "#555555")
            bars.setdefault((i, int(depth), name), []).append(
                (1e3 * (float(start) - t0), 1e3 * float(dur))
            )
    depth0 = min(d for _, d, _ in bars)

    fig = Figure(figsize=(12, 1.7 + 0.62 * len(rows)), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    for (i, depth, name), xs in sorted(bars.items(), key=lambda kv: kv[0][1]):
        h = _ROW * _SHRINK ** (depth - depth0)
        hatched, outer = name in _HATCHED, depth == depth0  # outlined: each step's box shows
        ax.broken_barh(
            xs,
            (i - h / 2, h),
            facecolors=colours[name],
            zorder=2 + depth,
            edgecolor="#999999" if hatched or outer else "none",
            linewidth=0.6 if hatched or outer else 0,
            hatch="////" if hatched else None,
        )
    ax.set_xlim(0, 1e3 * (t1 - t0))
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row at the top
    ax.set_yticks(range(len(rows)), [f"stage {s}, rank {r}" for s, r in rows])
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#eeeeee", zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=11)
    present = {n for _, _, n in bars}
    order = [n for n in CATEGORIES if n in present] + sorted(present - set(CATEGORIES))
    handles = [
        Patch(
            facecolor=colours[n],
            edgecolor="#999999" if n in _HATCHED or n == "step" else "none",
            hatch="////" if n in _HATCHED else None,
            label=CATEGORIES.get(n, (n,))[0],
        )
        for n in order
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=min(len(handles), 6),
        frameon=False,
        fontsize=9,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    log.info("wrote %s (%d rows, %.1f ms)", path, len(rows), 1e3 * (t1 - t0))
    return path
