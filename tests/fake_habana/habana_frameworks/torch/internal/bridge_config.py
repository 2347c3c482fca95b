"""`env_setting(name, value)`: a bridge flag set for the duration of a block (warm-up uses
PT_COMPILE_ONLY_MODE)."""

from __future__ import annotations

import contextlib

from ... import record

CURRENT: dict[str, object] = {}


@contextlib.contextmanager
def env_setting(name: str, value):
    record("bridge_config.env_setting.enter", name, value)
    old = CURRENT.get(name)
    CURRENT[name] = value
    try:
        yield
    finally:
        if old is None:
            CURRENT.pop(name, None)
        else:
            CURRENT[name] = old
        record("bridge_config.env_setting.exit", name, value)
