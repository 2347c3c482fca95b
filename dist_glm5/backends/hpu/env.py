"""Bridge environment defaults, applied before habana_frameworks is first imported (the bridge
reads them once) and only where the user has not set them; each one applied is logged.

- PT_HPU_LAZY_MODE=1: lazy mode, the bridge 1.19 default (gaudi-pytorch-bridge env_flags.yaml);
  HPU graphs need it. Set 0 to run the compiled (torch.compile backend="hpu_backend") path.
- PT_HPU_ENABLE_LAZY_COLLECTIVES=true in lazy mode: multi-card HPU graphs need it (default
  false in the bridge).

Read by the backend itself (not a bridge flag): DIST_GLM5_HPU_DEVICE, the torch device the stage
places weights, caches and buffers on: "hpu" (default). The tests' recording fake of the stack has
no device and sets "cpu". `forwarded()` is what a launcher passes on to workers on other nodes.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping

log = logging.getLogger(__name__)


def defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    lazy = environ.get("PT_HPU_LAZY_MODE", "1") == "1"
    d = {"PT_HPU_LAZY_MODE": "1"}
    if lazy:
        d["PT_HPU_ENABLE_LAZY_COLLECTIVES"] = "true"
    return d


def apply_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the defaults the user left unset; returns what was set."""
    environ = os.environ if environ is None else environ
    applied = {}
    for k, v in defaults(environ).items():
        if k not in environ:
            environ[k] = v
            applied[k] = v
            log.info("hpu backend: %s=%s (default; set it to override)", k, v)
    return applied


DEVICE_ENV = "DIST_GLM5_HPU_DEVICE"
DEVICES = ("hpu", "cpu")
_FORWARD = ("PT_HPU_", "PT_ENABLE_", "HABANA_", "HCCL_", "DIST_GLM5_")


def device(environ: MutableMapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    d = environ.get(DEVICE_ENV, "hpu")
    if d not in DEVICES:
        raise ValueError(
            f"{DEVICE_ENV}={d!r}: use one of {', '.join(DEVICES)} (unset it on a Gaudi node)"
        )
    return d


def forwarded(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The bridge's and this backend's variables set here (by the user, or by apply_defaults):
    Ray starts workers on other nodes without this process's environment."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(_FORWARD)}
