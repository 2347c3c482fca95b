"""Importing registers a torch.distributed backend named "hccl", here backed by gloo."""

from __future__ import annotations

import torch.distributed as dist

from .... import record


def _make_gloo(store, rank, size, timeout):
    record("hccl.process_group", rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if "hccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("hccl", _make_gloo, devices=["cpu"])
