"""`launch profile`: the parts add up to the step, the trace is Chrome trace JSON, the timeline
a PNG."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

LAUNCH = [
    sys.executable,
    "-c",
    "import sys; from dist_glm5.launch.cli import launch_main; sys.exit(launch_main())",
]


def check_profile(out_dir, stages: int, ranks: int):
    a = json.loads((out_dir / "anatomy.json").read_text())
    for kind in ("decode", "prefill"):
        assert sorted(int(s) for s in a[kind]) == list(range(stages)), a[kind].keys()
        for s, r in a[kind].items():
            parts = sum(
                r[p]
                for p in (
                    "experts",
                    "attention",
                    "indexer",
                    "moe_outside",
                    "mlp",
                    "all_reduce",
                    "transfer",
                    "sampler",
                    "draft",
                    "host",
                    "bubble",
                )
            )
            assert abs(parts - r["step"]) <= 0.01 * r["step"] + 0.05, (kind, s, parts, r["step"])
            assert r["ranks"] == ranks and r["experts_slowest"] >= r["experts_mean"] - 1e-9
    trace = json.loads((out_dir / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events and all(
        {"name", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0 for e in events
    )
    assert {e["name"] for e in events} >= {"step", "attention", "experts", "indexer", "sampler"}
    for s in range(stages):
        assert (out_dir / f"timeline-stage-{s}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mtp", [False, True])
def test_profile_in_process(tmp_path, default_model_dir, mtp):
    r = subprocess.run(
        [
            *LAUNCH,
            "profile",
            "--ctx",
            "96",
            "--batch",
            "3",
            "--decode-steps",
            "6",
            "--output",
            str(tmp_path),
        ]
        + ["--mtp"] * mtp,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ms decode step = experts" in r.stdout and "(slowest rank; mean" in r.stdout
    assert "without the routed experts" in r.stdout
    check_profile(tmp_path, 1, 1)
    res = json.loads((tmp_path / "anatomy.json").read_text())
    dec = res["decode"]["0"]
    # the draft: its own span (exclusive) inside its inclusive time, inside the step; none without
    assert (
        (0 < dec["draft"] < dec["draft_inclusive"] < dec["step"])
        if mtp
        else (dec["draft_inclusive"] == 0)
    )
    assert ("of which the MTP draft" in r.stdout) == mtp
    roof, dec = res["roofline"]["0"], res["decode"]["0"]
    # the part without the experts: the step less the slowest rank's experts, against the bytes
    # the planner counts less the expert weights (written out: bound = bytes / bandwidth)
    assert abs(roof["non_expert_ms"] - (dec["step"] - dec["experts_slowest"])) < 1e-9
    assert 0 < roof["non_expert_bytes"] < roof["bytes"]
    want = 1e3 * roof["non_expert_bytes"] / (res["bandwidth_gb_s"] * 1e9)
    assert abs(roof["non_expert_bound_ms"] - want) < 1e-9 * max(1.0, want)


def test_timeline_plot(tmp_path):
    import matplotlib.image

    from dist_glm5.launch.timeline_plot import plot_timeline

    step = [
        ("step", 0.0, 0.008, 0),
        ("recv_wait", 0.0, 0.001, 1),
        ("attention", 0.001, 0.002, 1),
        ("indexer", 0.0012, 0.0005, 2),
        ("moe", 0.003, 0.004, 1),
        ("experts", 0.0035, 0.003, 2),
        ("newpart", 0.0075, 0.0005, 1),
    ]  # a name without a colour of its own gets one
    spans = {
        (0, r): [(n, t + 0.01 * k + 0.001 * r, d, dep) for k in range(3) for n, t, d, dep in step]
        for r in range(2)
    }
    one = plot_timeline(tmp_path / "one.png", {(0, 0): spans[(0, 0)]}, "one rank")
    two = plot_timeline(tmp_path / "two.png", spans, "two ranks")
    a, b = matplotlib.image.imread(one), matplotlib.image.imread(two)
    assert a.shape[1] == b.shape[1] >= 1000 and b.shape[0] > a.shape[0]  # a row more, same width
    assert plot_timeline(tmp_path / "none.png", {(0, 0): []}, "nothing") is None
    assert not (tmp_path / "none.png").exists()


def test_decode_anatomy_counts_only_steps_of_the_whole_batch():
    from dist_glm5.engine.scheduler import StepKind
    from dist_glm5.launch.profile import output_tokens, whole_batch_kinds, workload_blocks

    # the first sequence to finish leaves step 3 smaller
    steps = {0: StepKind("prefill", 3), 1: StepKind("decode", 3), 2: StepKind("decode", 3)}
    steps[3] = StepKind("decode", 2)
    assert whole_batch_kinds(steps, 3) == {
        0: "prefill",
        1: "decode",
        2: "decode",
        3: "decode-partial",
    }
    # 8 prompts of 32K in chunks of 2K: the first decodes through the others' 128 chunk steps,
    # then 64 decode steps; at 64-token blocks ceil((32,768 + 193 + 1) / 64) = 516 blocks each
    args = argparse.Namespace(ctx=32768, decode_steps=64, batch=8, block_size=64, chunk_tokens=2048)
    assert output_tokens(args) == 64 + 1 + 8 * 16
    assert workload_blocks(args) == 8 * 516
