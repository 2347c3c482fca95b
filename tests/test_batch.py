"""`launch batch`: exactly one result line per prompt, also after the job is killed halfway."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

LAUNCH = [
    sys.executable,
    "-c",
    "import sys; from dist_glm5.launch.cli import launch_main; sys.exit(launch_main())",
]


def _lines(path):
    return (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )


def test_batch_killed_halfway_completes_on_rerun(tmp_path, default_model_dir):
    inp = tmp_path / "prompts.jsonl"
    jobs = [
        {
            "id": f"p{i}",
            "prompt": f"prompt number {i}",
            "max_tokens": 4 + 12 * i,
            "ignore_eos": True,
        }
        for i in range(6)
    ]
    jobs.append(
        {"id": "bad", "prompt_ids": [1, 2, 999999]}
    )  # fails: recorded on its line, nothing lost
    inp.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    ref = tmp_path / "reference.jsonl"
    r = subprocess.run(
        [*LAUNCH, "batch", "--input", str(inp), "--output", str(ref)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    want = {x["id"]: x for x in _lines(ref)}
    assert sorted(want) == sorted(j["id"] for j in jobs) and "outside" in want["bad"]["error"]

    out = tmp_path / "results.jsonl"
    # the job kills itself (SIGKILL) right after its third result line: a deterministic point
    r = subprocess.run(
        [*LAUNCH, "batch", "--input", str(inp), "--output", str(out)],
        env={**os.environ, "DIST_GLM5_BATCH_KILL_AFTER": "3"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert len(_lines(out)) == 3
    r = subprocess.run(
        [*LAUNCH, "batch", "--input", str(inp), "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = _lines(out)
    ids = [x["id"] for x in got]
    assert sorted(ids) == sorted(want) and len(ids) == len(set(ids))
    for x in got:
        assert x.get("token_ids") == want[x["id"]].get("token_ids") and x.get("error") == want[
            x["id"]
        ].get("error")


def test_batch_stops_cleanly_on_ctrl_c_and_resumes(tmp_path, default_model_dir):
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    jobs = [
        {"id": f"p{i}", "prompt": f"prompt {i}", "max_tokens": n, "ignore_eos": True}
        for i, n in enumerate([30, 4, 50, 8])
    ]
    inp.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    cmd = [*LAUNCH, "batch", "--input", str(inp), "--output", str(out)]
    # Ctrl-C (SIGINT) right after the first result line: the step finishes, the job stops
    env = {**os.environ, "DIST_GLM5_BATCH_KILL_AFTER": "1:INT"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 130, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "rerun the same command to resume" in r.stderr
    first = _lines(out)
    assert 1 <= len(first) < len(jobs)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = {x["id"]: x for x in _lines(out)}
    assert len(_lines(out)) == len(jobs) and sorted(got) == sorted(j["id"] for j in jobs)
    assert all(len(got[j["id"]]["token_ids"]) == j["max_tokens"] for j in jobs)
