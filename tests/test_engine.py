"""The engine owns its cache and its requests (in process, the embedded model): admission against
the block ledger, preemption with recompute, abort, one failure path, per-request failures,
O(batch) step metadata, bounded metrics, the sparse DSA path by default."""

from __future__ import annotations

import gc
import queue
import time
import weakref

import pytest
from runtime_util import coordinator, prompts

from dist_glm5.backends import get_backend
from dist_glm5.engine.config import CacheConfig
from dist_glm5.model.kv_cache import Chunk, PagedKVCache
from dist_glm5.model.reference_loop import generate
from dist_glm5.sampling.params import SamplingParams
from dist_glm5.stages.worker import StageWorker

SMALL = CacheConfig(blocks=8, block_size=16)  # 128 tokens
LENGTHS = [5, 40, 70, 20, 33, 90, 12, 50]
MAX_TOKENS = [20, 10, 30, 16, 8, 24, 40, 12]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(default_model):
    """Each request run alone through the single-process loop."""
    ps = prompts(LENGTHS, seed=11)
    return ps, [
        generate(default_model, [p], greedy(n))[0].token_ids for p, n in zip(ps, MAX_TOKENS)
    ]


def _ledger_full(c) -> bool:
    bm = c.scheduler.block_manager
    return bm.num_free == bm.num_blocks and not bm.tables


@pytest.mark.parametrize("mtp", [False, True])
def test_more_requests_than_the_cache_holds_all_complete_as_if_alone(default_model_dir, alone, mtp):
    ps, want = alone
    assert sum(LENGTHS) + sum(MAX_TOKENS) >= 3 * SMALL.tokens
    c = coordinator(default_model_dir, mtp=mtp, cache=SMALL, chunk_tokens=32)
    out = c.run(ps, [greedy(n) for n in MAX_TOKENS], arrivals=[0, 0, 1, 1, 2, 3, 5, 8])
    assert [s.finish_reason for s in out] == ["length"] * len(ps), [s.error for s in out]
    assert [s.output for s in out] == want
    assert c.scheduler.num_preemptions > 0 and any(s.preemptions for s in out)
    assert c.stats.restarts == 0
    assert _ledger_full(c)
    w = c.pipeline.worker
    assert not w.cache.tables and not w.seqs  # every stage dropped every request


def test_a_request_that_can_never_fit_is_refused_at_admission(default_model_dir):
    c = coordinator(default_model_dir, cache=SMALL)
    with pytest.raises(ValueError, match=r"maximum context length is 128 tokens.*needs 130"):
        c.add(list(range(100)), greedy(30))
    c = coordinator(default_model_dir, cache=SMALL, max_model_len=64)
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens"):
        c.add(list(range(60)), greedy(8))
    assert not c.scheduler.has_work


def test_abort_frees_the_blocks_and_the_others_go_on(default_model_dir, alone):
    ps, want = alone
    c = coordinator(default_model_dir, cache=SMALL, chunk_tokens=32)
    seqs = [c.add(ps[i], greedy(MAX_TOKENS[i])) for i in (0, 1, 3)]
    while len(seqs[1].output) < 3:  # the victim is decoding, maybe with a chunk in flight
        c.step()
    victim = seqs[1]
    c.abort(victim)
    assert victim.finish_reason == "abort"
    assert victim.seq_id not in c.scheduler.block_manager.tables
    for _ in range(2):  # within two steps every stage has dropped it
        c.step()
    assert victim.seq_id not in c.pipeline.worker.cache.tables
    while c.has_work:
        c.step()
    assert [seqs[0].output, seqs[2].output] == [want[0], want[3]]
    assert _ledger_full(c) and not c.pipeline.worker.cache.tables


class FailsOnce(StageWorker):
    """Raises on its 4th step, once (the restarted worker behaves)."""

    failed = False

    def step(self, plan):
        self.n = getattr(self, "n", 0) + 1
        if self.n == 4 and not FailsOnce.failed:
            FailsOnce.failed = True
            raise RuntimeError("injected failure")
        return super().step(plan)


