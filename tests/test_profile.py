"""`launch profile`: the parts add up to the step, the trace is Chrome trace JSON, the timeline a PNG."""

from __future__ import annotations

import json
import subprocess
import sys

LAUNCH = [sys.executable, "-c", "import sys; from dist_glm5.launch.cli import launch_main; sys.exit(launch_main())"]


def check_profile(out_dir, stages: int, ranks: int):
    a = json.loads((out_dir / "anatomy.json").read_text())
    for kind in ("decode", "prefill"):
        assert sorted(int(s) for s in a[kind]) == list(range(stages)), a[kind].keys()
        for s, r in a[kind].items():
            parts = sum(r[p] for p in ("experts", "attention", "indexer", "moe_outside", "mlp", "all_reduce",
                                       "transfer", "sampler", "host", "bubble"))
            assert abs(parts - r["step"]) <= 0.01 * r["step"] + 0.05, (kind, s, parts, r["step"])
            assert r["ranks"] == ranks and r["experts_slowest"] >= r["experts_mean"] - 1e-9
    trace = json.loads((out_dir / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events and all({"name", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0 for e in events)
    assert {e["name"] for e in events} >= {"step", "attention", "experts", "indexer", "sampler"}
    for s in range(stages):
        assert (out_dir / f"timeline-stage-{s}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_in_process(tmp_path, default_model_dir):
    r = subprocess.run([*LAUNCH, "profile", "--ctx", "96", "--batch", "3", "--decode-steps", "6", "--output",
                        str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ms decode step = experts" in r.stdout and "(slowest rank; mean" in r.stdout
    check_profile(tmp_path, 1, 1)
