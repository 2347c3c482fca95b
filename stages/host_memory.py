"""The host allocator's large-block rule, fixed for a worker's lifetime.

glibc serves a block at or above its mmap threshold with its own mapping and returns it to the OS
when freed; below it, from the heap, which keeps what it freed. By default the threshold moves: each
freed mapped block raises it to that block's size (up to 32 MiB), so after a prefill's first large
temporaries, later ones of a few MiB land in the heap and stay resident after use. Which ones do
depends on the order of frees, so a worker's peak RSS varied by 15-25 MiB from run to run on the
embedded model (tests/test_long_context), and ran above what the planner counts. A fixed threshold
(which also stops the adjustment) makes every temporary of at least 1 MiB its own mapping, gone
when freed: the peak is what is live at once, as the planner reckons it."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold to `nbytes` for this process; False where the C library is not
    glibc (then the allocator keeps its own rule, and peak RSS may run above the plan)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.warning("no glibc mallopt here: the host allocator keeps its own large-block rule")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) refused", nbytes)
        return False
    return True
