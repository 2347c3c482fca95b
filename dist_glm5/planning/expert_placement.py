"""Expert-load imbalance and expert-to-rank placement.

With expert parallelism a step takes as long as its busiest rank. Routes are recorded from real
runs (per MoE layer and step, how many tokens went to each expert); a placement is, per MoE layer, a
permutation of the experts (position j holds checkpoint expert perm[j]) and EP rank r holds the
contiguous positions r*E/R .. (r+1)*E/R - 1. Applying one permutes the router's rows and loads the
experts in that order (loader.load_model(placement=...)): the model computes the same function.
Only for n_group == 1 (GLM-5): with groups, positions carry the grouping and experts cannot move.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dist_glm5.model.config import ModelConfig


class RouteRecorder:
    """Attached to MoE blocks; counts routed tokens per expert, per layer, per forward."""

    def __init__(self, n_experts: int):
        self.E = n_experts
        self.counts: dict[int, list[torch.Tensor]] = {}

    def record(self, layer: int, ids: torch.Tensor) -> None:
        self.counts.setdefault(layer, []).append(
            torch.bincount(ids.reshape(-1).long(), minlength=self.E)
        )

    def tensor(self) -> dict[int, torch.Tensor]:
        """layer -> [steps, E] route counts."""
        return {l: torch.stack(v) for l, v in self.counts.items()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({str(l): t.tolist() for l, t in self.tensor().items()}))


def load_routes(path: str | Path) -> dict[int, torch.Tensor]:
    return {int(l): torch.tensor(v) for l, v in json.loads(Path(path).read_text()).items()}


def attach(model, recorder: RouteRecorder | None) -> None:
    for name, mod in model.named_modules():
        if name.endswith(".mlp") and hasattr(mod, "gate") and hasattr(mod, "experts"):
            mod.recorder = (recorder, int(name.split(".")[2])) if recorder else None


def rank_loads(counts: torch.Tensor, perm: list[int] | None, ranks: int) -> torch.Tensor:
    """counts [steps, E] (by checkpoint expert id) -> routes per rank [steps, ranks] under a
    placement."""
    E = counts.shape[1]
    perm = list(range(E)) if perm is None else perm
    by_pos = counts[:, torch.tensor(perm)]  # [steps, E] by position
    return by_pos.view(counts.shape[0], ranks, E // ranks).sum(-1)


def imbalance(
    routes: dict[int, torch.Tensor], placement: dict[int, list[int]] | None, ranks: int
) -> float:
    """Mean over layers and steps of busiest rank / mean rank (1.0 is perfect balance)."""
    vals = []
    for l, c in routes.items():
        loads = rank_loads(c, (placement or {}).get(l), ranks).float()
        mean = loads.mean(-1).clamp_min(1e-9)
        vals.append((loads.max(-1).values / mean)[loads.sum(-1) > 0])
    return float(torch.cat(vals).mean()) if vals else 1.0


def fit_placement(
    routes: dict[int, torch.Tensor], ranks: int, cfg: ModelConfig
) -> dict[int, list[int]]:
    """Greedy longest-processing-time per layer: experts by total routes, each to the least-loaded
    rank that still has room; each rank lists its experts in id order. Balances totals; the per-step
    busiest rank follows when routing is stable over time."""
    E = cfg.n_routed_experts
    if cfg.n_group > 1:
        raise ValueError(
            f"placement needs n_group == 1 (GLM-5's); n_group={cfg.n_group} ties experts to their "
            "positions"
        )
    if E % ranks:
        raise ValueError(f"{E} experts do not split over {ranks} EP ranks")
    per = E // ranks
    out = {}
    for l, c in routes.items():
        total = c.sum(0).tolist()
        load, slots = [0] * ranks, [[] for _ in range(ranks)]
        for e in sorted(range(E), key=lambda e: (-total[e], e)):
            r = min((r for r in range(ranks) if len(slots[r]) < per), key=lambda r: (load[r], r))
            load[r] += total[e]
            slots[r].append(e)
        out[l] = [e for r in range(ranks) for e in sorted(slots[r])]
    check_placement(cfg, out)
    return out


def check_placement(cfg: ModelConfig, placement: dict[int, list[int]]) -> None:
    """Every MoE layer's permutation holds each expert exactly once (none lost, none twice)."""
    E, G = cfg.n_routed_experts, cfg.n_group
    for l, perm in placement.items():
        if not cfg.is_moe_layer(l):
            raise ValueError(f"placement names layer {l}, which is not a MoE layer")
        if sorted(perm) != list(range(E)):
            missing = sorted(set(range(E)) - set(perm))
            dup = sorted({e for e in perm if perm.count(e) > 1})
            raise ValueError(
                f"placement of layer {l} must hold each of the {E} experts once: missing "
                f"{missing[:8]}, duplicated {dup[:8]}"
            )
        if G > 1 and perm != list(range(E)):
            raise ValueError(
                f"placement of layer {l}: n_group={G} scores groups by position, so experts cannot "
                "move"
            )


def save_placement(path: str | Path, placement: dict[int, list[int]], ranks: int) -> None:
    Path(path).write_text(
        json.dumps(
            {"ep_ranks": ranks, "layers": {str(k): v for k, v in placement.items()}}, indent=1
        )
    )


def load_placement(path: str | Path) -> dict[int, list[int]]:
    try:
        d = json.loads(Path(path).read_text())
        return {int(k): [int(e) for e in v] for k, v in d["layers"].items()}
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as e:
        raise ValueError(
            f"{path} is not a placement file ({e}): make one with `dist-glm5 placement fit`"
        ) from None


def layouts(routes: dict[int, torch.Tensor], cards: int, cfg: ModelConfig) -> list[dict]:
    """EP x TP splits of a stage's `cards` (EP ranks hold whole experts, TP splits each expert's
    matrices): for each, the busiest rank's expert work per step after a fitted placement, in
    routes-equivalents (routes on the busiest EP rank / TP). Lower is faster; the list is sorted
    best first."""
    out = []
    for ep in (d for d in range(1, cards + 1) if cards % d == 0 and cfg.n_routed_experts % d == 0):
        tp = cards // ep
        pl = fit_placement(routes, ep, cfg) if ep > 1 else None
        busiest = []
        for l, c in routes.items():
            loads = rank_loads(c, (pl or {}).get(l), ep).float()
            busiest.append(loads.max(-1).values)
        work = float(torch.cat(busiest).mean()) / tp
        out.append(
            {"ep": ep, "tp": tp, "busiest_rank_work": work, "imbalance": imbalance(routes, pl, ep)}
        )
    return sorted(out, key=lambda r: r["busiest_rank_work"])
