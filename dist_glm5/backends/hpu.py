"""Gaudi backend. The only module that may import habana_frameworks, and only inside load()."""

from . import Backend


def load() -> Backend:
    try:
        import habana_frameworks.torch.core  # noqa: F401  (registers the 'hpu' device with torch)
    except ImportError as e:
        raise RuntimeError(
            "backend 'hpu' needs the Gaudi software stack (habana_frameworks), which is not "
            "installed here: run on a Gaudi image whose torch build ships it, or choose --backend "
            "cpu"
        ) from e
    # Until the native ops are wired (the [hpu] issue), the plain references: bisection top-k is
    # already Gaudi's choice (no sort).
    from dist_glm5.ops import reference_ops

    return Backend(name="hpu", device="hpu", dist_backend="hccl", ops=reference_ops)
