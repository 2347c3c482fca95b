"""A dispatch guard for one step: what the Gaudi graph compiler and lazy mode cannot take.

Run a step under `StepGuard(...)` (a TorchDispatchMode: it sees every aten op the step runs, on any
device) and read `violations`:
- "data-dependent": ops whose output shape or control flow depends on values (nonzero, unique,
  masked_select, boolean indexing, `.item()`/`bool()`/`int()` of a tensor): each one is a host
  sync and a new graph per distinct result on the card;
- "int64": an int64 result holding a value outside int32 (lazy mode casts int64 to int32 on the
  device, so it would wrap silently);
- "gather": one gather (index_select / index / gather / take) from a cache store producing more
  than `gather_cap_bytes` (a 9.7 GB gather hung all eight cards, design.md section 3); `stores`
  names the cache tensors (all gathers are checked when it is not given);
- "host": a tensor made inside the step by a torch factory (empty, zeros, full, arange, tensor,
  ...) without `device=`: it lands on the host, and meets the device's tensors in the next op
  (seen through a TorchFunctionMode, which sees the arguments as written).
Each violation names the op and the innermost dist_glm5 source line that caused it. An opaque op
(a native kernel, or the fake's CPU implementation of one) counts as one op: the guard does not
look inside it. A CPU-only tool: it reads values, so it syncs.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_DATA_DEPENDENT = {
    "nonzero",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "masked_select",
    "masked_scatter",
    "_local_scalar_dense",
    "argwhere",
    "repeat_interleave",
}
# cache reads; the embedding lookup is not capped (T x H: 100 MB at 8192 tokens of GLM-5)
_GATHERS = {"index_select", "index", "gather", "take", "_unsafe_index"}
_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index"}
_HERE = str(Path(__file__).resolve())
_PKG = str(Path(__file__).resolve().parents[2])  # .../dist_glm5


@dataclass(frozen=True)
class Violation:
    kind: str  # "data-dependent" | "int64" | "gather" | "host"
    op: str
    where: str  # "dist_glm5/model/mla.py:123 in forward"
    detail: str = ""


def _site() -> str:
    for fr in reversed(traceback.extract_stack()):
        f = str(Path(fr.filename).resolve()) if fr.filename[:1] != "<" else fr.filename
        if f != _HERE and f.startswith(_PKG):
            return f"dist_glm5/{Path(f).relative_to(_PKG)}:{fr.lineno} in {fr.name}"
    return "outside dist_glm5"


_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.tensor,
    torch.as_tensor,
    torch.eye,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.randint,
}


class _HostFactories(TorchFunctionMode):
    def __init__(self, guard: "StepGuard"):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            self.guard._flag("host", func.__name__, "made without device=")
        return func(*args, **kwargs)


class StepGuard(TorchDispatchMode):
    def __init__(self, gather_cap_bytes: int = 512 * 1024 * 1024, stores=None):
        super().__init__()
        self.cap = gather_cap_bytes
        self.stores = None if stores is None else {_ptr(t) for t in stores}
        self.violations: list[Violation] = []
        self.ops = 0

    def __enter__(self):
        self._host = _HostFactories(self)
        self._host.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._host.__exit__(*exc)

    def _flag(self, kind: str, op: str, detail: str = "") -> None:
        self.violations.append(Violation(kind, op, _site(), detail))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = func.overloadpacket.__name__
        if name in _DATA_DEPENDENT and not (name == "repeat_interleave" and _int_repeats(args)):
            self._flag("data-dependent", str(func))
        if name in _INDEXED and _bool_index(args):
            self._flag("data-dependent", str(func), "boolean-mask index")
        out = func(*args, **kwargs)
        gather = name in _GATHERS and (
            self.stores is None
            or (isinstance(args[0], torch.Tensor) and _ptr(args[0]) in self.stores)
        )
        flat, _ = tree_flatten(out)
        for t in flat:
            if not isinstance(t, torch.Tensor):
                continue
            if gather and t.numel() * t.element_size() > self.cap:
                self._flag("gather", str(func), f"{t.numel() * t.element_size()} bytes")
            if t.dtype == torch.int64 and t.numel() and _computes_values(func):
                lo, hi = int(t.min()), int(t.max())
                if lo < INT32_MIN or hi > INT32_MAX:
                    self._flag("int64", str(func), f"values {lo}..{hi}")
        return out

    def by_kind(self, kind: str) -> list[Violation]:
        return [v for v in self.violations if v.kind == kind]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _computes_values(func) -> bool:
    """False for ops whose int64 output holds no new values: uninitialised allocations (empty*)
    and views of an earlier result (checked when that was produced)."""
    if func.overloadpacket.__name__.startswith(("empty", "new_empty")):
        return False
    rets = func._schema.returns
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else ()
    flat, _ = tree_flatten(idx)
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in flat)


def _int_repeats(args) -> bool:
    return len(args) > 1 and isinstance(args[1], int)
