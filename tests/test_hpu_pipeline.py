"""The whole engine on `--backend hpu`, on the recording fake: the workers build their stage on the
backend (its ops, its device, HCCL between stages, steps padded to buckets, warm-up at start,
the device RoPE table), serve a short greedy generation of the MXFP4 test model and give the CPU
backend's tokens. The dispatch guard runs in every worker (DIST_GLM5_HPU_GUARD) and finds nothing
outside test_hpu_step.PENDING.

One stage in this process; as Ray actors over the fake "hccl" (registered on gloo), two stages
exchanging hidden states, and one stage of two TP/EP ranks. The fake keeps tensors on the CPU
(DIST_GLM5_HPU_DEVICE=cpu): device placement is exercised as calls, not as memory on a card.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import hpu_fake
import pytest
from runtime_util import prompts
from test_hpu_step import PENDING

from dist_glm5.engine.config import CacheConfig, EngineConfig, Layout, StageSpec
from dist_glm5.engine.coordinator import Coordinator
from dist_glm5.engine.scheduler import SchedulerConfig
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.sampling.params import SamplingParams

fake_hf = hpu_fake.fake_hf
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = prompts([5, 70, 40], seed=3)  # 70 > index_topk (64): the selection is exercised
# small tables (one step at most 48 + 3 tokens): 1, 2, 4 (decodes), 16, 32, 64, 96, 128
BUCKET_ENV = {
    "DIST_GLM5_DECODE_BS_BUCKET_MIN": "1",
    "DIST_GLM5_DECODE_BS_BUCKET_STEP": "4",
    "DIST_GLM5_DECODE_BS_BUCKET_MAX": "4",
    "DIST_GLM5_PROMPT_QUERY_BUCKET_MIN": "16",
    "DIST_GLM5_PROMPT_QUERY_BUCKET_STEP": "32",
    "DIST_GLM5_PROMPT_QUERY_BUCKET_MAX": "128",
    "DIST_GLM5_DECODE_CTX_BUCKET_MIN": "4",
    "DIST_GLM5_DECODE_CTX_BUCKET_STEP": "16",
    "DIST_GLM5_DECODE_CTX_BUCKET_MAX": "32",
}
TOKENS = (1, 2, 4, 16, 32, 64, 96, 128)
CTX_BLOCKS = (4, 8, 16, 32)  # context blocks of 16 tokens, up to the 512-token context
# warm-up: each token bucket at each context bucket that holds it (4 blocks hold 64 tokens)
WARM = [(t, c) for c in CTX_BLOCKS for t in TOKENS if t <= 16 * c]
# Gaudi's sparse forms; contexts above 32 keys take the windows' static unions
DSA = DSAConfig(
    mode="sparse",
    prefill_attention="windows",
    gather_cap_bytes=64 * 1024,
    dense_threshold=32,
    window=16,
    static_union=True,
)


@pytest.fixture(scope="module")
def mx_dir(default_model_dir, tmp_path_factory):
    from dist_glm5.convert.glm53 import convert_glm53

    d = tmp_path_factory.mktemp("mx_pipe")
    convert_glm53(default_model_dir, d)
    return d


def engine(model_dir, backend: str, stages: int = 1, mtp: bool = False, tp: int = 1):
    return EngineConfig(
        str(model_dir),
        Layout(stages, tp, tp),
        CacheConfig(48, 16),
        SchedulerConfig(chunk_tokens=48, step_tokens=128, max_model_len=512),
        DSA,
        mtp=mtp,
        backend=backend,
    )


def coordinator(eng: EngineConfig, pipe) -> Coordinator:
    cfg = ModelConfig.from_hf(eng.model_dir)
    return Coordinator(pipe, eng.scheduler, cfg.eos_token_id, cfg.vocab_size, step_timeout=300)


def generate_in_process(eng: EngineConfig) -> list[list[int]]:
    from dist_glm5.stages.inprocess_pipeline import InProcessPipeline

    c = coordinator(eng, InProcessPipeline(StageSpec(eng)))
    try:
        return [s.output for s in c.run(PROMPTS, GREEDY, arrivals=[0, 1, 2])]
    finally:
        c.close()


@pytest.fixture(scope="module")
def want(mx_dir):
    """The CPU backend's tokens (its packed MXFP4 kernel, torch.topk selection)."""
    return generate_in_process(engine(mx_dir, "cpu"))


def guard_steps(d: Path) -> dict[str, list[dict]]:
    return {
        p.stem: [json.loads(x) for x in p.read_text().splitlines()]
        for p in sorted(d.glob("guard-*.jsonl"))
    }


def check_guard(steps: list[dict]) -> None:
    """Every step padded to a token bucket, every sequence's context to a context bucket; no
    finding of the guard outside a PENDING file (and, with the static unions, none at all)."""
    assert steps and all(s["tokens"] in TOKENS for s in steps), [s["tokens"] for s in steps]
    keys = {n for s in steps for n in s["keys"]}
    assert keys <= {16 * b for b in CTX_BLOCKS}, keys
    assert all(s["ops"] > 0 for s in steps)  # the guard saw the step's ops
    found = collections.Counter(
        (v["kind"], v["where"].split(":")[0]) for s in steps for v in s["violations"]
    )
    assert {w for _, w in found} <= set(PENDING), found
    assert not found, found


