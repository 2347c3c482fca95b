"""`dist-glm5 bench structured`: what a grammar costs.

- The mask per decode step: `GrammarMatcher.allowed()` (llguidance's bitmask, unpacked to a bool
  mask over the model's vocabulary) and `accept()`, for a large JSON schema, walked to its end under
  random logits, with the embedded model's byte tokenizer (259 tokens) and with a GLM-5-sized
  byte-level BPE vocabulary (154,880 tokens: `--tokenizer`, e.g. GLM-5's tokenizer.json, or one
  trained once on the Python standard library and cached), against the embedded model's decode
  step time without a grammar at batch 1 and 16.
- Tokens/s of structured output (that schema, sampled) against free output at batch 1 and 16 on
  the embedded model in this process, with the same number of tokens per row (a free row gets
  max_tokens = its structured twin's length, EOS ignored).

The masks of a batch are computed one row after another, on the last stage, between the forward
and the sampler: at batch B a step pays B masks.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

log = logging.getLogger(__name__)
GLM5_VOCAB = 154880


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the embedded random model)")
    p.add_argument("--tokenizer", help="a tokenizer.json with a large vocabulary (e.g. GLM-5's)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--walk-steps", type=int, default=400, help="mask steps per walk (at most)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def large_schema(props: int = 24) -> dict:
    """A large JSON schema that a walk fills completely: every property required, every string,
    number and array bounded."""
    kinds = [
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": -1000, "maximum": 1000},
        {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5},
        {"type": "boolean"},
        {"enum": ["alpha", "beta", "gamma", "delta", 'quo"te', "ünï"]},
        {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 5},
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 4},
                    "maxItems": 3,
                },
                "ok": {"type": "boolean"},
            },
            "required": ["id", "tags", "ok"],
            "additionalProperties": False,
        },
    ]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(props)}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def bpe_tokenizer(path: str | None):
    """An HFTokenizer with a GLM-5-sized vocabulary: the given one, or a byte-level BPE trained
    on the standard library's sources (once; cached under the dist_glm5 home)."""
    from dist_glm5.checkpoint.default_model import cache_root
    from dist_glm5.checkpoint.tokenizer import HFTokenizer

    if path:
        return HFTokenizer(Path(path))
    out = cache_root() / "bench" / f"stdlib-bpe-{GLM5_VOCAB}.json"
    if not out.exists():
        import sysconfig

        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        log.warning("training a %d-token BPE on the standard library (once)", GLM5_VOCAB)
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))

        def texts():
            for f in files:
                try:
                    yield f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    pass

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=GLM5_VOCAB,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|endoftext|>"],
            show_progress=False,
        )
        tok.train_from_iterator(texts(), trainer)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tok.save(str(tmp))
        tmp.replace(out)
    return HFTokenizer(out)


