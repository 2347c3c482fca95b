"""`launch batch --input prompts.jsonl --output results.jsonl`: a long-context batch job.

Each input line is a JSON object with "prompt" (text) or "prompt_ids" (token ids), an optional "id"
(default: the line number) and optional sampling fields (max_tokens, temperature, ...). Exactly one
result line per prompt is appended to the output as it finishes, flushed and fsynced; a rerun skips
ids already in the output, so a job killed halfway completes without duplicates. A prompt that
fails gets its line too, with the error. Ctrl-C stops cleanly: the step under way finishes, its
results are written whole, the pipeline is closed and the job exits with 130; rerun to resume.

The context is `--ctx` (as the serving commands), else the longest job's prompt + max_tokens; the
cache is sized from it. A job longer than `--ctx` is refused before anything loads, naming the
`--ctx` that fits it. The planner's memory per stage at that context (computed) is logged before
the run, and a plan that does not fit this machine is refused. While a long prompt prefills, a
progress line (chunks, tokens/s, ETA) is logged every `--progress-interval` seconds; each result
line carries its timing (queue, time to first token, prefill tokens/s) and the peak RSS of every
stage's worker so far (MiB, measured by the workers).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from dist_glm5.engine.config import parse_ctx

from .engine_args import add_layout_args, build_engine, dsa_config, engine_config, model_dir

log = logging.getLogger(__name__)
FIELDS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "min_tokens",
    "bad_words",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
}


def register(p: argparse.ArgumentParser) -> None:
    add_layout_args(p)
    p.add_argument("--input", required=True, help="prompts, one JSON object per line")
    p.add_argument("--output", required=True, help="results, appended one JSON line per prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="default for lines that do not say")
    p.add_argument(
        "--ctx",
        type=parse_ctx,
        default=None,
        help="context length per sequence (131072, 128k, 637k); sizes the cache (default: the "
        "longest job's prompt + max_tokens)",
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        help="seconds between progress lines while a prompt prefills (default: 10)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="log the memory plan for the jobs and exit"
    )
    # the sparse path is the default now (--dsa dense for the reference); kept for old scripts
    p.add_argument("--sparse", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def read_jobs(path: Path, tok) -> list[dict]:
    jobs, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        jid = str(obj.get("id", n))
        if jid in seen:
            raise ValueError(f"{path}:{n}: id {jid!r} appears twice; ids must be unique")
        seen.add(jid)
        jobs.append({"id": jid, "line": n, **obj})
    return jobs


def done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    ids = set()
    lines = path.read_bytes().split(b"\n")
    for raw in lines:
        if not raw.strip():
            continue
        try:
            ids.add(str(json.loads(raw)["id"]))
        except (json.JSONDecodeError, KeyError):
            continue  # a torn last line from a kill: that prompt runs again
    return ids


def run(args: argparse.Namespace) -> int:
    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.model.config import ModelConfig

    _show_progress()
    d = model_dir(args)
    cfg = ModelConfig.from_hf(d)
    tok = load_tokenizer(d)
    out_path = Path(args.output)
    jobs = read_jobs(Path(args.input), tok)
    finished = done_ids(out_path)
    todo = [j for j in jobs if j["id"] not in finished]
    log.info(
        "%d prompts, %d already answered, %d to run", len(jobs), len(jobs) - len(todo), len(todo)
    )
    # every prompt tokenised before anything loads: its length sizes the cache, and a job that
    # cannot fit is refused now rather than after minutes of loading
    prepared = [_prepare(j, tok, args) for j in todo]
    ctx = context_for(args, cfg, [p for p in prepared if p[1] is not None])
    blocks = cache_blocks_for(args, ctx)
    verdict = memory_plan(args, cfg, ctx, blocks)
    log.info("%s", verdict.text)
    verdict.check()  # raises naming what would fit
    if args.dry_run:
        return 0
    engine = build_engine(engine_config(args, d, max_model_len=ctx, cache_blocks=blocks))
    progress = Progress(args.progress_interval, args.chunk_tokens)
    pending: dict[int, dict] = {}
    with Interrupt() as interrupted:
        try:
            with Results(out_path, len(jobs), len(jobs) - len(todo)) as write:
                for j, ids, params, error in prepared:
                    try:
                        if error is not None:
                            raise ValueError(error)
                        seq = engine.add(ids, params)
                        pending[seq.seq_id] = j
                        progress.added(seq)
                    except (ValueError, TypeError) as e:
                        write({"id": j["id"], "error": str(e)})
                while pending and not interrupted.is_set():
                    _step(engine, pending, progress, tok is not None, write)
        except KeyboardInterrupt:
            interrupted.set()
        finally:
            engine.close()
    if interrupted.is_set():
        log.warning(
            "stopped with %d of %d prompts unanswered; rerun the same command to resume "
            "(answered ids are skipped)",
            len(pending),
            len(jobs),
        )
        return 130
    return 0


def _step(engine, pending: dict[int, dict], progress: "Progress", text: bool, write) -> None:
    """One engine step; each finished job's result (with its timing) written. Results are written
    between steps: an interrupt never tears a line."""
    done = engine.step()
    progress.stepped([s for s in engine.scheduler.running if s.seq_id in pending], done)
    for seq in done:
        j = pending.pop(seq.seq_id, None)
        if j is not None:
            r = _result(j, seq, text)
            if "error" not in r:
                r["timing"] = progress.record(seq, stage_peaks(engine))
                log.info("job %s: %s", j["id"], _summary(r["timing"]))
            write(r)


class Interrupt:
    """Ctrl-C while a job runs: the first one lets the current step finish and stops after it
    (the event is set); a second one stops at once (KeyboardInterrupt)."""

    def __enter__(self) -> threading.Event:
        self.event = threading.Event()
        self.old = signal.signal(signal.SIGINT, self._on_sigint)
        return self.event

    def _on_sigint(self, *_):
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()
        log.warning("interrupted: finishing the current step, then stopping (Ctrl-C again: now)")

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.old)


class Results:
    """The output file, one JSON line per answered job, each flushed and fsynced (a rerun skips
    the ids it holds), with a progress bar over the jobs (none when stderr is not a terminal: the
    progress lines say it all)."""

    def __init__(self, path: Path, total: int, done: int):
        self.path, self.written = path, 0
        data = path.read_bytes() if path.exists() else b""
        if data and not data.endswith(b"\n"):  # a torn line from a kill: close it
            with open(path, "ab") as f:
                f.write(b"\n")
        self.bar = tqdm(total=total, initial=done, desc="batch", unit="prompt", disable=None)
        # Fault injection for the resume tests: right after this many result lines, send this
        # process a signal (KILL by default; "3:INT" for Ctrl-C), a deterministic point (polling
        # the file from outside races the job's end).
        when, _, sig = os.environ.get("DIST_GLM5_BATCH_KILL_AFTER", "0").partition(":")
        self.kill_after, self.kill_sig = int(when), getattr(signal, f"SIG{sig or 'KILL'}")

    def __enter__(self):
        self.file = open(self.path, "a")
        self.redirect = logging_redirect_tqdm()
        self.redirect.__enter__()
        return self.write

    def write(self, obj: dict) -> None:
        self.file.write(json.dumps(obj) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.bar.update()
        self.written += 1
        if self.written == self.kill_after:
            os.kill(os.getpid(), self.kill_sig)

    def __exit__(self, *exc) -> None:
        self.redirect.__exit__(*exc)
        self.file.close()
        self.bar.close()


def _show_progress() -> None:
    """Progress and the plan are INFO lines a user of a long job needs to see: shown at the
    default --log-level (WARNING), hidden only when a quieter level was asked for."""
    if logging.getLogger().getEffectiveLevel() <= logging.WARNING:
        log.setLevel(min(log.getEffectiveLevel(), logging.INFO))


def _prepare(j: dict, tok, args: argparse.Namespace):
    """(job, prompt ids, sampling params, None), or (job, None, None, why it cannot run)."""
    try:
        return j, _prompt_ids(j, tok), _params(j, args), None
    except (ValueError, TypeError) as e:
        return j, None, None, str(e)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def cache_blocks_for(args: argparse.Namespace, ctx: int) -> int:
    """One sequence of `ctx` (and a chunk past it) fits; never fewer than --cache-blocks, so
    short jobs still run side by side."""
    return max(args.cache_blocks, -(-(ctx + args.chunk_tokens) // args.block_size))


def context_for(args: argparse.Namespace, cfg, prepared: list) -> int:
    """The context every sequence gets: --ctx, else the longest job's prompt + max_tokens (whole
    blocks). ValueError naming the job and the --ctx that fits it when --ctx is too short."""
    need = [(len(ids) + max(p.max_tokens, 1), j, ids, p) for j, ids, p, _ in prepared]
    longest = max(need, key=lambda x: x[0], default=None)
    if args.ctx is not None:
        ctx = args.ctx
        if longest is not None and longest[0] > ctx:
            n, j, ids, p = longest
            raise ValueError(
                f"job {j['id']!r} (line {j['line']}) needs {n} tokens ({len(ids)} prompt + "
                f"max_tokens {p.max_tokens}), more than --ctx {_k(ctx)} ({ctx} tokens): rerun "
                f"with --ctx {-(-n // 1024)}k, or without --ctx (the cache is then sized from "
                "the longest job)"
            )
    else:
        ctx = -(-(longest[0] if longest else 1) // args.block_size) * args.block_size
    if ctx > cfg.max_position_embeddings:
        raise ValueError(
            f"context {ctx} tokens is beyond this model's {cfg.max_position_embeddings} "
            "(max_position_embeddings): lower --ctx, or shorten the longest prompt"
        )
    return ctx


MIB = 1 << 20


class MemoryPlan:
    """The planner's memory per stage (planning/worker_memory.py, computed) for this job's
    layout, cache and context, against this machine's memory shared by the workers."""

    def __init__(self, stages: list, capacity: int, ctx: int, blocks: int, args):
        self.stages, self.capacity, self.ctx, self.blocks, self.args = (
            stages,
            capacity,
            ctx,
            blocks,
            args,
        )

    @property
    def text(self) -> str:
        a = self.args
        rows = [
            f"plan (computed, not measured): context {self.ctx} tokens, cache "
            f"{self.blocks} blocks x {a.block_size} tokens per worker, chunks of "
            f"{a.chunk_tokens}, {a.stages} stage(s) x {a.tp} rank(s); MiB per worker",
            f"{'stage':>5} {'layers':>7} {'weights':>8} {'MLA cache':>10} {'indexer':>8} "
            f"{'workspace':>10} {'runtime':>8} {'total':>8} {'of':>8}  fits",
        ]
        for s, layers, m in self.stages:
            rows.append(
                f"{s:>5} {layers.start:>3}-{layers.stop - 1:<3} {m.weights / MIB:>8.1f} "
                f"{m.mla_cache / MIB:>10.1f} {m.indexer_cache / MIB:>8.1f} "
                f"{m.workspace / MIB:>10.1f} {m.runtime / MIB:>8.1f} {m.total / MIB:>8.1f} "
                f"{self.capacity / MIB:>8.0f}  {'yes' if m.total <= self.capacity else 'NO'}"
            )
        return "\n".join(rows)

    def check(self) -> None:
        s, _, m = max(self.stages, key=lambda x: x[2].total)
        if m.total > self.capacity:
            raise ValueError(
                f"stage {s} needs {m.total / MIB:.0f} MiB at {_k(self.ctx)} context (computed), "
                f"more than the {self.capacity / MIB:.0f} MiB each worker has here: lower --ctx "
                "(or split the longest prompt), or add --stages"
            )


