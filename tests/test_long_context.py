"""A 64K-token prompt end to end through two pipeline stages on the embedded model (sparse DSA),
within the memory the planner predicts for each worker. Slow by nature (the DSA indexer scores every
earlier key for every prompt token: ~2 x 10^12 flops here): a few minutes on two cores."""

from __future__ import annotations

import pytest
import torch

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa import DSAConfig
from dist_glm5.planning.partition import partition_layers
from dist_glm5.planning.worker_memory import worker_memory
from dist_glm5.sampling.params import SamplingParams
from dist_glm5.stages.coordinator import Coordinator
from dist_glm5.stages.scheduler import SchedulerConfig
from dist_glm5.stages.engine_config import CacheConfig, EngineConfig, Layout

ray = pytest.importorskip("ray")
CONTEXT = 65536
CHUNK = 1024


def test_64k_prompt_through_two_stages_within_planned_memory(default_model_dir):
    from dist_glm5.stages.ray_pipeline import RayPipeline, local_cluster

    cfg = ModelConfig.from_hf(default_model_dir)
    dsa = DSAConfig(mode="sparse", dense_threshold=4096)
    blocks = CONTEXT // 64 + 4
    cluster = local_cluster(2, cpus_per_node=2)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        engine = EngineConfig(str(default_model_dir), Layout(stages=2), CacheConfig(blocks),
                              SchedulerConfig(chunk_tokens=CHUNK, max_model_len=blocks * 64), dsa)
        pipe = RayPipeline(engine)
        c = Coordinator(pipe, engine.scheduler, cfg.eos_token_id, cfg.vocab_size, step_timeout=1800)
        ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
        s = c.run([ids], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert s.finish_reason == "length" and len(s.output) == 4, s.error
        measured = {0: max(t.peak_rss_mb for t in pipe.timings), 1: c.stats.peak_rss_mb}
        c.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    ranges = partition_layers(cfg, 2)
    for stage, rss in measured.items():
        plan = worker_memory(cfg, ranges[stage], stage == 0, stage == 1, mtp=False, cache_tokens=blocks * 64,
                             chunk_tokens=CHUNK, context=CONTEXT, dtype_bytes=4, dsa=dsa)
        assert 0 < rss * 2**20 <= plan.total, (stage, rss, plan)
