"""Recording fake of the Gaudi stack (tests only): see tests/fake_habana/README.md."""

from __future__ import annotations

import json
import os

import torch as _torch  # not `torch`: the subpackage habana_frameworks.torch takes that name

# One list per process, kept on torch: the ops registered with torch.library by a first import of
# this fake keep recording into it after the tests purge and re-import the package.
RECORD: list[tuple[str, tuple, dict]] = _torch.__dict__.setdefault("_fake_habana_record", [])
# Worker processes (Ray actors) cannot hand RECORD back: with FAKE_HABANA_LOG=<dir> every call is
# also appended to <dir>/<pid>.jsonl as its name and the shapes of its tensor arguments.
LOG_ENV = "FAKE_HABANA_LOG"


def record(name: str, *args, **kwargs) -> None:
    RECORD.append((name, args, kwargs))
    log = os.environ.get(LOG_ENV)
    if log:
        shapes = [list(a.shape) for a in args if isinstance(a, _torch.Tensor)]
        with open(os.path.join(log, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"name": name, "shapes": shapes}) + "\n")


def calls(name: str) -> list[tuple[tuple, dict]]:
    return [(a, k) for n, a, k in RECORD if n == name]


def reset() -> None:
    RECORD.clear()
