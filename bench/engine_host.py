"""`bench engine-host`: host time of one decode step against context (2K, 32K, 128K, 637K), four
sequences in one step, no model forward.

What is timed is the host work around the forward that runs on every step, through the real
objects: `Coordinator.step()` (the scheduler's plan: admission, block growth, room checks; the
result: `Scheduler.on_result`, the incremental detokenizer, stop checks), the plan and the result
through msgpack as the Ray pipeline carries them (an in-process pipeline skips this), and the
worker's metadata (the plan's blocks appended to the block tables, `PagedKVCache.prepare`:
positions, write slots, block-table views, attention groups; the first stage's input ids).

The worker is `HostOnlyWorker`: the stage worker without the model. It does the worker's per-step
host work and answers each sampling sequence with one fixed printable token. Its cache keeps the
block tables but no storage: `prepare` never reads storage. The sequences reach their context the
real way: added to the coordinator, prefilled by plans in chunks (host work only), then decoded;
the timed steps cross block boundaries (a block every 64 tokens) as real decoding does.

Not timed: the forward itself, whose sparse attention still scores every key with the indexer
(O(context) compute, not metadata). One micro-batch, so one step plans all four sequences.
Goal (issue 12): flat, 637K within 1.2x of 2K. Before block tables, `prepare` alone took 1.2 ms
(2K), 14 ms (128K) and ~0.1 s (637K) for four sequences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CONTEXTS = ["2k", "32k", "128k", "637k"]
FIRST_TOKEN = ord("a")  # HostOnlyWorker answers letters a..z by position (one byte token each)


class HostOnlyWorker:
    """A stage worker without the model: release and preempt, the plan's blocks into the block
    tables, `PagedKVCache.prepare`, the input ids; then, after `delay_s` (a stand-in for the
    forward: sleeping costs no CPU), one token per sampling sequence."""

    delay_s = 0.0

    def __init__(self, spec):
        from dist_glm5.model.config import ModelConfig
        from dist_glm5.model.kv_cache import PagedKVCache

        e = spec.engine
        self.spec = spec
        cfg = ModelConfig.from_hf(e.model_dir)
        # no layers: storage is never read by the metadata path
        self.cache = PagedKVCache(cfg, [], e.cache.blocks, e.cache.block_size, allocate=False)

    def step(self, plan):
        import torch

        from dist_glm5.engine.messages import SeqOutput, StageTime, StepResult
        from dist_glm5.model.kv_cache import Chunk

        for sid in [*plan.release, *plan.preempted]:
            self.cache.release(sid)
        for w in plan.work:
            self.cache.assign(w.seq_id, w.blocks)
        if not plan.work:
            return StepResult(plan.step, [], [StageTime(0, 0, 0.0)])
        self.cache.prepare([Chunk(w.seq_id, w.start, len(w.tokens)) for w in plan.work])
        torch.tensor([t for w in plan.work for t in w.tokens], dtype=torch.int64)
        if self.delay_s:
            time.sleep(self.delay_s)
        outputs = [
            SeqOutput(w.seq_id, [FIRST_TOKEN + (w.start + len(w.tokens)) % 26] if w.sample else [])
            for w in plan.work
        ]
        return StepResult(plan.step, outputs, [StageTime(0, 0, self.delay_s)])


class WirePipeline:
    """One HostOnlyWorker in this process, the plan and the result through msgpack on the way (as
    the Ray pipeline sends them); `parts` accumulates seconds on the wire and in the worker."""

    def __init__(self, spec):
        self.spec = spec
        self.worker = HostOnlyWorker(spec)
        self.results: list = []
        self.parts = {"wire": 0.0, "worker": 0.0}

    @property
    def cache(self):
        return self.spec.engine.cache

    def send(self, plan) -> None:
        from dist_glm5.engine.messages import pack, unpack

        t0 = time.perf_counter()
        plan = unpack(pack(plan))
        t1 = time.perf_counter()
        res = self.worker.step(plan)
        t2 = time.perf_counter()
        self.results.append(unpack(pack(res)))
        t3 = time.perf_counter()
        self.parts["wire"] += (t1 - t0) + (t3 - t2)
        self.parts["worker"] += t2 - t1

    def recv(self, timeout: float):
        return self.results.pop(0)

    def restart(self) -> None:
        self.worker, self.results = HostOnlyWorker(self.spec), []

    def close(self) -> None:
        pass


def _timed(fn, parts: dict, key: str):
    def wrapped(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            parts[key] += time.perf_counter() - t

    return wrapped


class Decoding:
    """`seqs` sequences decoding at `context` through a coordinator over a WirePipeline: set up
    (added, prefilled), then `steps(n)` times n decode steps and their parts."""

    def __init__(self, model_dir, context: int, seqs: int, max_steps: int):
        from dist_glm5.checkpoint.tokenizer import load_tokenizer
        from dist_glm5.engine.config import CacheConfig, EngineConfig, StageSpec
        from dist_glm5.engine.coordinator import Coordinator
        from dist_glm5.engine.scheduler import SchedulerConfig
        from dist_glm5.model.config import ModelConfig
        from dist_glm5.sampling.params import SamplingParams

        cfg = ModelConfig.from_hf(model_dir)
        chunk = 16384  # prefill in few plans (host work only); decodes take one token regardless
        total = context + max_steps + 2
        cache = CacheConfig(seqs * (-(-total // 64) + 1) + 8, 64)
        sched = SchedulerConfig(
            max_seqs=seqs, chunk_tokens=chunk, step_tokens=seqs * chunk, microbatches=1
        )
        engine = EngineConfig(str(model_dir), cache=cache, scheduler=sched)
        self.pipe = WirePipeline(StageSpec(engine))
        tok = load_tokenizer(model_dir)
        self.c = c = Coordinator(self.pipe, sched, cfg.eos_token_id, cfg.vocab_size, tok)
        self.context, self.max_steps = context, max_steps
        params = SamplingParams(max_tokens=max_steps + 2, ignore_eos=True)
        prompt = [FIRST_TOKEN] * (context - 1)  # the first decode step runs at `context` positions
        self.seqs = [c.add(list(prompt), params) for _ in range(seqs)]
        while any(s.prefilling or not s.output for s in self.seqs):
            c.step()
        self.parts = self.pipe.parts
        self.parts.update(plan=0.0, result=0.0)
        c.scheduler.next_plan = _timed(c.scheduler.next_plan, self.parts, "plan")
        c.scheduler.on_result = _timed(c.scheduler.on_result, self.parts, "result")
        self.done = 0

    def steps(self, n: int) -> list[dict]:
        """n decode steps: seconds of each (wall, this thread's CPU) and of its parts."""
        if self.done + n > self.max_steps:
            raise ValueError(f"{self.done + n} steps asked of a run set up for {self.max_steps}")
        rows, parts, c = [], self.parts, self.c
        for _ in range(n):
            for k in parts:
                parts[k] = 0.0
            t, cpu = time.perf_counter(), time.thread_time()
            c.step()
            rows.append({"step": time.perf_counter() - t, "cpu": time.thread_time() - cpu, **parts})
        self.done += n
        if any(s.finished or s.prefilling for s in self.seqs):
            raise RuntimeError("a sequence stopped decoding during the measurement")
        return rows

    def close(self) -> None:
        self.c.close()


def summary(context: int, seqs: int, rows: list[dict]) -> dict:
    med = {k: 1e3 * statistics.median(r[k] for r in rows) for k in rows[0]}
    wall = sorted(1e3 * r["step"] for r in rows)
    return {
        "context": context,
        "sequences": seqs,
        "steps": len(rows),
        "step_ms": med["step"],
        "step_p90_ms": wall[int(0.9 * (len(wall) - 1))],
        "step_cpu_ms": med["cpu"],
        "plan_ms": med["plan"],
        "wire_ms": med["wire"],
        "worker_ms": med["worker"],
        "result_ms": med["result"],
    }


def measure(
    model_dir, contexts: list[int], seqs: int = 4, steps: int = 200, rounds: int = 10
) -> list[dict]:
    """Per context, the median host time of one decode step (ms) and its parts. The contexts
    take turns (`rounds` rounds of steps/rounds steps each, after a warm-up), so a change in the
    machine's load falls on all of them alike."""
    warmup = 20
    runs = [Decoding(model_dir, ctx, seqs, warmup + steps) for ctx in contexts]
    rows: list[list[dict]] = [[] for _ in runs]
    try:
        for r in runs:
            r.steps(warmup)
        for i in range(rounds):
            n = steps // rounds + (i < steps % rounds)
            for r, out in zip(runs, rows):
                out += r.steps(n)
    finally:
        for r in runs:
            r.close()
    return [summary(ctx, seqs, out) for ctx, out in zip(contexts, rows)]


def register(p: argparse.ArgumentParser) -> None:
    from dist_glm5.engine.config import parse_ctx

    p.add_argument(
        "--contexts",
        type=parse_ctx,
        nargs="+",
        default=[parse_ctx(c) for c in CONTEXTS],
        help="contexts to decode at (tokens, or 2k 637k)",
    )
    p.add_argument("--seqs", type=int, default=4, help="sequences decoding in the step")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per context")
    p.add_argument("--model", help="checkpoint (for its config and tokenizer; default: embedded)")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dist_glm5.checkpoint.default_model import ensure_default_model

    d = Path(args.model) if args.model else ensure_default_model()
    print(
        f"host time of one decode step, {args.seqs} sequences, no forward (median of {args.steps} "
        "steps; contexts in turn): step = plan + wire (msgpack) + worker metadata + result + "
        "coordinator",
        flush=True,
    )
    rows = measure(d, args.contexts, args.seqs, args.steps)
    for r in rows:
        r["x_first"] = r["step_ms"] / rows[0]["step_ms"]
        print(
            f"  {r['context']:>7} tokens: step {r['step_ms']:.3f} ms (p90 {r['step_p90_ms']:.3f}, "
            f"CPU {r['step_cpu_ms']:.3f}; {r['x_first']:.2f}x of {rows[0]['context']}) = plan "
            f"{r['plan_ms']:.3f} + wire {r['wire_ms']:.3f} + worker {r['worker_ms']:.3f} + result "
            f"{r['result_ms']:.3f} ms"
        )
    ratio = rows[-1]["step_ms"] / rows[0]["step_ms"]
    cpu_ratio = rows[-1]["step_cpu_ms"] / rows[0]["step_cpu_ms"]
    verdict = "flat" if ratio <= 1.2 else "NOT flat"
    print(
        f"{rows[-1]['context']} / {rows[0]['context']}: {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU "
        f"(goal <= 1.2x: {verdict})"
    )
    if args.output:
        Path(args.output).write_text(
            json.dumps({"rows": rows, "ratio": ratio, "cpu_ratio": cpu_ratio}, indent=1)
        )
    return 0
