"""Peak resident memory of this process.

VmHWM from /proc (the high-water mark of this process's own address space). Not ru_maxrss: Linux
carries ru_maxrss across exec, so a child started by a big parent reports the parent's peak."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
