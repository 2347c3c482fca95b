"""`launch batch --input prompts.jsonl --output results.jsonl`: a long-context batch job.

Each input line is a JSON object with "prompt" (text) or "prompt_ids" (token ids), an optional "id"
(default: the line number) and optional sampling fields (max_tokens, temperature, ...). Exactly one
result line per prompt is appended to the output as it finishes, flushed and fsynced; a rerun skips
ids already in the output, so a job killed halfway completes without duplicates. A prompt that
fails gets its line too, with the error. Ctrl-C stops cleanly: the step under way finishes, its
results are written whole, the pipeline is closed and the job exits with 130; rerun to resume.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
from pathlib import Path

from tqdm import tqdm

from .engine_args import add_layout_args, build_engine, engine_config, model_dir

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

    d = model_dir(args)
    tok = load_tokenizer(d)
    out_path = Path(args.output)
    jobs = read_jobs(Path(args.input), tok)
    finished = done_ids(out_path)
    todo = [j for j in jobs if j["id"] not in finished]
    log.info(
        "%d prompts, %d already answered, %d to run", len(jobs), len(jobs) - len(todo), len(todo)
    )
    if out_path.exists() and out_path.read_bytes() and not out_path.read_bytes().endswith(b"\n"):
        with open(
            out_path, "ab"
        ) as f:  # close a torn line so the next result starts on its own line
            f.write(b"\n")
    engine = build_engine(engine_config(args, d))
    pending: dict[int, dict] = {}
    # Fault injection for the resume tests: right after this many result lines, send this process
    # a signal (KILL by default; "3:INT" for Ctrl-C), a deterministic point (polling the file
    # from outside races the job's end).
    when, _, sig = os.environ.get("DIST_GLM5_BATCH_KILL_AFTER", "0").partition(":")
    kill_after, kill_sig = int(when), getattr(signal, f"SIG{sig or 'KILL'}")
    written = 0
    interrupted = threading.Event()

    def on_sigint(*_):
        if interrupted.is_set():  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        interrupted.set()
        log.warning("interrupted: finishing the current step, then stopping (Ctrl-C again: now)")

    old_handler = signal.signal(signal.SIGINT, on_sigint)
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="batch", unit="prompt")
    try:
        with open(out_path, "a") as out:

            def write(obj):
                nonlocal written
                out.write(json.dumps(obj) + "\n")
                out.flush()
                os.fsync(out.fileno())
                bar.update()
                written += 1
                if written == kill_after:
                    os.kill(os.getpid(), kill_sig)

            for j in todo:
                try:
                    seq = engine.add(_prompt_ids(j, tok), _params(j, args))
                    pending[seq.seq_id] = j
                except (ValueError, TypeError) as e:
                    write({"id": j["id"], "error": str(e)})
            # results are written between steps: an interrupt never tears a line
            while pending and not interrupted.is_set():
                for seq in engine.step():
                    j = pending.pop(seq.seq_id, None)
                    if j is not None:
                        write(_result(j, seq, tok is not None))
    except KeyboardInterrupt:
        interrupted.set()
    finally:
        signal.signal(signal.SIGINT, old_handler)
        bar.close()
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
