"""`is_lazy()`: the bridge reads PT_HPU_LAZY_MODE once at start-up (default 1 in bridge 1.19)."""

import os


def is_lazy() -> bool:
    return os.environ.get("PT_HPU_LAZY_MODE", "1") == "1"
