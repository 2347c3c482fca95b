"""Build a C kernel with gcc at first use and load it with ctypes.

Why not a torch C++ extension: ninja + the torch headers take minutes on two cores, while one C
file with `gcc -O3 -shared` takes about a second and needs nothing but gcc on a fresh machine.

Contract of `load(source, flags)`:
- the library is cached in `$DIST_GLM5_HOME/kernels/` (default `~/.cache/dist_glm5/kernels/`),
  named by a hash of the source text (and the local headers it includes), the compiler and the
  flags, so an edited source or header or a changed flag rebuilds and an unchanged one loads in
  milliseconds;
- it is written under a temporary name and renamed into place, so concurrent processes never
  load a half-written file (the last rename wins; both files are identical);
- any failure (no compiler, compile error, load error) logs ONE warning and returns None:
  callers fall back to their reference path and never crash on a missing toolchain.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

# -O3 without -march: the fast functions choose their ISA with target attributes and the
# library dispatches at run time, so one cached file serves any x86-64 CPU of this kind.
# -fopenmp links libgomp.so.1, the soname torch's wheel also loads: the dynamic loader reuses
# torch's copy, so one OpenMP runtime and thread pool serve both.
DEFAULT_FLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu11", "-fopenmp", "-lm")


def disabled() -> bool:
    """DIST_GLM5_KERNELS=0 (or false/no/off): every C kernel off, the references run."""
    return os.environ.get("DIST_GLM5_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


def cache_dir() -> Path:
    home = os.environ.get("DIST_GLM5_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "dist_glm5"
    return base / "kernels"


def compiler() -> str | None:
    """The C compiler to use: $CC if set, else gcc, else cc (None if none is on PATH)."""
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def local_includes(source: Path) -> list[Path]:
    """The headers beside `source` that it includes (`#include "name.h"`), and theirs."""
    out: list[Path] = []
    todo = [source]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop().read_text(), re.M):
            path = source.parent / name
            if path not in out:
                out.append(path)
                todo.append(path)
    return out


def library_path(source: Path, flags: tuple[str, ...], cc: str) -> Path:
    h = hashlib.sha256()
    for f in [source, *local_includes(source)]:  # an edited header rebuilds its kernels
        h.update(f.read_bytes())
    h.update(("\0".join((cc,) + flags)).encode())
    return cache_dir() / f"{source.stem}-{h.hexdigest()[:16]}.so"


def build(source: Path, flags: tuple[str, ...] = DEFAULT_FLAGS) -> Path:
    """Compile `source` into the cache (if not there yet) and return the library's path.

    Raises RuntimeError with the compiler's message when there is no compiler or it fails.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    path = library_path(source, flags, cc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # one compiler per library across processes (a pipeline's workers start together and would
    # each compile the same file: minutes of CPU on 2 cores); the others wait, then load it
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            cmd = [cc, str(source), "-o", tmp, *flags]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.debug("built %s", path)
    return path


def load(source: Path, *flag_sets: tuple[str, ...]) -> ctypes.CDLL | None:
    """build() then ctypes.CDLL() with the first set of flags that works (default: DEFAULT_FLAGS,
    then the same without OpenMP, for a gcc whose libgomp is missing); None, after ONE warning
    naming the first failure, if none does."""
    if not flag_sets:
        flag_sets = (DEFAULT_FLAGS, tuple(f for f in DEFAULT_FLAGS if f != "-fopenmp"))
    first_error: Exception | None = None
    for flags in flag_sets:
        try:
            lib = ctypes.CDLL(str(build(source, flags)))
        except Exception as exc:  # noqa: BLE001 - any failure means "try the next, or fall back"
            first_error = first_error or exc
            log.debug("building %s with %s failed: %s", source.name, flags, exc)
            continue
        if flags != flag_sets[0]:
            log.info(
                "kernel %s built with %s (the first flags failed: %s)",
                source.name,
                " ".join(flags),
                _one_line(first_error),
            )
        return lib
    log.warning(
        "kernel %s unavailable, using the reference path: %s", source.name, _one_line(first_error)
    )
    return None


def _one_line(exc: Exception | None) -> str:
    """The gist of a build error on one line: the command's first error line, if any."""
    if exc is None:
        return "unknown error"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines[1:] if "error" in ln.lower()]
    return (errors[0] if errors else lines[0]) if lines else type(exc).__name__


class Lazy:
    """A C kernel's library, built and loaded at first use, once per process (thread-safe):
    `signatures(lib)` sets its functions' ctypes argtypes and restypes. `get()` is the library,
    or None when it cannot build or DIST_GLM5_KERNELS=0 (callers take their reference path)."""

    def __init__(self, source: Path, signatures, *flag_sets: tuple[str, ...]):
        self.source, self.signatures, self.flag_sets = source, signatures, flag_sets
        self._lib: ctypes.CDLL | None = None
        self._loaded = False
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if self._loaded:
            return self._lib
        with self._lock:
            if not self._loaded:
                try:
                    if disabled():
                        log.info("DIST_GLM5_KERNELS=0: %s off, references run", self.source.name)
                    else:
                        lib = load(self.source, *self.flag_sets)
                        if lib is not None:
                            self.signatures(lib)
                            self._lib = lib
                finally:
                    self._loaded = True  # last: a thread that sees it set also sees _lib
        return self._lib

    def available(self) -> bool:
        """Whether the library built and loaded (building it at the first call)."""
        return self.get() is not None
