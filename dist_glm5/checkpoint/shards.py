"""Reading a checkpoint sharded per pipeline stage and per expert-parallel rank.

Layout written by `convert shard` (root/shards.json describes it):
    root/stage-SS/            the stage's tensors except routed experts (its own index + manifest)
    root/stage-SS/ep-RR/      rank RR's routed experts: fused tensors hold only its rows,
                              per-expert tensors only its experts
`ShardedCheckpoint` presents any selection (the whole root, one stage, one stage and rank) with the
interface of safetensors_io.Checkpoint, so the ordinary loader counts and loads it. Stacked expert
tensors of several ranks appear concatenated; `row_offset` says which expert the first row is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dist_glm5.checkpoint.safetensors_io import Checkpoint, CheckpointError

SHARDS_FILE = "shards.json"


def stage_dir(root: Path, s: int) -> Path:
    return root / f"stage-{s:02d}"


def rank_dir(root: Path, s: int, r: int) -> Path:
    return stage_dir(root, s) / f"ep-{r:02d}"


def is_sharded(path: str | Path) -> bool:
    return (Path(path) / SHARDS_FILE).exists()


@dataclass(frozen=True)
class _Info:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class ShardedCheckpoint:
    def __init__(self, root: str | Path, stage: int | None = None, ep_rank: int | None = None):
        self.root = Path(root)
        try:
            self.meta = json.loads((self.root / SHARDS_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(
                f"{self.root}/{SHARDS_FILE} is missing or invalid ({e}): not a sharded checkpoint"
            ) from None
        S, E = self.meta["stages"], self.meta["ep"]
        stages = range(S) if stage is None else [stage]
        ranks = range(E) if ep_rank is None else [ep_rank]
        if stage is not None and not 0 <= stage < S:
            raise CheckpointError(f"{self.root} has stages 0..{S - 1}, not {stage}")
        if ep_rank is not None and not 0 <= ep_rank < E:
            raise CheckpointError(f"{self.root} has EP ranks 0..{E - 1}, not {ep_rank}")
        self.plain: dict[str, Checkpoint] = {}
        self.stacked: dict[
            str, list[tuple[int, Checkpoint]]
        ] = {}  # name -> [(first expert, ckpt)] by rank
        for s in stages:
            common = Checkpoint(stage_dir(self.root, s))
            for n in common.names():
                self.plain[n] = common
            for r in ranks:
                ck = Checkpoint(rank_dir(self.root, s, r))
                first = self.meta["experts"][r][0]
                for n in ck.names():
                    if ".routed_experts." in n:
                        self.stacked.setdefault(n, []).append((first, ck))
                    else:
                        self.plain[n] = ck

    def names(self) -> list[str]:
        return sorted([*self.plain, *self.stacked])

    def __contains__(self, name: str) -> bool:
        return name in self.plain or name in self.stacked

    def row_offset(self, name: str) -> int:
        return self.stacked[name][0][0] if name in self.stacked else 0

    def info(self, name: str):
        if name in self.plain:
            return self.plain[name].info(name)
        parts = [ck.info(name) for _, ck in self.stacked[name]]
        return _Info(parts[0].dtype, (sum(p.shape[0] for p in parts), *parts[0].shape[1:]))

    def get(self, name: str) -> torch.Tensor:
        if name in self.plain:
            return self.plain[name].get(name)
        parts = [ck.get(name) for _, ck in self.stacked[name]]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read(self, name: str) -> torch.Tensor:
        if name in self.plain:
            return self.plain[name].read(name)
        return torch.cat([ck.read(name) for _, ck in self.stacked[name]])


def open_checkpoint(path: str | Path, stage: int | None = None, ep_rank: int | None = None):
    """A plain checkpoint directory, or (any selection of) a sharded one."""
    if is_sharded(path):
        return ShardedCheckpoint(path, stage, ep_rank)
    if stage is not None or ep_rank is not None:
        raise CheckpointError(
            f"{path} is not sharded (no {SHARDS_FILE}); a stage or rank selection needs `convert "
            "shard` output"
        )
    return Checkpoint(path)