def mask_walk(spec, tokenizer, vocab: int, eos: tuple[int, ...], steps: int, seed: int = 0):
    """Walk the grammar under random logits; per step the ms of allowed(), of the masking and of
    accept()."""
    import torch

    from dist_glm5.sampling.grammar import GrammarMatcher, ll_tokenizer
    from dist_glm5.sampling.sampler import grammar_mask

    t = time.perf_counter()
    ll_tokenizer(tokenizer)  # built once per tokenizer (a server pays it at its first grammar)
    tokenizer_s = time.perf_counter() - t
    t = time.perf_counter()
    m = GrammarMatcher(spec, tokenizer, vocab, eos)
    compile_ms = (time.perf_counter() - t) * 1e3
    g = torch.Generator().manual_seed(seed)
    allowed_ms, mask_ms, accept_ms = [], [], []
    for _ in range(steps):
        logits = torch.randn(vocab, generator=g)
        t0 = time.perf_counter()
        allowed = m.allowed()
        t1 = time.perf_counter()
        masked = grammar_mask(logits, logits, allowed)
        t2 = time.perf_counter()
        tok = int(masked.argmax())
        if tok in eos:
            break
        t3 = time.perf_counter()
        assert m.accept(tok)
        t4 = time.perf_counter()
        allowed_ms.append((t1 - t0) * 1e3)
        mask_ms.append((t2 - t1) * 1e3)
        accept_ms.append((t4 - t3) * 1e3)

    def stats(xs):
        xs = sorted(xs)
        return {
            "mean": statistics.fmean(xs),
            "p50": xs[len(xs) // 2],
            "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))],
        }

    per_step = [a + b + c for a, b, c in zip(allowed_ms, mask_ms, accept_ms)]
    return {
        "vocab": vocab,
        "steps": len(per_step),
        "tokenizer_build_s": tokenizer_s,
        "compile_ms": compile_ms,
        "allowed_ms": stats(allowed_ms),
        "mask_ms": stats(mask_ms),
        "accept_ms": stats(accept_ms),
        "step_ms": stats(per_step),
    }


def engine_runs(d: Path, spec, batch: int) -> dict:
    """Structured then free output at one batch size on the in-process engine."""
    import torch

    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.engine.config import CacheConfig, EngineConfig, StageSpec
    from dist_glm5.engine.coordinator import Coordinator
    from dist_glm5.engine.scheduler import SchedulerConfig
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.sampling.params import SamplingParams
    from dist_glm5.stages.inprocess_pipeline import InProcessPipeline

    cfg = ModelConfig.from_hf(d)
    engine = EngineConfig(str(d), cache=CacheConfig(512), scheduler=SchedulerConfig(microbatches=1))
    c = Coordinator(
        InProcessPipeline(StageSpec(engine)),
        engine.scheduler,
        cfg.eos_token_id,
        cfg.vocab_size,
        load_tokenizer(d),
    )
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 256, (16,), generator=g).tolist() for _ in range(batch)]
    c.run(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up

    def timed(params):
        steps = c.stats.steps
        t = time.perf_counter()
        seqs = c.run(prompts, params)
        return seqs, time.perf_counter() - t, c.stats.steps - steps

    structured, ts, ss = timed(
        [
            SamplingParams(max_tokens=2048, temperature=1.0, seed=i, grammar=spec)
            for i in range(batch)
        ]
    )
    bad = [s.finish_reason for s in structured if s.finish_reason != "stop"]
    if bad:
        log.warning("%d structured rows did not complete: %s", len(bad), bad[:3])
    n = [len(s.output) for s in structured]
    free, tf, sf = timed(
        [
            SamplingParams(max_tokens=k, temperature=1.0, seed=i, ignore_eos=True)
            for i, k in enumerate(n)
        ]
    )
    assert [len(s.output) for s in free] == n
    tokens = sum(n)
    return {
        "batch": batch,
        "tokens": tokens,
        "structured_tok_s": tokens / ts,
        "free_tok_s": tokens / tf,
        "structured_step_ms": ts / ss * 1e3,
        "free_step_ms": tf / sf * 1e3,
        "ratio": (tokens / ts) / (tokens / tf),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from dist_glm5.checkpoint.default_model import ensure_random_model
    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.sampling.grammar import GrammarSpec

    torch.set_num_threads(args.threads)  # small ops on spinning threads: 100x slower when loaded
    d = Path(args.model) if args.model else ensure_random_model()
    cfg = ModelConfig.from_hf(d)
    schema = large_schema()
    spec = GrammarSpec.json_schema(schema)
    res: dict = {"schema_chars": len(json.dumps(schema)), "schema_properties": 24}
    model_tok = load_tokenizer(d)
    res["mask_model_vocab"] = mask_walk(
        spec, model_tok, cfg.vocab_size, tuple(cfg.eos_token_id), args.walk_steps
    )
    bpe = bpe_tokenizer(args.tokenizer)
    eos = bpe.tok.token_to_id("<|endoftext|>")
    res["mask_glm5_vocab"] = mask_walk(
        spec,
        bpe,
        max(GLM5_VOCAB, bpe.tok.get_vocab_size()),
        (eos if eos is not None else 0,),
        args.walk_steps,
    )
    res["engine"] = [engine_runs(d, spec, b) for b in args.batches]
    for e in res["engine"]:
        for k in ("mask_model_vocab", "mask_glm5_vocab"):
            mask = res[k]["step_ms"]["mean"] * e["batch"]  # one mask per row per step
            e[f"{k}_share_of_free_step"] = mask / e["free_step_ms"]
    print(summary(res))
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=2))
    return 0


def summary(res: dict) -> str:
    lines = [
        f"large JSON schema: {res['schema_properties']} required properties, "
        f"{res['schema_chars']} characters"
    ]
    for k, name in (
        ("mask_model_vocab", "model's byte vocabulary"),
        ("mask_glm5_vocab", "GLM-5-sized BPE vocabulary"),
    ):
        m = res[k]
        lines.append(
            f"mask per step, {name} ({m['vocab']} tokens, {m['steps']} steps): "
            f"{m['step_ms']['mean']:.3f} ms mean, {m['step_ms']['p99']:.3f} ms p99 "
            f"(allowed {m['allowed_ms']['mean']:.3f}, mask {m['mask_ms']['mean']:.3f}, accept "
            f"{m['accept_ms']['mean']:.3f}); compile {m['compile_ms']:.1f} ms"
        )
    for e in res["engine"]:
        lines.append(
            f"batch {e['batch']}: structured {e['structured_tok_s']:.1f} tok/s vs free "
            f"{e['free_tok_s']:.1f} tok/s (x{e['ratio']:.2f}); step {e['structured_step_ms']:.1f} "
            f"vs {e['free_step_ms']:.1f} ms; a GLM-5-vocabulary mask per row would add "
            f"{100 * e['mask_glm5_vocab_share_of_free_step']:.1f}% to this model's free step"
        )
    return "\n".join(lines)
