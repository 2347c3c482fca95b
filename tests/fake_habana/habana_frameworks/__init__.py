"""Recording fake of the Gaudi stack (tests only): see tests/fake_habana/README.md."""

from __future__ import annotations

import torch

# One list per process, kept on torch: the ops registered with torch.library by a first import of
# this fake keep recording into it after the tests purge and re-import the package.
RECORD: list[tuple[str, tuple, dict]] = torch.__dict__.setdefault("_fake_habana_record", [])


def record(name: str, *args, **kwargs) -> None:
    RECORD.append((name, args, kwargs))


def calls(name: str) -> list[tuple[tuple, dict]]:
    return [(a, k) for n, a, k in RECORD if n == name]


def reset() -> None:
    RECORD.clear()
