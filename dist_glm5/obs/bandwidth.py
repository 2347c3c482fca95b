"""The machine's read bandwidth, measured: what every roofline bound on this machine divides by.

A constant would be wrong twice: bandwidth differs between machines, and on a CPU it grows with
the threads reading (this 2-core VM: ~12-14 GB/s with one thread, ~26 GB/s with two).
"""

from __future__ import annotations

import functools
import time

import torch


@functools.cache
def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of torch.sum over a `gib` GiB fp32 tensor with `threads` torch threads, best of
    `repeats` (the thread count is restored afterwards). Cached per process."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * (1 << 28)))
        x.sum()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(before)
