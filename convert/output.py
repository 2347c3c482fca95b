"""A converter's destination directory: claimed for one job, written file by file, resumable.

- `job.json` names the job (tool, source, options). A destination that holds anything else is
  refused; one that holds the same job is resumed.
- Every safetensors file is streamed under a temporary name, fsynced and renamed, then its
  manifest entry (per tensor: shape, dtype, bytes, sha256) is written beside it in
  `.done/FILE.json`. On a rerun a file counts as done only with its entry and matching size;
  anything else (a temp file, a file without its entry) is redone.
- `finish()` writes the index, the manifest, config.json and the other small files last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch

from dist_glm5.checkpoint.safetensors_io import DTYPE_NAMES, save_streaming

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
JOB = "job.json"


class DestinationError(ValueError):
    """The destination cannot be used for this job."""


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class _Hashing:
    """Wraps a tensor (or its parts) to hash the bytes as they are written."""

    def __init__(self, t):
        self.t = t
        self.h = hashlib.sha256()

    def __iter__(self) -> Iterator[torch.Tensor]:
        for part in [self.t] if isinstance(self.t, torch.Tensor) else self.t:
            if part.numel():
                self.h.update(memoryview(part.contiguous().reshape(-1).view(torch.uint8).numpy()))
            yield part


def claim(path: Path, job: dict) -> None:
    """Make `path` this job's: new, empty, or holding the same job (resume). Partial files are
    removed."""
    if path.exists() and any(path.iterdir()):
        jf = path / JOB
        if not jf.exists():
            raise DestinationError(
                f"destination {path} already holds other files: choose an empty or new directory"
            )
        old = json.loads(jf.read_text())
        if old != job:
            raise DestinationError(
                f"destination {path} holds a different conversion ({old.get('tool')} of "
                f"{old.get('source')} with {old.get('options')}): choose another directory or "
                "remove it"
            )
        log.info("resuming the conversion in %s", path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.tmp*"):  # partial files of a crashed run are never trusted
        stale.unlink()
    _atomic_write_text(path / JOB, json.dumps(job, indent=1, sort_keys=True))


def write_json(path: Path, obj) -> None:
    _atomic_write_text(path, json.dumps(obj, indent=1))


class OutputDir:
    def __init__(self, path: str | Path, job: dict):
        self.path = Path(path)
        self.job = job
        self.done = self.path / ".done"
        claim(self.path, job)
        self.done.mkdir(exist_ok=True)

    def is_done(self, filename: str) -> bool:
        f = self.path / filename
        if not f.exists():
            return False
        entry = self.done / f"{filename}.json"
        if entry.exists():
            return json.loads(entry.read_text())["file_bytes"] == f.stat().st_size
        m = (
            self.path / MANIFEST
        )  # a finished job rerun: trust files its manifest lists with their size
        return m.exists() and json.loads(m.read_text())["files"].get(filename) == f.stat().st_size

    def write(
        self,
        filename: str,
        plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
        tensors: Iterable[tuple[str, object]],
    ) -> None:
        """Stream one safetensors file; `tensors` yields (name, tensor or iterable of parts) in plan
        order."""
        hashes: dict[str, _Hashing] = {}

        def hashed():
            for name, t in tensors:
                hashes[name] = _Hashing(t)
                yield name, hashes[name]

        save_streaming(self.path / filename, hashed(), metadata={"format": "pt"}, plan=plan)
        entry = {
            "file": filename,
            "file_bytes": (self.path / filename).stat().st_size,
            "tensors": {
                name: {
                    "dtype": DTYPE_NAMES[dt],
                    "shape": list(shape),
                    "bytes": dt.itemsize * _numel(shape),
                    "sha256": hashes[name].h.hexdigest(),
                }
                for name, dt, shape in plan
            },
        }
        _atomic_write_text(self.done / f"{filename}.json", json.dumps(entry))

    def finish(
        self, config: dict, extra_files: Iterable[Path] = (), manifest_extra: dict | None = None
    ) -> dict:
        entries = [json.loads(p.read_text()) for p in sorted(self.done.glob("*.json"))]
        old = self.path / MANIFEST
        if old.exists():  # files finished by an earlier complete run of the same job
            m = json.loads(old.read_text())
            have = {e["file"] for e in entries}
            for fn, size in m["files"].items():
                if fn not in have:
                    entries.append(
                        {
                            "file": fn,
                            "file_bytes": size,
                            "tensors": {
                                n: {k: v for k, v in t.items() if k != "file"}
                                for n, t in m["tensors"].items()
                                if t["file"] == fn
                            },
                        }
                    )
        weight_map, tensors = {}, {}
        for e in entries:
            for name, t in e["tensors"].items():
                weight_map[name] = e["file"]
                tensors[name] = {**t, "file": e["file"]}
        for f in extra_files:
            shutil.copyfile(f, self.path / f.name)
        _atomic_write_text(
            self.path / "model.safetensors.index.json",
            json.dumps(
                {
                    "metadata": {"total_size": sum(t["bytes"] for t in tensors.values())},
                    "weight_map": weight_map,
                },
                indent=1,
            ),
        )
        _atomic_write_text(self.path / "config.json", json.dumps(config, indent=1))
        manifest = {
            "job": self.job,
            "files": {e["file"]: e["file_bytes"] for e in entries},
            "tensors": tensors,
            **(manifest_extra or {}),
        }
        _atomic_write_text(self.path / MANIFEST, json.dumps(manifest, indent=1))
        shutil.rmtree(self.done)
        return manifest


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
