"""Two processes exchanging hidden states and masks over the fake "hccl" (registered on gloo).

What it shows: the backend registers and initialises under the name "hccl"; buffers are allocated
on the comm's device; no send/recv carries a tag (HCCL ignores tags) and both sides issue them in
one order; a warm-up all_reduce on the stage pair's group precedes the first point-to-point;
mark_step precedes each all_reduce in lazy mode; masks travel packed at an even byte count via
all_gather_into_tensor. What it cannot: HCCL's wire, cross-node behaviour (gaudi.md section 10
item 3), real device buffers (here device is "cpu").
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# not imported from hpu_fake: the spawned children import this module, and pytest is slow to load
FAKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_habana")

SPIED = ("send", "recv", "all_reduce", "all_gather_into_tensor")


def _spy(log):
    for name in SPIED:
        orig = getattr(dist, name)

        def spy(*a, _orig=orig, _name=name, **k):
            group = k.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            log.append(
                {"op": _name, "tag": "tag" in k, "group_size": size, "device": str(a[0].device)}
            )
            return _orig(*a, **k)

        setattr(dist, name, spy)


def _child(rank: int, tmp: str) -> None:
    sys.path.insert(0, FAKE)
    os.environ["PT_HPU_LAZY_MODE"] = "1"
    torch.set_num_threads(1)
    from dist_glm5.backends.hpu import _hf
    from dist_glm5.backends.hpu.comm import HcclComm

    _hf.core()  # the fake, loaded through the backend's one importer
    habana_frameworks = sys.modules["habana_frameworks"]

    log: list[dict] = []
    _spy(log)
    # two stages, one rank each: hidden states from stage 0 to stage 1
    c = HcclComm(rank, 0, 2, 1, f"file://{tmp}/init1", device="cpu")
    got = []
    for step in range(3):
        if rank == 0:
            c.send_hidden(torch.full((4, 8), float(step), dtype=torch.bfloat16), step)
        else:
            h = c.recv_hidden((4, 8), torch.bfloat16, step)
            got.append(h[0, 0].item())
    c.close()
    log.append({"op": "phase"})
    # one stage, two ranks: all_reduce and the mask exchange
    c = HcclComm(0, rank, 1, 2, f"file://{tmp}/init2", device="cpu")
    s = c.all_reduce(torch.full((2,), float(rank + 1)))
    local = torch.rand(2 if rank == 0 else 1, 13) < 0.5
    masks = c.all_gather_mask(local, 3, 13)
    c.close()
    marks = sum(1 for n, *_ in habana_frameworks.RECORD if n == "core.mark_step")
    pgs = sum(1 for n, *_ in habana_frameworks.RECORD if n == "hccl.process_group")
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(
            {
                "log": log,
                "got": got,
                "sum": s.tolist(),
                "local": local.tolist(),
                "masks": masks.tolist(),
                "marks": marks,
                "pgs": pgs,
            },
            f,
        )


def test_two_processes_over_fake_hccl(tmp_path):
    mp.spawn(_child, args=(str(tmp_path),), nprocs=2, join=True)
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert r[1]["got"] == [0.0, 1.0, 2.0]  # in step order, no tags
    for i in range(2):
        log = r[i]["log"]
        cut = log.index({"op": "phase"})
        p2p = log[:cut]
        assert all(not e["tag"] for e in log if "tag" in e), "a tag reached HCCL"
        assert all(e["device"] == "cpu" for e in log if "device" in e)
        # the warm-up all_reduce on the 2-rank pair group precedes the first send/recv
        assert p2p[0]["op"] == "all_reduce" and p2p[0]["group_size"] == 2
        assert [e["op"] for e in p2p[1:]] == ["send" if i == 0 else "recv"] * 3
        ops = [e["op"] for e in log[cut + 1 :]]
        assert ops == ["all_reduce", "all_gather_into_tensor"]
        assert r[i]["marks"] == 1  # mark_step before the stage all_reduce (lazy)
        assert r[i]["pgs"] >= 1  # the "hccl" backend made process groups
        assert r[i]["sum"] == [3.0, 3.0]
    want = r[0]["local"] + r[1]["local"]
    assert r[0]["masks"] == r[1]["masks"] == want


def test_packed_masks_are_even_sized_and_round_trip():
    from dist_glm5.backends.hpu.comm import pack_even, unpack
    from dist_glm5.ops.topk import pack_mask

    for L in (1, 8, 13, 16, 17, 64):
        m = torch.rand(3, L) < 0.5
        p = pack_even(m)
        assert p.shape[1] % 2 == 0 and torch.equal(unpack(p, L), m)
        assert torch.equal(p[:, : -(-L // 8)], pack_mask(m))  # ops/topk's bit layout