@pytest.mark.parametrize("mtp", [False, True])
def test_one_stage_in_process(fake_hf, mx_dir, want, monkeypatch, tmp_path, mtp):
    """With MTP the greedy tokens are the same (drafts verified on the last stage); the MTP
    layer's own rows are not padded (not bucketed yet)."""
    for k, v in {
        **BUCKET_ENV,
        "DIST_GLM5_HPU_DEVICE": "cpu",
        "DIST_GLM5_HPU_GUARD": str(tmp_path),
    }.items():
        monkeypatch.setenv(k, v)
    from dist_glm5.backends.hpu.norm_rope import DeviceRopeTable
    from dist_glm5.backends.hpu.stage import HpuStage
    from dist_glm5.stages.inprocess_pipeline import InProcessPipeline

    eng = engine(mx_dir, "hpu", mtp=mtp)
    pipe = InProcessPipeline(StageSpec(eng))
    w = pipe.worker
    assert isinstance(w.rt, HpuStage) and w.model.ops.name == "hpu"
    assert isinstance(w.model.rope, DeviceRopeTable)
    assert w.rt.tokens == TOKENS and w.rt.ctx == CTX_BLOCKS and w.rt.warm_buckets() == WARM
    # warm-up: each bucket once, compile-only, then mark_step + synchronize; the cache is left
    # zeroed and without the warm-up's table
    warm = [a for a, _ in fake_hf.calls("bridge_config.env_setting.enter")]
    assert warm == [("PT_COMPILE_ONLY_MODE", True)] * len(WARM) and len(WARM) == 30
    assert len(fake_hf.calls("hpu.synchronize")) == len(WARM)
    assert all(not t.any() for t in w.cache.kv.values()) and set(w.cache.tables) == {-1}
    fake_hf.reset()
    c = coordinator(eng, pipe)
    try:
        got = [s.output for s in c.run(PROMPTS, GREEDY, arrivals=[0, 1, 2])]
    finally:
        c.close()
    assert got == want
    # every native MoE call is sized by the token table; one mark_step per layer per step
    moe = {a[0].shape[0] for a, _ in fake_hf.calls("moe.mxfp4_fused_weights")}
    assert moe and moe <= set(TOKENS), moe
    (steps,) = guard_steps(tmp_path).values()
    check_guard(steps)
    # one mark_step per decoder layer (and MTP layer) per forward
    marks = len(fake_hf.calls("core.mark_step"))
    per = {"layers": len(w.model.layer_range), "mtp": 1}
    assert marks == sum(per[s["what"]] for s in steps)
    assert any(s["what"] == "mtp" for s in steps) == mtp
    if mtp:
        assert c.stats.acceptance is not None


@pytest.mark.parametrize("stages,tp", [(2, 1), (1, 2)])
def test_ray_workers_over_fake_hccl(mx_dir, want, monkeypatch, tmp_path, stages, tp):
    """Two stages (hidden states over HcclComm) or one stage of two TP/EP ranks (all-reduces,
    the indexer rows' packed masks, native MoE calls on each rank's expert range). Ray actors
    inherit this environment (a fresh local cluster is started here): the fake on their path,
    its device, the guard's and the fake's log directories."""
    import ray  # a core dependency: missing is a failure

    from dist_glm5.stages.ray_pipeline import RayPipeline

    if ray.is_initialized():
        ray.shutdown()
    (tmp_path / "fake").mkdir()
    path = os.pathsep.join(p for p in (hpu_fake.FAKE, os.environ.get("PYTHONPATH")) if p)
    env = {
        **BUCKET_ENV,
        "PYTHONPATH": path,
        "DIST_GLM5_HPU_DEVICE": "cpu",
        "DIST_GLM5_HPU_GUARD": str(tmp_path),
        "FAKE_HABANA_LOG": str(tmp_path / "fake"),
        "PT_HPU_LAZY_MODE": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    eng = engine(mx_dir, "hpu", stages=stages, tp=tp)
    try:
        c = coordinator(eng, RayPipeline(eng, startup_timeout=600))
        try:
            got = [s.output for s in c.run(PROMPTS, GREEDY, arrivals=[0, 1, 2])]
        finally:
            c.close()
    finally:
        ray.shutdown()
    assert got == want
    guards = guard_steps(tmp_path)
    assert set(guards) == {f"guard-s{s}-r{r}" for s in range(stages) for r in range(tp)}
    for steps in guards.values():
        check_guard(steps)
    # the same padded steps on every worker (both sides of the link, every rank)
    tokens = {tuple(s["tokens"] for s in steps) for steps in guards.values()}
    assert len(tokens) == 1
    # what the fake saw inside the two worker processes
    logs = [
        [json.loads(x) for x in p.read_text().splitlines()]
        for p in (tmp_path / "fake").glob("*.jsonl")
    ]
    workers = [g for g in logs if any(e["name"] == "hccl.process_group" for e in g)]
    assert len(workers) == 2  # both workers opened "hccl" process groups
    for g in workers:
        names = [e["name"] for e in g]
        assert names.count("bridge_config.env_setting.enter") == len(WARM)  # warm-up
        assert names.index("hccl.process_group") < names.index("bridge_config.env_setting.enter")
        moe = {e["shapes"][0][0] for e in g if e["name"] == "moe.mxfp4_fused_weights"}
        assert moe and moe <= set(TOKENS)