def test_a_step_failure_fails_only_started_requests_and_waiting_ones_complete(
    default_model_dir, alone
):
    ps, want = alone
    FailsOnce.failed = False
    c = coordinator(default_model_dir, worker_cls=FailsOnce, cache=SMALL, max_seqs=2)
    order = (0, 3, 4, 6)
    seqs = [c.add(ps[i], greedy(MAX_TOKENS[i])) for i in order]
    while c.has_work:
        c.step()
    assert FailsOnce.failed and c.stats.restarts == 1
    started, waiting = seqs[:2], seqs[2:]
    for s in started:  # raised from send(): InProcessPipeline runs the plan there
        assert s.finish_reason == "error" and "stage 0 rank 0" in s.error, s.error
        assert "injected failure" in s.error
    assert [s.output for s in waiting] == [want[i] for i in order[2:]]
    assert _ledger_full(c)


def test_a_request_that_fails_inside_the_engine_fails_alone(default_model_dir, alone):
    ps, want = alone
    c = coordinator(default_model_dir)
    bad = greedy(8)
    object.__setattr__(bad, "top_k", 2.5)  # slipped past validation
    object.__setattr__(bad, "temperature", 1.0)
    object.__setattr__(bad, "seed", 1)
    out = c.run([ps[0], ps[3], ps[4]], [greedy(MAX_TOKENS[0]), bad, greedy(MAX_TOKENS[4])])
    assert out[1].finish_reason == "error" and "sequence" in out[1].error, out[1].error
    assert [out[0].output, out[2].output] == [want[0], want[4]]
    assert c.stats.restarts == 0


