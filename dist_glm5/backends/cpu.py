"""CPU backend: the reference. Plain torch, gloo between processes."""

from . import Backend


def load() -> Backend:
    return Backend(name="cpu", device="cpu", dist_backend="gloo")
