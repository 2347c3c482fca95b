"""Static shapes for Gaudi: every step is padded to a bucket, so the card compiles one graph per
bucket (at warm-up), never one per batch. Pure Python (no torch).

Prefill buckets are (batch, query tokens, context blocks before the chunk); decode buckets are
(batch, context blocks per sequence): our decode attends over each sequence's own top-k rows and
scans its own indexer keys, so the per-sequence context is the shape that matters (vllm-gaudi's
decode buckets count blocks over the whole batch instead, hence our own variable names).

A dimension is `Linear` (vllm-gaudi's linear rule: double from `min` up to `step`, then every
`step` up to `max`) or `Exp` (`per_doubling` buckets per doubling from `min` to `max`: padding waste
under 2^(1/per_doubling) - 1: 41% at 2, the context default, 19% at 4), `max` always included.
Fewer buckets, fewer graphs to compile at warm-up: at 637K the defaults make 275 prefill and
175 decode buckets (tune per deployment; warm-up logs each bucket's compile time).
Environment overrides (linear), per dim:
DIST_GLM5_{PROMPT,DECODE}_{BS,QUERY,CTX}_BUCKET_{MIN,STEP,MAX}.

Padding never fully masks a row: pad query rows repeat a real row (its position, its keys), pad
key positions are masked but every row keeps its own key, and pad decode rows repeat row 0 with
its length (the "usage 1" rule of vllm-gaudi's pad blocks: a padding block is never empty).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Union


@dataclass(frozen=True)
class Linear:
    min: int
    step: int
    max: int

    def values(self) -> tuple[int, ...]:
        if not 1 <= self.min <= self.max or self.step < 1:
            raise ValueError(f"bucket range {self}: need 1 <= min <= max and step >= 1")
        out, v = [], self.min
        while v < self.step and v <= self.max:
            out.append(v)
            v *= 2
        out += [s for s in range(self.step, self.max + 1, self.step) if s >= self.min]
        return _close(out, self.max)


@dataclass(frozen=True)
class Exp:
    min: int
    max: int
    per_doubling: int = 4

    def values(self) -> tuple[int, ...]:
        if not 1 <= self.min <= self.max or self.per_doubling < 1:
            raise ValueError(f"bucket range {self}: need 1 <= min <= max, per_doubling >= 1")
        n = math.ceil(math.log2(self.max / self.min) * self.per_doubling) + 1
        out = [math.ceil(self.min * 2 ** (i / self.per_doubling)) for i in range(n)]
        return _close([v for v in out if v <= self.max], self.max)


Dim = Union[Linear, Exp]


def _close(vals: list[int], top: int) -> tuple[int, ...]:
    vals = sorted(set(vals))
    if not vals or vals[-1] < top:
        vals.append(top)
    return tuple(vals)


def find_bucket(values: tuple[int, ...], n: int, what: str = "size") -> int:
    """The smallest bucket >= n."""
    for v in values:
        if v >= n:
            return v
    raise ValueError(
        f"{what} {n} is above the largest bucket {values[-1]}: raise the bucket maximum "
        "(DIST_GLM5_*_BUCKET_MAX) and warm up again"
    )


@dataclass(frozen=True)
class BucketConfig:
    block_size: int = 128
    max_model_len: int = 652_288  # 637K
    prompt_bs: Dim = Linear(1, 1, 1)  # prefill chunks run one sequence at a time
    prompt_query: Dim = Linear(128, 1024, 8192)  # tokens per prefill chunk
    prompt_ctx: Dim | None = None  # blocks before the chunk (default: Exp up to max_model_len)
    decode_bs: Dim = Linear(1, 32, 64)
    decode_ctx: Dim | None = None  # blocks per sequence (default: Exp up to max_model_len)
    _ctx_default: Dim = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        blocks = -(-self.max_model_len // self.block_size)
        object.__setattr__(self, "_ctx_default", Exp(1, blocks, 2))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kw) -> "BucketConfig":
        environ = os.environ if environ is None else environ
        for phase, dim in (
            ("PROMPT", "BS"),
            ("PROMPT", "QUERY"),
            ("PROMPT", "CTX"),
            ("DECODE", "BS"),
            ("DECODE", "CTX"),
        ):
            names = [f"DIST_GLM5_{phase}_{dim}_BUCKET_{p}" for p in ("MIN", "STEP", "MAX")]
            given = [environ.get(n) for n in names]
            if any(g is not None for g in given):
                if not all(g is not None for g in given):
                    raise ValueError(f"set all of {names} or none of them")
                kw[f"{phase.lower()}_{dim.lower()}"] = Linear(*(int(g) for g in given))
        return cls(**kw)

    def table(self, name: str) -> tuple[int, ...]:
        dim = getattr(self, name)
        return (dim or self._ctx_default).values()

    def step_tokens(self) -> tuple[int, ...]:
        """Token counts a whole step is padded to (stage.HpuStage): decode batches and prefill
        chunks, one table (the token dimension every linear layer and the MoE op see)."""
        return tuple(sorted({*self.table("decode_bs"), *self.table("prompt_query")}))