def test_step_metadata_is_sized_by_the_batch_not_the_context(default_model_dir):
    from dist_glm5.model.config import ModelConfig

    cfg = ModelConfig.from_hf(default_model_dir)
    ctx, bs, B = 1 << 16, 64, 4
    cache = PagedKVCache(cfg, [0], B * (ctx // bs + 1), bs, allocate=False)
    for i in range(B):
        cache.assign(i, list(range(i * (ctx // bs + 1), (i + 1) * (ctx // bs + 1))))
    b = cache.prepare([Chunk(i, ctx, 1) for i in range(B)])
    sizes = [b.positions.numel(), b.write_slots.numel()]
    for g in b.groups:
        sizes += [g.tok.numel(), g.valid.numel(), g.q_pos.numel()]
        assert g._slots is None  # the per-key slot list exists only if the dense path asks
    assert max(sizes) <= B and all(len(k) == ctx + 1 for k in b.keys)
    with pytest.raises(ValueError, match="did not send its blocks"):
        cache.prepare([Chunk(B + 1, 0, 1)])


def test_every_command_runs_the_sparse_path_unless_told_dense(default_model_dir):
    import argparse

    from dist_glm5.launch.engine_args import add_layout_args, engine_config

    p = argparse.ArgumentParser()
    add_layout_args(p)
    assert engine_config(p.parse_args([]), default_model_dir).dsa.mode == "sparse"
    assert engine_config(p.parse_args(["--dsa", "dense"]), default_model_dir).dsa.mode == (
        "reference"
    )


# ---- the engine loop ----------------------------------------------------------------------
def _events(h, timeout=120.0):
    out, t0 = [], time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            ev = h.events.get(timeout=timeout)
        except queue.Empty:
            break
        out.append(ev)
        if ev[0] != "delta":
            return out
    raise AssertionError(f"no terminal event: {out}")


def test_engine_loop_streams_text_holds_stop_strings_and_aborts(default_model_dir, alone):
    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.engine.loop import EngineLoop

    ps, want = alone
    tok = load_tokenizer(default_model_dir)
    text = tok.decode(want[6])
    stop = text[20:23]
    loop = EngineLoop(coordinator(default_model_dir, cache=SMALL, chunk_tokens=32))
    try:
        long = loop.submit(ps[0], greedy(100))
        h = loop.submit(ps[6], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))
        evs = _events(h)
        kind, seq = evs[-1]
        assert kind == "done" and seq.finish_reason == "stop"
        streamed = "".join(d.text for k, d in evs if k == "delta")
        assert streamed == seq.text == text[: text.find(stop)]
        ids = [t for k, d in evs if k == "delta" for t in d.token_ids]
        assert ids[: len(seq.output)] == seq.output == want[6][: len(seq.output)]
        loop.abort(long.request_id)
        evs = _events(long)
        assert evs[-1][0] == "done" and evs[-1][1].finish_reason == "abort"
        assert len(evs[-1][1].output) < 100
        for _ in range(100):  # the next steps free it on every stage
            if _ledger_full(loop.c) and not loop.c.pipeline.worker.cache.tables:
                break
            time.sleep(0.05)
        assert _ledger_full(loop.c) and not loop.c.pipeline.worker.cache.tables
        m = loop.metrics_snapshot()
        assert m.finished["abort"] == 1 and m.finished["stop"] == 1 and m.ttft.count == 2
        assert loop.state.ok and loop.health().ok
        bad = loop.submit(list(range(120)), greedy(30))
        assert _events(bad)[-1][0] == "invalid"
    finally:
        loop.close()


def test_engine_memory_is_flat_over_many_requests(default_model_dir):
    from dist_glm5.engine.loop import EngineLoop

    loop = EngineLoop(coordinator(default_model_dir, cache=SMALL))
    c, w = loop.c, loop.c.pipeline.worker
    refs = []

    def wave(n):
        hs = [loop.submit([1 + i % 200, 2, 3], greedy(2)) for i in range(n)]
        for h in hs:
            assert _events(h)[-1][0] == "done"
            refs.append(weakref.ref(h.seq))

    def idle():
        for _ in range(200):
            if not c.has_work:
                return
            time.sleep(0.05)
        raise AssertionError("the engine never went idle")

    def sizes():
        s = c.scheduler
        m = loop.metrics_snapshot()
        return (
            len(loop.live),
            len(s.by_id),
            len(s.sent),
            len(s.running),
            len(s.waiting),
            len(s.block_manager.tables),
            len(w.seqs),
            len(w.cache.tables),
            len(c.step_events),
            len(m.ttft.counts),
            len(m.e2e.counts),
            len(m.finished),
            len(m.stage_busy_seconds),
        )

    try:
        wave(10)
        idle()  # the release of the last ones rides the next (empty) plan
        first, kinds = sizes(), len(c.scheduler.steps)
        wave(40)
        idle()
        assert sizes() == first and first[:8] == (0,) * 8
        assert len(c.scheduler.steps) <= 4096 and kinds > 0
        assert loop.metrics_snapshot().e2e.count == 50
        gc.collect()
        assert not [r for r in refs if r() is not None]  # nothing keeps a published Sequence
    finally:
        loop.close()


class NeverStarts(StageWorker):
    """Fails every step; and once restarted, cannot even load (the restart fails)."""

    built = 0

    def __init__(self, spec, comm=None):
        NeverStarts.built += 1
        if NeverStarts.built > 1:
            raise OSError("weights unreadable")
        super().__init__(spec, comm)

    def step(self, plan):
        raise RuntimeError("broken stage")


def test_engine_loop_reports_dead_when_it_cannot_restart(default_model_dir, monkeypatch):
    from dist_glm5.engine import loop as engine_loop
    from dist_glm5.engine.loop import EngineLoop

    monkeypatch.setattr(engine_loop, "RESTART_BACKOFF_S", 0.01)
    NeverStarts.built = 0
    loop = EngineLoop(coordinator(default_model_dir, worker_cls=NeverStarts))
    try:
        h = loop.submit([1, 2, 3], greedy(4))
        kind, msg = _events(h)[-1]
        assert kind == "error" and "broken stage" in msg
        for _ in range(100):
            if loop.state.status == "dead":
                break
            time.sleep(0.05)
        st = loop.state
        assert st.status == "dead" and "weights unreadable" in st.reason and not loop.health().ok
        kind, msg = _events(loop.submit([1, 2, 3], greedy(4)))[-1]
        assert kind == "error" and "dead" in msg
    finally:
        loop.close()


def test_sparse_is_bit_identical_through_the_block_tables(default_model_dir):
    """The scaled path over block tables (blocks of 16, so gathers by whole blocks and partial
    last blocks both run) gives the reference's tokens, prefill chunks and decode alike."""
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.dsa_config import DSAConfig

    m = load_model(
        default_model_dir,
        ops=get_backend("cpu").ops(),
        dsa=DSAConfig(mode="sparse", dense_threshold=0),
    )
    ref = load_model(default_model_dir, ops=get_backend("cpu").ops())
    ps = prompts([70, 150], seed=3)
    p = greedy(12)
    got = [g.token_ids for g in generate(m, ps, p, block_size=16)]
    assert got == [g.token_ids for g in generate(ref, ps, p, block_size=16)]
