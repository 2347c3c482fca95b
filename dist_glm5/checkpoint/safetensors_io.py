"""Safetensors checkpoints: read with `safetensors.safe_open` (lazy, mmap), written streaming.

Ours (safetensors lacks them): pread reads off the mmap, errors naming the tensor, streaming writes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024
_FIX = "re-download or re-convert it"


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


def _unsupported(name: str, dtype: str) -> str:
    return f"tensor {name!r} has unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})"


def _diagnose(path: Path, size: int) -> str | None:
    """Why the library rejected `path`, naming the tensor where one is to blame (the library's
    messages name neither file nor tensor); None if these checks find nothing."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return f"truncated safetensors file ({size} bytes, no header): {_FIX}"
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > _MAX_HEADER or 8 + hlen > size:
            return (
                f"header length {hlen} exceeds the file size {size}: the file is truncated or "
                f"not safetensors; {_FIX}"
            )
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return f"header is not valid JSON ({e}): the file is corrupt; {_FIX}"
    base, end = 8 + hlen, 0
    try:
        header.pop("__metadata__", None)
        entries = sorted((tuple(int(x) for x in t["data_offsets"]), n) for n, t in header.items())
        for (a, b), name in entries:
            t = header[name]
            if t["dtype"] not in DTYPES:
                return _unsupported(name, t["dtype"])
            shape = [int(s) for s in t["shape"]]
            if a != end:
                return (
                    f"tensor {name!r} starts at data offset {a}, not {end} where the previous "
                    f"tensor ends: the file is corrupt; {_FIX}"
                )
            need = math.prod(shape) * DTYPES[t["dtype"]].itemsize
            if b - a != need:
                return (
                    f"tensor {name!r} declares {b - a} bytes but shape {shape} of {t['dtype']} "
                    f"needs {need}: the file is corrupt; {_FIX}"
                )
            if base + b > size:
                return (
                    f"tensor {name!r} ends at byte {base + b} but the file has {size} bytes: "
                    f"the file is truncated; {_FIX}"
                )
            end = b
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if base + end != size:
        return (
            f"{size - base - end} bytes follow the last tensor: the file is corrupt or was "
            f"appended to; {_FIX}"
        )
    return None


class SafeTensorsFile:
    """One file through `safe_open`: `get` returns a zero-copy view of its copy-on-write mmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        try:
            self._st = safe_open(self.path, framework="pt")
            kinds = [
                (n, sl.get_dtype(), tuple(sl.get_shape()))
                for n, sl in ((n, self._st.get_slice(n)) for n in self._st.offset_keys())
            ]
        except SafetensorError as e:
            why = _diagnose(self.path, size) or f"not a valid safetensors file ({e}); {_FIX}"
            raise CheckpointError(f"{self.path}: {why}") from None
        self.metadata: dict[str, str] = self._st.metadata() or {}
        for name, dt, _ in kinds:
            if dt not in DTYPES:
                raise CheckpointError(f"{self.path}: {_unsupported(name, dt)}")
        # The library checks that the tensors tile the data section in offset order, without gaps,
        # up to the end of the file: so their offsets follow from their sizes.
        sizes = [DTYPES[dt].itemsize * math.prod(shape) for _, dt, shape in kinds]
        pos = size - sum(sizes)
        self.tensors: dict[str, TensorInfo] = {}
        for (name, dt, shape), n in zip(kinds, sizes):
            self.tensors[name] = TensorInfo(name, DTYPES[dt], shape, self.path, pos, pos + n)
            pos += n
        self._fd = open(self.path, "rb")

    def get(self, name: str) -> torch.Tensor:
        self.tensors[name]  # KeyError for a name the file does not hold, as a dict would
        try:
            return self._st.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} could not be read ({e}); {_FIX}"
            ) from None

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
            raise CheckpointError(
                f"{self.path}: short read of tensor {name!r} ({got} of {nbytes} "
                f"bytes): the file shrank while open; {_FIX}"
            )
        return torch.frombuffer(buf, dtype=torch.uint8).view(info.dtype).reshape(shape)

    def close(self) -> None:
        # Tensors handed out keep their mapping alive; just drop our references.
        self._fd.close()
        self._st = None


class Checkpoint:
    """All safetensors files of a checkpoint directory (single file or sharded with an index)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] | None = _read_index(index)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not files and weight_map is None:
            raise CheckpointError(
                f"{self.dir}: no *.safetensors files: is this a checkpoint directory?"
            )
        self.files: dict[str, SafeTensorsFile] = {}
        self.where: dict[str, SafeTensorsFile] = {}
        for fn in files:
            self._open(fn, index)
        if weight_map is not None:
            self._check_index(index, weight_map)

    def _open(self, fn: str, index: Path) -> None:
        """Open file `fn` of the checkpoint and say where its tensors are; a tensor in two files
        is refused."""
        p = self.dir / fn
        if not p.exists():
            raise CheckpointError(f"{index}: lists {fn}, which is missing from {self.dir}")
        f = SafeTensorsFile(p)
        self.files[fn] = f
        for name in f.tensors:
            if name in self.where:
                raise CheckpointError(
                    f"{self.dir}: tensor {name!r} appears in both "
                    f"{self.where[name].path.name} and {fn}"
                )
            self.where[name] = f

    def _check_index(self, index: Path, weight_map: dict[str, str]) -> None:
        """The index and the files agree: each tensor it maps is in the file it names, and the
        files hold no tensor it leaves out."""
        for name, fn in weight_map.items():
            if name not in self.where or self.where[name].path.name != fn:
                raise CheckpointError(
                    f"{index}: maps {name!r} to {fn}, but that file does not hold it"
                )
        stray = sorted(set(self.where) - set(weight_map))
        if stray:
            raise CheckpointError(
                f"{index}: tensors in the files but not in the index: {stray[:10]}"
            )

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


def _read_index(index: Path) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json (tensor name -> file name)."""
    try:
        return json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None


def _header_bytes(
    items: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dtype, shape in items:
        n = dtype.itemsize
        for s in shape:
            n *= s
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [off, off + n],
        }
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align data to 8 bytes like the reference writer
    return struct.pack("<Q", len(raw)) + raw


def save_streaming(
    path: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    plan: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None,
) -> Path:
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
                # a tensor, or its parts in order
                for part in [t] if isinstance(t, torch.Tensor) else t:
                    if part.dtype != dtype:
                        raise ValueError(
                            f"save_streaming: {name} part has dtype {part.dtype}, expected {dtype}"
                        )
                    if part.numel():
                        f.write(memoryview(part.contiguous().reshape(-1).view(torch.uint8).numpy()))
                    wrote += part.numel() * part.element_size()
                if wrote != want or (isinstance(t, torch.Tensor) and tuple(t.shape) != shape):
                    raise ValueError(
                        f"save_streaming: {name} got {wrote} bytes, expected {want} "
                        f"for shape {list(shape)}"
                    )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
