"""Helpers for runtime tests: a coordinator over an in-process pipeline on the embedded model."""

from __future__ import annotations

import contextlib
import time

import torch

from dist_glm5.checkpoint.default_model import TRAINED_DIR
from dist_glm5.checkpoint.tokenizer import load_tokenizer
from dist_glm5.engine.config import CacheConfig, EngineConfig, StageSpec
from dist_glm5.engine.coordinator import Coordinator
from dist_glm5.engine.scheduler import SchedulerConfig
from dist_glm5.model.config import ModelConfig
from dist_glm5.stages.inprocess_pipeline import InProcessPipeline


def wait_until(cond, timeout: float, what: str, every: float = 0.01):
    """Poll `cond()` until it is truthy and return it. `timeout` only keeps a test that would hang
    from hanging CI: past it the test errors naming `what`. It measures nothing (speed figures
    belong to bench/), so it is generous."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} (hang guard: still not so after {timeout} s)")
        time.sleep(every)
    return value


def require_trained_weights() -> None:
    """The trained weights ship in the package (pyproject package-data): missing is a failure,
    not a skip, so a package that lost them cannot pass."""
    assert (TRAINED_DIR / "model.safetensors").exists(), (
        f"no trained weights in {TRAINED_DIR}: the package data lost them (pyproject.toml)"
    )


@contextlib.contextmanager
def ray_nodes(nodes: int = 2, cpus_per_node: int = 4):
    """A local Ray cluster of `nodes` nodes, this process connected to it; torn down on exit."""
    import ray

    from dist_glm5.stages.ray_pipeline import local_cluster

    c = local_cluster(nodes, cpus_per_node=cpus_per_node)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def prompts(lengths, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def coordinator(
    model_dir, mtp=False, worker_cls=None, dtype=None, cache=None, **sched
) -> Coordinator:
    cfg = ModelConfig.from_hf(model_dir)
    engine = EngineConfig(
        str(model_dir),
        cache=cache or CacheConfig(128),
        scheduler=SchedulerConfig(**{"chunk_tokens": 64, **sched}),
        mtp=mtp,
        dtype=dtype,
    )
    pipe = InProcessPipeline(StageSpec(engine), worker_cls)
    return Coordinator(
        pipe, engine.scheduler, cfg.eos_token_id, cfg.vocab_size, load_tokenizer(model_dir)
    )
