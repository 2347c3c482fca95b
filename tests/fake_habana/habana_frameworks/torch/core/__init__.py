"""`mark_step` (flushes the lazy graph on a real card; recorded here). Importing this module
registers the native ops and the `hpu_backend` compile backend, as the real import does."""

from __future__ import annotations

from ... import record
from .. import _fake_ops

_fake_ops.register()


def mark_step(device_str: str = "", sync: bool = False) -> None:
    record("core.mark_step", device_str=device_str, sync=sync)
