"""Exactness at scale, on demand: one long prompt through `launch batch` as two pipeline stages
(Ray) and again in one process (no Ray, every layer in one worker): the greedy token ids must be
equal. Opt-in (DIST_GLM5_SLOW_TESTS=1): at the default 128K context it takes ~10 minutes on two
cores. DIST_GLM5_LONG_JOB_CTX changes the context (e.g. 32k); DIST_GLM5_LONG_JOB_ADDRESS and
DIST_GLM5_LONG_JOB_HOST run the two stages on an existing cluster (the netns nodes: run pytest
through `dist-glm5 bench netns exec --`). CI's own check at 32K is tests/test_long_context.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(
    os.environ.get("DIST_GLM5_SLOW_TESTS") != "1",
    reason="opt-in: DIST_GLM5_SLOW_TESTS=1 (a 128K prompt twice: ~10 minutes on two cores)",
)
def test_two_stage_long_job_equals_one_process(tmp_path):
    ctx = os.environ.get("DIST_GLM5_LONG_JOB_CTX", "128k")
    cmd = [sys.executable, "-m", "dist_glm5.launch.cli", "--log-level", "INFO", "bench"]
    cmd += ["long-job", "--ctx", ctx, "--stages", "2", "--compare-one-process"]
    cmd += ["--dir", str(tmp_path)]
    if address := os.environ.get("DIST_GLM5_LONG_JOB_ADDRESS"):
        cmd += ["--address", address, "--host", os.environ["DIST_GLM5_LONG_JOB_HOST"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    res = json.loads((tmp_path / "summary.json").read_text())
    assert len(res["token_ids"]) == 4 and res["one_process"]["token_ids"] == res["token_ids"]
    assert res["equal"] and r.returncode == 0
