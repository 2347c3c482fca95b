"""Tensors between ranks and stages: one torch.distributed world over every (stage, rank).

Global rank = stage * ranks_per_stage + rank. Each stage has a subgroup for its all-reduces;
hidden states go point to point from (stage, r) to (stage + 1, r): after a stage's all-reduce every
rank holds the same hidden state, so no broadcast is needed. gloo on CPU, hccl on Gaudi.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class Comm:
    def __init__(
        self,
        stage: int,
        rank: int,
        stages: int,
        ranks: int,
        init_method: str,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ):
        self.stage, self.rank, self.stages, self.ranks = stage, rank, stages, ranks
        self.global_rank = stage * ranks + rank
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.global_rank,
            world_size=stages * ranks,
            timeout=timedelta(seconds=timeout_s),
        )
        groups = (
            [dist.new_group([s * ranks + r for r in range(ranks)]) for s in range(stages)]
            if ranks > 1
            else []
        )
        self.group = groups[stage] if groups else None
        self.bytes_sent = 0
        self.send_seconds = 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            t = t.contiguous()
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_mask(self, local: torch.Tensor, n: int, L: int) -> torch.Tensor:
        """Each rank holds the keep-masks of its share of n query rows (ceil(n/R) per rank, the last
        maybe fewer); exchange them bit-packed (L/8 bytes per row) so every rank has all n rows."""
        from dist_glm5.ops.topk import pack_mask, unpack_mask

        per = -(-n // self.ranks)
        buf = torch.zeros(per, L, dtype=torch.bool)
        buf[: local.shape[0]] = local
        packed = pack_mask(buf)
        parts = [torch.empty_like(packed) for _ in range(self.ranks)]
        dist.all_gather(parts, packed, group=self.group)
        return unpack_mask(torch.cat(parts), L)[:n]

    def send_hidden(self, h: torch.Tensor, step: int) -> None:
        import time

        t0 = time.perf_counter()
        h = h.contiguous()
        dist.send(h, dst=(self.stage + 1) * self.ranks + self.rank, tag=step % (1 << 20))
        self.send_seconds += time.perf_counter() - t0
        self.bytes_sent += h.numel() * h.element_size()

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype)
        dist.recv(buf, src=(self.stage - 1) * self.ranks + self.rank, tag=step % (1 << 20))
        return buf

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
