"""HPU graphs and device synchronisation: recorded; the module runs as it is."""

from __future__ import annotations

from ... import record


def wrap_in_hpu_graph(
    module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None
):
    record(
        "hpu.wrap_in_hpu_graph",
        module,
        asynchronous=asynchronous,
        disable_tensor_cache=disable_tensor_cache,
        dry_run=dry_run,
        max_graphs=max_graphs,
    )
    return module


def synchronize() -> None:
    record("hpu.synchronize")


def is_available() -> bool:
    return True


def device_count() -> int:
    return 8
