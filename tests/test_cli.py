"""The command line a user runs: `launch generate` on the embedded model and on a checkpoint
directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dist_glm5.checkpoint.default_model import ensure_default_model
from dist_glm5.checkpoint.tokenizer import load_tokenizer


def _run(*args, env=None):
    exe = shutil.which("launch") or None
    cmd = (
        [exe, *args]
        if exe
        else [
            sys.executable,
            "-c",
            "import sys; from dist_glm5.launch.cli import launch_main; sys.exit(launch_main())",
            *args,
        ]
    )
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def test_generate_json_on_embedded_model(default_model_dir):
    r = _run("generate", "--prompt", "Hello, GLM-5", "--max-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 6 and isinstance(out["text"], str)
    # the prompt's ids in the shipped model's vocabulary (12 bytes; fewer with BPE pieces)
    n = len(load_tokenizer(ensure_default_model()).encode("Hello, GLM-5"))
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 6}


def test_prompt_ids_from_file_and_sampling_flags(tmp_path, default_model_dir):
    f = tmp_path / "ids.txt"
    f.write_text(",".join(str(i % 256) for i in range(500)))
    args = (
        "generate",
        "--prompt-ids",
        f"@{f}",
        "--max-tokens",
        "4",
        "--temperature",
        "0.9",
        "--seed",
        "3",
        "--json",
    )
    a, b = _run(*args), _run(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]
    assert json.loads(a.stdout)["usage"]["prompt_tokens"] == 500


@pytest.mark.parametrize(
    "args,needle",
    [
        (("generate", "--prompt-ids", "1,x,3"), "comma-separated"),
        (("generate", "--prompt-ids", "1,2,99999"), "outside"),
        (("generate", "--prompt", "hi", "--temperature", "-1"), "temperature"),
        (("generate", "--prompt", "hi", "--model", "/nonexistent/dir"), "no config.json"),
    ],
)
def test_bad_input_is_a_clear_error(args, needle, default_model_dir):
    r = _run(*args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_dist_glm5_launch_is_the_same_command(default_model_dir):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dist_glm5.launch.cli",
            "launch",
            "generate",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    a = _run("generate", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--json")
    assert json.loads(r.stdout)["token_ids"] == json.loads(a.stdout)["token_ids"]


def test_generate_with_layout_flags_matches_single_process(default_model_dir, tmp_path):
    # 150 tokens: above the embedded model's index_topk (64), so DSA selection happens
    ids = tmp_path / "prompt.txt"
    ids.write_text(",".join(str((7 * i) % 256) for i in range(150)))
    base = _run("generate", "--prompt-ids", f"@{ids}", "--max-tokens", "6", "--json")
    r = _run(
        "generate",
        "--prompt-ids",
        f"@{ids}",
        "--max-tokens",
        "6",
        "--json",
        "--stages",
        "2",
        "--mtp",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == json.loads(base.stdout)["token_ids"]
    assert (
        out["layout"] == {"stages": 2, "tp": 1, "ep": 1, "mtp": True} and "acceptance" in out["mtp"]
    )
