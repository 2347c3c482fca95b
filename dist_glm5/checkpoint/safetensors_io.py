"""Memory-mapped safetensors reading and streaming writing.

Our own small reader (the format is an 8-byte header length, a JSON header, then raw bytes) so
that tensors are zero-copy views of a copy-on-write mmap, and so that a truncated or malformed
file fails with an error that names the file, the tensor and the fix. Writing streams tensor by
tensor under a temporary name and renames when complete, so a crash never leaves a partial
file under its final name.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint on disk is malformed or does not match what the model needs."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one file's header: every tensor's dtype, shape and byte range."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header): re-download or re-convert it")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > _MAX_HEADER or 8 + hlen > size:
            raise CheckpointError(f"{path}: header length {hlen} exceeds the file size {size}: the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: header is not valid JSON ({e}): the file is corrupt") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, t in header.items():
        try:
            dtype = DTYPES[t["dtype"]]
        except KeyError:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {t.get('dtype')!r}") from None
        shape = tuple(int(s) for s in t["shape"])
        a, b = (int(x) for x in t["data_offsets"])
        numel = 1
        for s in shape:
            numel *= s
        if b - a != numel * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} declares {b - a} bytes but shape {list(shape)} of {t['dtype']} needs {numel * dtype.itemsize}")
        if base + b > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {base + b} but the file has {size} bytes: the file is truncated; re-download or re-convert it")
        out[name] = TensorInfo(name, dtype, shape, path, base + a, base + b)
    return out, meta


class SafeTensorsFile:
    """One file, memory-mapped copy-on-write: `get` returns a zero-copy tensor view."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self._fd = open(self.path, "rb")
        size = self.path.stat().st_size
        self._mm = mmap.mmap(self._fd.fileno(), size, access=mmap.ACCESS_COPY) if size else None

    def get(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        t = torch.frombuffer(self._mm, dtype=torch.uint8, count=info.nbytes, offset=info.start)
        return t.view(info.dtype).reshape(info.shape)

    def read(self, name: str, rows: range | None = None) -> torch.Tensor:
        """A private copy read with pread, not the mapping: streaming converters use this so that
        resident memory stays flat however much of the checkpoint they pass through.
        `rows` reads only those rows of the first dimension (one contiguous byte range)."""
        info = self.tensors[name]
        shape, start, nbytes = info.shape, info.start, info.nbytes
        if rows is not None:
            row_bytes = info.nbytes // shape[0] if shape and shape[0] else 0
            if rows.step != 1 or rows.start < 0 or rows.stop > shape[0]:
                raise ValueError(f"rows {rows} out of range for {name} with shape {list(shape)}")
            shape = (len(rows), *shape[1:])
            start, nbytes = start + rows.start * row_bytes, len(rows) * row_bytes
        if not nbytes:
            return torch.empty(shape, dtype=info.dtype)
        buf = bytearray(nbytes)
        got = os.preadv(self._fd.fileno(), [buf], start)
        if got != nbytes:
            raise CheckpointError(f"{self.path}: short read of tensor {name!r} ({got} of {nbytes} bytes)")
        return torch.frombuffer(buf, dtype=torch.uint8).view(info.dtype).reshape(shape)

    def close(self) -> None:
        # Tensors handed out keep the mmap alive through their buffer; just drop our references.
        self._fd.close()


class Checkpoint:
    """All safetensors files of a checkpoint directory (single file or sharded with an index)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not files and weight_map is None:
            raise CheckpointError(f"{self.dir}: no *.safetensors files: is this a checkpoint directory?")
        self.files: dict[str, SafeTensorsFile] = {}
        self.where: dict[str, SafeTensorsFile] = {}
        for fn in files:
            p = self.dir / fn
            if not p.exists():
                raise CheckpointError(f"{index}: lists {fn}, which is missing from {self.dir}")
            f = SafeTensorsFile(p)
            self.files[fn] = f
            for name in f.tensors:
                if name in self.where:
                    raise CheckpointError(f"{self.dir}: tensor {name!r} appears in both {self.where[name].path.name} and {fn}")
                self.where[name] = f
        if weight_map is not None:
            for name, fn in weight_map.items():
                if name not in self.where or self.where[name].path.name != fn:
                    raise CheckpointError(f"{index}: maps {name!r} to {fn}, but that file does not hold it")
            stray = sorted(set(self.where) - set(weight_map))
            if stray:
                raise CheckpointError(f"{index}: tensors in the files but not in the index: {stray[:10]}")

    def names(self) -> list[str]:
        return sorted(self.where)

    def info(self, name: str) -> TensorInfo:
        return self.where[name].tensors[name]

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get(name)

    def read(self, name: str, rows: range | None = None) -> torch.Tensor:
        return self.where[name].read(name, rows)

    def __contains__(self, name: str) -> bool:
        return name in self.where


def _header_bytes(items: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dtype, shape in items:
        n = dtype.itemsize
        for s in shape:
            n *= s
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align data to 8 bytes like the reference writer
    return struct.pack("<Q", len(raw)) + raw


def save_streaming(path: str | Path, tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
                   metadata: dict[str, str] | None = None,
                   plan: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None) -> Path:
    """Write a safetensors file atomically (temp name, fsync, rename).

    With `plan` (name, dtype, shape of each tensor, in order), `tensors` may be a generator that
    yields them one at a time, so memory stays flat however large the file is.
    """
    path = Path(path)
    if isinstance(tensors, dict):
        tensors = list(tensors.items())
    if plan is None:
        tensors = list(tensors)
        plan = [(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(_header_bytes(plan, metadata))
            it: Iterator = iter(tensors)
            for name, dtype, shape in plan:
                got_name, t = next(it)
                if got_name != name:
                    raise ValueError(f"save_streaming: expected tensor {name}, got {got_name}")
                want = dtype.itemsize * math.prod(shape)
                wrote = 0
                for part in ([t] if isinstance(t, torch.Tensor) else t):  # a tensor, or its parts in order
                    if part.dtype != dtype:
                        raise ValueError(f"save_streaming: {name} part has dtype {part.dtype}, expected {dtype}")
                    if part.numel():
                        f.write(memoryview(part.contiguous().reshape(-1).view(torch.uint8).numpy()))
                    wrote += part.numel() * part.element_size()
                if wrote != want or (isinstance(t, torch.Tensor) and tuple(t.shape) != shape):
                    raise ValueError(f"save_streaming: {name} got {wrote} bytes, expected {want} for shape {list(shape)}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
