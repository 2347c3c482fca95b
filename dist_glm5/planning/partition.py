"""Pure partition functions: layers over pipeline stages, experts over expert-parallel ranks.

The embedding goes with the first stage; the final norm, lm_head and the MTP layer with the last.
A stage boundary is moved onto a layer that runs its own DSA indexer ("full"), so that a "shared"
layer never needs the previous stage's selection: nothing but the hidden state crosses a stage.
"""

from __future__ import annotations

from dist_glm5.model.config import ModelConfig


def partition_layers(cfg: ModelConfig, stages: int) -> list[range]:
    n = cfg.num_hidden_layers
    if stages < 1:
        raise ValueError(f"stages={stages}: need at least 1 pipeline stage")
    if stages > n:
        raise ValueError(
            f"stages={stages} is more than the model's {n} layers: use at most {n} stages"
        )
    full = [i for i in range(n) if cfg.indexer_types[i] == "full"]
    bounds = [0]
    for s in range(1, stages):
        ideal = round(s * n / stages)
        # nearest full layer to the even split that keeps every stage non-empty
        cands = [i for i in full if bounds[-1] < i <= n - (stages - s)]
        if not cands:
            raise ValueError(
                f"cannot split {n} layers into {stages} stages that each start with a 'full' DSA "
                f"layer (indexer_types has full layers at {full}): use fewer stages"
            )
        bounds.append(min(cands, key=lambda i: (abs(i - ideal), i)))
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def expert_ranges(n_experts: int, ep: int) -> list[range]:
    if ep < 1 or n_experts % ep:
        raise ValueError(
            f"ep={ep} must divide n_routed_experts={n_experts} (every rank holds the same number "
            "of experts)"
        )
    k = n_experts // ep
    return [range(r * k, (r + 1) * k) for r in range(ep)]
