"""Warm-up: run every bucket once before serving, so no first-touch compile happens under load.

Each bucket runs inside bridge_config.env_setting("PT_COMPILE_ONLY_MODE", True) when the stack has
it (graphs compile, nothing launches: garbage results by design), then mark_step + synchronize.
Its wall time is logged against the driver's lock-up timer: the habanalabs module parameter
`timeout_locked` (seconds; 0 = disabled), read from /sys/module/habanalabs/parameters/. A compile
near that timer kills the card with "no progress"; the project's nodes showed 600 s, while the
driver's own Gaudi 2 default is 30 s (gaudi.md section 6), so read it, never assume it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Iterable

from . import _hf, runtime

log = logging.getLogger(__name__)
TIMEOUT_LOCKED = Path("/sys/module/habanalabs/parameters/timeout_locked")


def read_timeout_locked(path: Path = TIMEOUT_LOCKED) -> int | None:
    """The driver's lock-up timer in seconds (0 = disabled), or None when not readable here."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class BucketTime:
    bucket: Hashable
    seconds: float


def warmup(
    buckets: Iterable[Hashable],
    run_bucket: Callable[[Hashable], None],
    timeout_s: int | None = None,
    margin: float = 0.5,
    clock: Callable[[], float] = time.perf_counter,
) -> list[BucketTime]:
    """Run each bucket once (compile only); log and return its time; warn past `margin` of the
    lock-up timer (default: read from the driver)."""
    timeout_s = read_timeout_locked() if timeout_s is None else timeout_s
    bc = _hf.bridge_config()
    hpu = _hf.hpu()
    out = []
    for b in buckets:
        t0 = clock()
        ctx = bc.env_setting("PT_COMPILE_ONLY_MODE", True) if bc else contextlib.nullcontext()
        with ctx:
            run_bucket(b)
        runtime.mark_step()
        hpu.synchronize()
        dt = clock() - t0
        out.append(BucketTime(b, dt))
        log.info("warm-up bucket %s: %.1f s (lock-up timer %s s)", b, dt, timeout_s)
        if timeout_s and dt > margin * timeout_s:
            log.warning(
                "bucket %s took %.0f s to compile, over %.0f%% of timeout_locked=%d s",
                b,
                dt,
                100 * margin,
                timeout_s,
            )
    return out