def memory_plan(args: argparse.Namespace, cfg, ctx: int, blocks: int) -> MemoryPlan:
    from dist_glm5.planning.partition import partition_layers
    from dist_glm5.planning.worker_memory import worker_memory

    ranges = partition_layers(cfg, args.stages)
    dtype = args.dtype or cfg.torch_dtype.replace("torch.", "")
    out = []
    for s, layers in enumerate(ranges):
        last = s == len(ranges) - 1
        m = worker_memory(
            cfg,
            layers,
            s == 0,
            last,
            mtp=args.mtp and last,
            cache_tokens=blocks * args.block_size,
            chunk_tokens=args.chunk_tokens,
            context=ctx,
            tp=args.tp,
            ep=args.ep,
            dtype_bytes=2 if dtype in ("bfloat16", "float16") else 4,
            dsa=dsa_config(args),
        )
        out.append((s, layers, m))
    # the workers of every stage share this machine when the nodes are on it (as here); on a
    # real cluster each node has its own, which this cannot see
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return MemoryPlan(out, mem // (args.stages * args.tp), ctx, blocks, args)


def stage_peaks(engine) -> dict[str, float]:
    """Peak RSS (MiB) of each stage's worker so far, as the workers reported it."""
    peaks = engine.stats.stage_peak_rss_mb
    return {str(s): round(peaks[s], 1) for s in sorted(peaks)}


class Progress:
    """Time to first token and prefill progress per sequence, from this process's clock."""

    def __init__(self, interval: float, chunk: int):
        self.interval, self.chunk = interval, chunk
        self.added_at: dict[int, float] = {}
        self.first_token: dict[int, float] = {}
        self.last_log = time.perf_counter()
        self.mark: dict[int, tuple[float, int]] = {}  # seq -> (time, positions) at the last line

    def added(self, seq) -> None:
        self.added_at[seq.seq_id] = time.perf_counter()

    def stepped(self, running: list, done: list) -> None:
        now = time.perf_counter()
        for s in [*running, *done]:
            if s.output and s.seq_id not in self.first_token:
                self.first_token[s.seq_id] = now
        if now - self.last_log < self.interval:
            return
        self.last_log = now
        # the prompts long enough to watch: more than one chunk still to come
        long = [s for s in running if s.prefilling and s.prefill_to > self.chunk]
        if not long:
            return
        s = max(long, key=lambda s: s.prefill_to - s.num_computed)
        t0, n0 = self.mark.get(s.seq_id, (s.scheduled_at or now, 0))
        self.mark[s.seq_id] = (now, s.num_computed)
        rate = (s.num_computed - n0) / (now - t0) if now > t0 else 0.0
        eta = _eta(s.num_computed, s.prefill_to, now - (s.scheduled_at or now), rate)
        more = f"; {len(long) - 1} more prompt(s) prefilling" if len(long) > 1 else ""
        log.info(
            "prefill seq %d: %d/%d chunks (%d/%d tokens, %.1f%%), %.0f tokens/s, ETA %s%s",
            s.seq_id,
            s.num_computed // self.chunk,
            -(-s.prefill_to // self.chunk),
            s.num_computed,
            s.prefill_to,
            100 * s.num_computed / s.prefill_to,
            rate,
            eta,
            more,
        )

    def record(self, seq, peaks: dict[str, float]) -> dict:
        now = time.perf_counter()
        added = self.added_at.pop(seq.seq_id, now)
        first = self.first_token.pop(seq.seq_id, now)
        start = seq.scheduled_at or added
        self.mark.pop(seq.seq_id, None)
        r = {
            "queue_s": round(start - added, 3),
            "ttft_s": round(first - added, 3),  # from the job's submission
            "prefill_s": round(first - start, 3),  # from its first chunk's scheduling
            "prefill_tok_s": round(len(seq.prompt) / max(first - start, 1e-9), 1),
            "total_s": round(now - added, 3),
            "peak_rss_mib": peaks,  # per stage: each worker's high-water mark so far
        }
        if len(seq.output) > 1:
            r["decode_tok_s"] = round((len(seq.output) - 1) / max(now - first, 1e-9), 2)
        return r


def _eta(n: int, total: int, elapsed: float, rate: float) -> str:
    """Time left to prefill positions n..total. The indexer scores every earlier key, so a
    token's cost grows with its position: fit cost(x) = a + b x to the time so far (elapsed for
    n positions) and the current rate (1 / cost(n)), and sum it over what is left."""
    if rate <= 0 or n <= 0:
        return "unknown"
    b = max(0.0, 2 * (n / rate - elapsed) / n**2)
    a = max(0.0, 1 / rate - b * n)
    return _hms(a * (total - n) + b * (total**2 - n**2) / 2)


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _summary(t: dict) -> str:
    rss = ", ".join(f"stage {s} {v:.0f} MiB" for s, v in t["peak_rss_mib"].items())
    return (
        f"time to first token {t['ttft_s']:.1f} s (queued {t['queue_s']:.1f} s), prefill "
        f"{t['prefill_tok_s']:.0f} tokens/s, peak RSS {rss or 'not reported'}"
    )


def _prompt_ids(j: dict, tok) -> list[int]:
    extra = sorted(set(j) - FIELDS - {"id", "line", "prompt", "prompt_ids"})
    if extra:
        raise ValueError(f"unknown fields {extra}")
    if "prompt_ids" in j:
        return [int(t) for t in j["prompt_ids"]]
    if isinstance(j.get("prompt"), str) and tok is not None:
        return tok.encode(j["prompt"])
    raise ValueError("give prompt (text, needs a tokenizer) or prompt_ids")


def _params(j: dict, args: argparse.Namespace):
    from dist_glm5.sampling.params import SamplingParams

    kw = {k: j[k] for k in FIELDS if k in j}
    kw.setdefault("max_tokens", args.max_tokens)
    for k in ("stop", "stop_token_ids"):
        if isinstance(kw.get(k), (str, int)):
            kw[k] = [kw[k]]
    return SamplingParams(**kw)


def _result(j: dict, seq, text: bool) -> dict:
    if seq.finish_reason == "error":
        return {"id": j["id"], "error": seq.error}
    r = {
        "id": j["id"],
        "token_ids": seq.output,
        "finish_reason": seq.finish_reason,
        "usage": {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.output)},
    }
    if text:
        r["text"] = seq.text  # the engine's incremental detokenisation (stops before a stop string)
    if seq.logprobs:
        r["logprobs"] = seq.logprobs
    return r
