"""The distributed runtime for real: Ray actors on a local two-node Ray cluster, zmq control,
torch.distributed (gloo) hidden states and all-reduces. Outputs must equal the single-process
generate() token for token."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from runtime_util import prompts, ray_nodes

from dist_glm5.backends import get_backend
from dist_glm5.engine.config import CacheConfig, EngineConfig, Layout
from dist_glm5.engine.coordinator import Coordinator
from dist_glm5.engine.scheduler import SchedulerConfig
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.model.reference_loop import generate
from dist_glm5.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = prompts([5, 70, 150, 33], seed=1)
ARRIVALS = [0, 1, 3, 6]


@pytest.fixture(scope="module")
def cluster():
    with ray_nodes(2, cpus_per_node=4) as c:
        yield c


@pytest.fixture(scope="module")
def want(default_model):
    return [g.token_ids for g in generate(default_model, PROMPTS, GREEDY)]


def serve(model_dir, stages, tp, ep, mtp=False, dsa=None, max_seqs=64, **kw):
    from dist_glm5.stages.ray_pipeline import RayPipeline

    cfg = ModelConfig.from_hf(model_dir)
    engine = EngineConfig(
        str(model_dir),
        Layout(stages, tp, ep),
        CacheConfig(64),
        SchedulerConfig(chunk_tokens=48, max_seqs=max_seqs),
        dsa or DSAConfig(),
        mtp=mtp,
        **kw,
    )
    return Coordinator(
        RayPipeline(engine), engine.scheduler, cfg.eos_token_id, cfg.vocab_size, step_timeout=120
    )


SPARSE = DSAConfig(mode="sparse", dense_threshold=0, window=16)


def served_outputs(model_dir, stages, tp, ep, **kw) -> list[list[int]]:
    """PROMPTS (arriving at ARRIVALS) through a fresh pipeline, which is closed afterwards."""
    c = serve(model_dir, stages, tp, ep, **kw)
    try:
        return [s.output for s in c.run(PROMPTS, GREEDY, arrivals=ARRIVALS)]
    finally:
        c.close()


@pytest.mark.parametrize(
    "stages,tp,ep,mtp,dsa",
    [
        (2, 1, 1, False, None),
        (1, 2, 2, False, None),
        (2, 2, 2, True, None),
        (2, 2, 1, False, None),
        (1, 2, 2, False, SPARSE),
        (2, 2, 2, True, SPARSE),
    ],
)
def test_layouts_equal_single_process(cluster, default_model_dir, want, stages, tp, ep, mtp, dsa):
    """Sparse DSA rows: the indexer's query rows are split over the 2 ranks, which exchange
    bit-packed selections; prompts of 70 and 150 tokens and the decodes after them exceed
    index_topk=64."""
    c = serve(default_model_dir, stages, tp, ep, mtp, dsa=dsa)
    try:
        if stages == 2:  # one stage per node
            assert len(set(c.pipeline.node_of_stage.values())) == 2
        out = c.run(PROMPTS, GREEDY, arrivals=ARRIVALS)
        assert [s.output for s in out] == want
        if mtp:
            assert c.stats.acceptance is not None
    finally:
        c.close()


def test_placement_on_two_ep_ranks_keeps_outputs(cluster, default_model_dir, want):
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.planning.expert_placement import RouteRecorder, attach, fit_placement

    m = load_model(default_model_dir, ops=get_backend("cpu").ops())
    rec = RouteRecorder(m.cfg.n_routed_experts)
    attach(m, rec)
    generate(m, PROMPTS, GREEDY)
    pl = fit_placement(rec.tensor(), 2, m.cfg)
    assert served_outputs(default_model_dir, 1, 2, 2, placement=pl) == want


def test_profile_two_stages_two_ranks(cluster, default_model_dir, tmp_path):
    import subprocess

    from test_profile import LAUNCH, check_profile

    r = subprocess.run(
        [
            *LAUNCH,
            "profile",
            "--stages",
            "2",
            "--tp",
            "2",
            "--ep",
            "2",
            "--address",
            cluster.address,
            "--ctx",
            "80",
            "--batch",
            "2",
            "--decode-steps",
            "4",
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    check_profile(tmp_path, 2, 2)
    a = json.loads((tmp_path / "anatomy.json").read_text())
    assert a["decode"]["0"]["transfer"] > 0 and a["decode"]["1"]["all_reduce"] > 0


def test_mxfp4_checkpoint_through_two_stages(cluster, default_model_dir, tmp_path):
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.convert.glm53 import convert_glm53
    from dist_glm5.convert.shard import shard_checkpoint

    mx = tmp_path / "mx"
    convert_glm53(default_model_dir, mx)
    sh = tmp_path / "sh"
    shard_checkpoint(mx, sh, stages=2, ep=2)
    # the workers run the packed-MXFP4 kernel; the oracle is the dequantise-then-GEMM reference
    from dist_glm5.ops import reference_ops

    want = [g.token_ids for g in generate(load_model(mx, ops=reference_ops()), PROMPTS, GREEDY)]
    assert served_outputs(sh, 2, 2, 2, mtp=True) == want


def test_a_stage_that_raises_fails_started_requests_naming_it_waiting_ones_complete(
    cluster, default_model_dir, want
):
    c = serve(default_model_dir, 2, 1, 1, max_seqs=1)  # one runs, the other waits
    try:
        # a block id beyond every worker's cache: the first request's plan makes them raise
        c.scheduler.block_manager.free.append(10**6)
        s, waiting = c.run(PROMPTS[:2], GREEDY)  # bounded by the coordinator's step timeout
        # both stages raise on the same plan; whichever reports first is named
        assert s.finish_reason == "error" and re.search(r"stage [01] rank 0", s.error), s.error
        assert "outside" in s.error and c.stats.restarts == 1
        assert waiting.output == want[1]  # queued through the restart, then served
    finally:
        c.close()


def test_a_stage_that_dies_fails_requests_naming_it_then_serves_again(
    cluster, default_model_dir, want
):
    c = serve(default_model_dir, 2, 1, 1)
    try:
        seqs = [c.add(p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in PROMPTS[:2]]
        c.step()
        os.kill(c.pipeline.pids[(1, 0)], signal.SIGKILL)
        steps = 0
        while not all(s.finished for s in seqs):
            c.step()  # each step is bounded by the coordinator's step timeout
            steps += 1
            assert steps <= 2 * c.sched_cfg.microbatches, (
                "the coordinator did not notice the dead stage"
            )
        assert all(s.finish_reason == "error" and "stage 1 rank 0" in s.error for s in seqs), [
            s.error for s in seqs
        ]
        assert [x.output for x in c.run(PROMPTS[:2], GREEDY)] == want[:2]
    finally:
        c.close()
