"""The recording fake habana_frameworks (tests/fake_habana), on sys.path only while a test of the
hpu backend runs: the `fake_hf` fixture installs it and removes it (and its modules) afterwards, so
no other test sees a Gaudi stack."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FAKE = str(Path(__file__).parent / "fake_habana")


def install():
    if FAKE not in sys.path:
        sys.path.insert(0, FAKE)
    from dist_glm5.backends.hpu import _hf

    _hf.core()  # through the backend's one importer, as the runtime loads it; registers the ops
    fake = sys.modules["habana_frameworks"]
    fake.reset()
    return fake


def uninstall() -> None:
    while FAKE in sys.path:
        sys.path.remove(FAKE)
    for name in [n for n in sys.modules if n.split(".")[0] == "habana_frameworks"]:
        del sys.modules[name]


@pytest.fixture
def fake_hf(monkeypatch):
    """The fake, lazy mode unless a test sets PT_HPU_LAZY_MODE; env changes are undone."""
    for k in ("PT_HPU_LAZY_MODE", "PT_HPU_ENABLE_LAZY_COLLECTIVES", "DIST_GLM5_HPU_SOFTMAX"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    hf = install()
    yield hf
    uninstall()
