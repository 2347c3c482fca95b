"""The memory planner's CPU terms against this process's own resident memory (VmHWM), measured in
fresh subprocesses: what one full layer's key selection holds at a long context, and what a stage
worker holds at a short one (where the runtime term dominates)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.planning.worker_memory import score_bytes

# one selection of a 256-row chunk over L keys, by the path given (fused: the one-rank worker's;
# torch: ranks that split rows); the VmRSS before it and the VmHWM after (MiB)
_SELECT = r"""
import json, sys, torch
torch.set_num_threads(1)
from dist_glm5.backends import get_backend
from dist_glm5.model import dsa
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.obs.peak_rss import peak_rss_mb
from dist_glm5.ops.key_slots import KeySlots
from dist_glm5.ops.topk import count_true
L, n, fused = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "fused"
cfg, ops = DSAConfig(mode="sparse"), get_backend("cpu").ops()
store = torch.randn(-(-L // 64) * 64, 32).to(torch.bfloat16)  # whole blocks
table = torch.arange((L + 63) // 64)
q, w, q_pos = torch.randn(n, 16, 32), torch.rand(n, 16), torch.arange(L - n, L)
small = KeySlots(table, 64, 4096, 0)  # warm the kernels and the allocator on a small call
select = dsa.select_fused if fused else dsa.select
select(q[:4], w[:4], store, small, q_pos[:4] - L + 4096, 64, 32, cfg, ops=ops)
rss = [int(x.split()[1]) / 1024 for x in open("/proc/self/status") if x.startswith("VmRSS")][0]
keep = select(q, w, store, KeySlots(table, 64, L, 0), q_pos, 64, 32, cfg, ops=ops)
peak = peak_rss_mb()  # before the check below (a sum over a bool mask widens it to int64)
keep = keep[0] if fused else keep
assert count_true(keep).eq(64).all()
print(json.dumps({"before": rss, "peak": peak}))
"""


@pytest.mark.parametrize("path", ["fused", "torch"])
def test_a_full_layers_selection_holds_what_the_planner_counts(path):
    # 300K keys: past the point (233K at 256 rows) where the gather cap limits the row block
    L, n = 300_000, 256
    r = subprocess.run(
        [sys.executable, "-c", _SELECT, str(L), str(n), path],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.splitlines()[-1])
    grew = (m["peak"] - m["before"]) * 2**20
    # the score temporaries as planned, and the keep mask select() returns (1 B per row and key)
    kind = "cpu" if path == "fused" else "cpu-torch"
    planned = score_bytes(DSAConfig(mode="sparse"), n, L, kind) + n * L
    assert 0.85 * planned <= grew <= 1.15 * planned, (grew / 2**20, planned / 2**20)


def test_peak_rss_reads_this_process_high_water_mark():
    """The kept-open status file gives what a fresh read of /proc/self/status says, and a forked
    child reads its own file (not its parent's, which /proc/self named at open)."""
    import os

    from dist_glm5.obs import peak_rss

    def vmhwm_mb():
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024

    peak_rss.peak_rss_mb()
    grown = bytearray(64 << 20)
    grown[::4096] = b"\1" * len(grown[::4096])  # touch every page: the high-water mark rises
    assert peak_rss.peak_rss_mb() == vmhwm_mb()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own pid's file
        # (its mark still moves as it touches pages: bracket the kept file's read by fresh ones)
        a, ours, b = vmhwm_mb(), peak_rss.peak_rss_mb(), vmhwm_mb()
        os.write(w, f"{a} {ours} {b} {os.getpid()}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    a, ours, b, child = os.read(r, 200).decode().split()
    assert float(a) <= float(ours) <= float(b)
    assert peak_rss._fd[0] == os.getpid() != int(child)
