"""Tensors between ranks and stages over HCCL: backends/comm.Comm with Gaudi's rules.

- Buffers live on the device: HCCL sends HPU tensors only.
- No tags: HCCL ignores them (ProcessGroupHcclBase::send/recv, `[[maybe_unused]] int tag`), so
  pairing is by issue order alone. Each (stage, rank) -> (stage + 1, rank) link carries one hidden
  state per step, sent and received in step order: one fixed order on both sides.
- A warm-up all_reduce on each stage pair's own group before its first point-to-point (the
  vllm-fork PP worker: "need a collective API warm up before calling send/recv API").
- Lazy mode: mark_step before an all_reduce (vllm-gaudi's workaround for lazy collectives).
- all_gather into one tensor (stack-style all_gather does not compile well on HPU), and packed
  masks padded to an even byte count (the bridge resizes odd-length uint8 tensors in place).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dist_glm5.backends.comm import Comm

from . import _hf, runtime

_BITS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_even(m: torch.Tensor) -> torch.Tensor:
    """bool [rows, L] -> uint8 [rows, W] with W = ceil(L/8) rounded up to even; bit j of byte i is
    key 8i+j (ops/topk.pack_mask's layout), built on m's device."""
    L = m.shape[-1]
    width = -(-L // 8)
    width += width % 2
    m = torch.nn.functional.pad(m, (0, 8 * width - L))
    w = torch.tensor(_BITS, dtype=torch.uint8, device=m.device)
    return (m.view(m.shape[0], width, 8).to(torch.uint8) * w).sum(-1, dtype=torch.uint8)


def unpack(p: torch.Tensor, L: int) -> torch.Tensor:
    bits = (p[..., None] >> torch.arange(8, dtype=torch.uint8, device=p.device)) & 1
    return bits.reshape(p.shape[0], -1)[:, :L].bool()


class HcclComm(Comm):
    def __init__(
        self,
        stage: int,
        rank: int,
        stages: int,
        ranks: int,
        init_method: str,
        device: str = "hpu",
        timeout_s: float = 120.0,
    ):
        _hf.import_hccl()  # registers the "hccl" torch.distributed backend
        super().__init__(stage, rank, stages, ranks, init_method, "hccl", timeout_s)
        self.device = torch.device(device)
        # every process creates every pair group, in one order (new_group is collective)
        self.pairs = {}
        for s in range(stages - 1):
            for r in range(ranks):
                self.pairs[(s, r)] = dist.new_group([s * ranks + r, (s + 1) * ranks + r])
        self._warm: set[int] = set()

    def _warm_up(self, lower_stage: int) -> None:
        if lower_stage in self._warm:
            return
        dist.all_reduce(
            torch.zeros(1, device=self.device), group=self.pairs[(lower_stage, self.rank)]
        )
        self._warm.add(lower_stage)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            runtime.mark_step()
            t = t.contiguous()
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_mask(self, local: torch.Tensor, n: int, L: int) -> torch.Tensor:
        per = -(-n // self.ranks)
        buf = torch.zeros(per, L, dtype=torch.bool, device=self.device)
        buf[: local.shape[0]] = local
        packed = pack_even(buf)
        out = torch.empty(self.ranks * per, packed.shape[1], dtype=torch.uint8, device=self.device)
        dist.all_gather_into_tensor(out, packed, group=self.group)
        return unpack(out, L)[:n]

    def send_hidden(self, h: torch.Tensor, step: int) -> None:
        import time

        self._warm_up(self.stage)
        t0 = time.perf_counter()
        h = h.to(self.device).contiguous()
        dist.send(h, dst=(self.stage + 1) * self.ranks + self.rank)  # no tag: order pairs them
        self.send_seconds += time.perf_counter() - t0
        self.bytes_sent += h.numel() * h.element_size()

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
        self._warm_up(self.stage - 1)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=(self.stage - 1) * self.ranks + self.rank)
        return buf
