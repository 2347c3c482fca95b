"""`dist-glm5 bench quality`: what the trained default model does, against the seed's gates.

- held-out bits per byte (the frozen stdlib slice in heldout.json), beside named baselines: an
  order-0 and an order-1 byte model fitted on the training split, and gzip -9 / xz -9e on the
  same texts;
- MTP: acceptance on held-out prompts, greedy and at T=0.7, tokens per decode step, decode
  speed-up with MTP on (one sequence at a time, in process);
- needles: 3 per prompt at each --needle-lengths, on two fillers (held-out code, the classic
  pass-key prose), the sparse DSA path through --stages stages vs the reference path (exact
  masked DSA math, in process) for lengths <= --reference-max;
- MXFP4 vs BF16 (our converter, quark and OCP rules): per-token KL and top-1 agreement over 6
  held-out texts x 512 tokens;
- one word repeated --repeat-count times: what the model continues with.
Prints a JSON document (and writes it to --output if given).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import lzma
import math
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from dist_glm5.backends import get_backend

log = logging.getLogger(__name__)
LN2 = math.log(2)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the shipped one)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument(
        "--only",
        nargs="*",
        default=["bpb", "mtp", "needles", "mxfp4", "repeat"],
        help="parts to run (bpb mtp needles mxfp4 repeat)",
    )
    p.add_argument(
        "--needle-lengths", type=int, nargs="*", default=[4096], help="e.g. 4096 16384 65536"
    )
    p.add_argument(
        "--reference-max", type=int, default=4096, help="longest context for the reference path"
    )
    p.add_argument("--stages", type=int, default=2, help="pipeline stages for the sparse path")
    p.add_argument("--repeat-count", type=int, default=2000)
    p.add_argument("--mtp-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=run)


# ---- the checkpoint's ids ----------------------------------------------------------------------
class Ids:
    """A checkpoint's byte tokenizer (its space-run ids, if it has them): bytes to ids and back."""

    def __init__(self, model_dir) -> None:
        from dist_glm5.checkpoint.tokenizer import ByteTokenizer, load_tokenizer

        tok = load_tokenizer(model_dir)
        self.tok = tok if isinstance(tok, ByteTokenizer) else ByteTokenizer()
        self.token_bytes = self.tok.token_bytes()

    def __call__(self, data: bytes) -> list[int]:
        return self.tok.encode_bytes(data)

    def text(self, ids) -> str:
        return self.tok.decode(ids)


# ---- held-out bits per byte ----------------------------------------------------------------
def heldout_texts() -> list[bytes]:
    from dist_glm5.train.corpus import frozen_heldout

    return [t["text"].encode() for t in frozen_heldout()]


def model_bits_per_byte(model, texts: list[bytes], enc: Ids) -> float:
    """Mean next-byte cross-entropy over every text (each scored from its first byte), in bits
    (with space-run ids: the ids' cross-entropy, per byte they predict)."""
    from dist_glm5.model.reference_loop import full_logits

    nats, n = 0.0, 0
    with torch.no_grad():
        for t in texts:
            ids = enc(t)
            lo = full_logits(model, ids).float()
            nats += torch.nn.functional.cross_entropy(
                lo[:-1], torch.tensor(ids[1:]), reduction="sum"
            ).item()
            n += len(t) - len(enc.token_bytes[ids[0]])
    return nats / n / LN2


def byte_model_bits(texts: list[bytes], order: int) -> float:
    """An order-0 or order-1 byte model (add-1/2 smoothing) fitted on the training split."""
    from dist_glm5.train.corpus import load_split

    train = b"\n".join(b for _, b in load_split("train"))
    if order == 0:
        c = Counter(train)
        tot = len(train) + 0.5 * 256
        bits = sum(-math.log2((c[b] + 0.5) / tot) for t in texts for b in t[1:])
    else:
        pair = Counter(zip(train, train[1:]))
        ctx = Counter(train[:-1])
        bits = sum(
            -math.log2((pair[(a, b)] + 0.5) / (ctx[a] + 128.0))
            for t in texts
            for a, b in zip(t, t[1:])
        )
    return bits / sum(len(t) - 1 for t in texts)


def bpb(model, texts, enc: Ids) -> dict:
    total = sum(len(t) for t in texts)
    return {
        "texts": f"{len(texts)} x {len(texts[0])} bytes (heldout.json, stdlib held-out split)",
        "model": round(model_bits_per_byte(model, texts, enc), 4),
        "order0_bytes": round(byte_model_bits(texts, 0), 4),
        "order1_bytes": round(byte_model_bits(texts, 1), 4),
        "gzip_9_per_text": round(8 * sum(len(gzip.compress(t, 9)) for t in texts) / total, 4),
        "xz_9e_per_text": round(
            8 * sum(len(lzma.compress(t, preset=9 | lzma.PRESET_EXTREME)) for t in texts) / total,
            4,
        ),
        "xz_9e_all_texts_together": round(
            8 * len(lzma.compress(b"".join(texts), preset=9 | lzma.PRESET_EXTREME)) / total, 4
        ),
    }


# ---- engines -------------------------------------------------------------------------------
def engine(model_dir, stages=1, mtp=False, dsa=None, blocks=1024, chunk=256, dtype="float32"):
    """A coordinator: in process for one stage, a local two-node Ray cluster otherwise.
    dtype: float32 (the quality figures), None (the checkpoint's: what `launch` serves)."""
    from dist_glm5.checkpoint.tokenizer import load_tokenizer
    from dist_glm5.engine.config import CacheConfig, EngineConfig, Layout, StageSpec
    from dist_glm5.engine.coordinator import Coordinator
    from dist_glm5.engine.scheduler import SchedulerConfig
    from dist_glm5.model.config import ModelConfig
    from dist_glm5.model.dsa_config import DSAConfig

    cfg = ModelConfig.from_hf(model_dir)
    eng = EngineConfig(
        str(model_dir),
        Layout(stages, 1, 1),
        CacheConfig(blocks),
        SchedulerConfig(chunk_tokens=chunk, step_tokens=max(1024, chunk)),
        dsa or DSAConfig(),
        mtp=mtp,
        dtype=dtype,
    )
    if stages == 1:
        from dist_glm5.stages.inprocess_pipeline import InProcessPipeline

        pipe = InProcessPipeline(StageSpec(eng))
    else:
        from dist_glm5.stages.ray_pipeline import RayPipeline

        pipe = RayPipeline(eng)
    return Coordinator(
        pipe, eng.scheduler, cfg.eos_token_id, cfg.vocab_size, load_tokenizer(model_dir)
    )


# ---- MTP -------------------------------------------------------------------------------------
def heldout_prompts(
    texts: list[bytes], n: int, size: int = 384, stride: int = 1024, enc=list
) -> list:
    """n prompts of `size` bytes (as ids: enc): every text's window at 0, then every text's at
    `stride`, and so on (so the first len(texts) are the texts' openings)."""
    windows = [t[o : o + size] for o in range(0, max(map(len, texts)), stride) for t in texts]
    windows = [enc(w) for w in windows if len(w) == size]
    if len(windows) < n:
        raise ValueError(f"{n} prompts of {size} bytes asked; the texts hold {len(windows)}")
    return windows[:n]


def mtp_figures(model_dir, texts, n_tokens: int, n_prompts: int = 6) -> dict:
    """Acceptance and decode speed with and without MTP, as `launch generate` runs them (the
    checkpoint's dtype, sparse DSA): the two engines take turns per prompt, so both see the same
    minutes of a shared machine."""
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.sampling.params import SamplingParams

    prompts = heldout_prompts(texts, n_prompts, enc=Ids(model_dir))
    out = {
        "prompts": f"{len(prompts)} held-out prompts x 384 bytes, {n_tokens} new tokens each",
        "engine": "the checkpoint's dtype, sparse DSA (as launch generate); decode steps timed",
    }
    runs = {}
    for name, temp in (("greedy", 0.0), ("t0.7", 0.7)):
        engines = {
            mtp: engine(model_dir, mtp=mtp, dsa=DSAConfig(mode="sparse"), dtype=None)
            for mtp in (False, True)
        }
        tally = {mtp: dict(toks=0, secs=0.0, steps=0, prop=0, acc=0, outs=[]) for mtp in engines}
        for i, p in enumerate(prompts):  # one sequence at a time: decode speed, not batching
            for mtp in (False, True) if i % 2 == 0 else (True, False):
                c, t = engines[mtp], tally[mtp]
                params = SamplingParams(
                    max_tokens=n_tokens, temperature=temp, seed=i, ignore_eos=True
                )
                c.run([p[:64]], SamplingParams(max_tokens=1))  # warm the worker
                s = c.add(p, params)
                while not s.output:  # prefill: its last chunk samples the first token
                    c.step()
                t0 = time.perf_counter()
                while c.has_work:  # decode: what MTP speeds up
                    c.step()
                t["secs"] += time.perf_counter() - t0
                t["toks"] += len(s.output) - 1
                t["steps"] += s.steps - math.ceil(len(p) / 256)
                t["prop"] += s.drafts_proposed
                t["acc"] += s.drafts_accepted
                t["outs"].append(s.output)
        for mtp, c in engines.items():
            c.close()
            t = tally[mtp]
            runs[(name, mtp)] = t["outs"]
            key = f"{name}_{'mtp' if mtp else 'plain'}"
            out[key] = {
                "tokens_per_s": round(t["toks"] / t["secs"], 1),
                "tokens_per_step": round(t["toks"] / max(1, t["steps"]), 3),
                "ms_per_step": round(1e3 * t["secs"] / max(1, t["steps"]), 3),
            }
            if mtp:
                a = t["acc"] / max(1, t["prop"])
                out[key]["acceptance"] = round(a, 3)
                # drafts as independent trials: the figure's sampling noise, not a bound
                out[key]["acceptance_se"] = round(math.sqrt(a * (1 - a) / max(1, t["prop"])), 3)
                out[key]["drafts"] = [t["prop"], t["acc"]]
        out[f"{name}_speedup"] = round(
            out[f"{name}_mtp"]["tokens_per_s"] / out[f"{name}_plain"]["tokens_per_s"], 3
        )
        # why it pays or not: an MTP step emits 1 + acceptance tokens and costs this many plain
        # steps; it pays once the acceptance passes the ratio - 1 (the break-even)
        ratio = out[f"{name}_mtp"]["ms_per_step"] / out[f"{name}_plain"]["ms_per_step"]
        out[f"{name}_step_cost_ratio"] = round(ratio, 3)
        out[f"{name}_break_even_acceptance"] = round(ratio - 1, 3)
    out["greedy_identical_with_mtp"] = runs[("greedy", True)] == runs[("greedy", False)]
    out["greedy_draft_kinds"] = draft_agreement(model_dir, prompts, runs[("greedy", False)])
    return out


def token_kind(token_bytes: bytes) -> str:
    """'space' (a space or a run of them), 'newline', or 'other'."""
    if token_bytes and token_bytes.strip(b" ") == b"":
        return "space"
    return "newline" if token_bytes == b"\n" else "other"


def draft_tally(prompt_len: int, tokens: list[int], draft: list[int], token_bytes) -> dict:
    """{kind: [drafts, agreed]} over a sequence's output: output token j >= 1 (the first comes
    from the prefill) is drafted by the MTP row at prompt_len + j - 2 (row q reads token q + 1 and
    proposes q + 2). tokens: prompt + output; draft: each row's argmax."""
    out: dict = {}
    for q in range(prompt_len + 1, len(tokens)):
        t = tokens[q]
        c = out.setdefault(token_kind(token_bytes[t]), [0, 0])
        c[0] += 1
        c[1] += int(draft[q - 2] == t)
    return out


def draft_agreement(model_dir, prompts, outputs) -> dict:
    """Teacher-forced on the model's greedy continuations: how often the MTP layer's argmax is
    the token the model wrote, over all and by the kind of token drafted. What a served
    acceptance is made of: easy text (runs of spaces) can carry a figure that the rest does not
    (the shipped model, session 28: 0.976 on spaces, half its greedy tokens, 0.649 on the rest)."""
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.model.reference_loop import mtp_one_shot

    m = load_model(model_dir, ops=get_backend("cpu").ops(), dsa=DSAConfig(mode="sparse"))
    token_bytes = Ids(model_dir).token_bytes
    tally: dict = {}
    for p, o in zip(prompts, outputs):
        toks = list(p) + list(o)
        draft = mtp_one_shot(m, toks).argmax(-1).tolist()
        for k, (d, a) in draft_tally(len(p), toks, draft, token_bytes).items():
            c = tally.setdefault(k, [0, 0])
            c[0], c[1] = c[0] + d, c[1] + a
    total = sum(d for d, _ in tally.values())
    return {
        "agreement": round(sum(a for _, a in tally.values()) / max(1, total), 3),
        "drafts": total,
        "by_kind": {
            k: {"share": round(d / total, 3), "agreement": round(a / max(1, d), 3)}
            for k, (d, a) in sorted(tally.items())
        },
    }


# ---- needles ---------------------------------------------------------------------------------
def needle_prompts(length: int, filler_kind: str, seed: int):
    """(prompts, answers): one body with 3 needles, asked 3 times (one needle per prompt).
    A question ends at the key's colon and its answer is the space and the value: a prompt
    ending in the space would split a BPE piece (` t` of ` tayk45`) the model only ever saw
    whole, and a BPE model then answers as if every value began with a digit (v1: 1 of 6 at 4K
    asked with the space, 4 of 6 without). For a byte model the space is one more easy byte."""
    from dist_glm5.train import corpus

    rng = random.Random(seed)
    needles = corpus.make_needles(rng, 3)
    room = length - 40
    if filler_kind == "code":
        text = b"\n".join(heldout_texts())
        filler = (text * (room // len(text) + 1))[:room]
    else:
        filler = corpus.prose_filler(rng, room, classic=True)
    body = corpus.needle_prompt(rng, filler, needles, (0.05, 0.9))
    asks = [body + b"\n" + nd.query.removesuffix(b" ") for nd in needles]
    return asks, [" " + nd.value for nd in needles]


def other_needle(got: list[str], answers: list[str]) -> int:
    """Misses that begin as another needle's value does (its first 3 characters): the key was
    matched to the wrong needle, not copied wrong. The answers' leading space is not compared."""
    got, answers = [g.lstrip(" ") for g in got], [a.lstrip(" ") for a in answers]
    return sum(
        g != a and any(g[:3] == b[:3] for b in answers if b != a) for g, a in zip(got, answers)
    )


def ask(coord, prompts, answers, enc: Ids) -> dict:
    from dist_glm5.sampling.params import SamplingParams

    t0 = time.perf_counter()
    ids = [enc(p) for p in prompts]
    seqs = coord.run(ids, SamplingParams(max_tokens=len(answers[0]), ignore_eos=True))
    got = [enc.text(s.output)[: len(answers[0])] for s in seqs]
    return {
        "found": sum(g == a for g, a in zip(got, answers)),
        "of": len(answers),
        "answers": answers,
        "got": got,
        "other_needle": other_needle(got, answers),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def needles(model_dir, lengths, stages: int, reference_max: int, index_keys="exact") -> dict:
    """index_keys: the sparse runs' (DSAConfig.index_keys); the dense reference's are exact."""
    from dist_glm5.model.dsa_config import DSAConfig

    out, enc = {}, Ids(model_dir)
    sparse = DSAConfig(mode="sparse", dense_threshold=0, index_keys=index_keys)
    for length in lengths:
        blocks = 3 * (length // 64 + 4) + 16
        cases = {
            kind: needle_prompts(length, kind, seed=length + i)
            for i, kind in enumerate(("code", "prose"))
        }
        c = engine(model_dir, stages=stages, dsa=sparse, blocks=blocks, chunk=1024)
        try:
            for kind, (ps, ans) in cases.items():
                out[f"{length}_{kind}_sparse_{stages}stages"] = ask(c, ps, ans, enc)
        finally:
            c.close()
        if length <= reference_max:
            c = engine(model_dir, dsa=DSAConfig(mode="reference"), blocks=blocks, chunk=1024)
            for kind, (ps, ans) in cases.items():
                out[f"{length}_{kind}_reference"] = ask(c, ps, ans, enc)
            c.close()
        log.info("needles at %d: %s", length, {k: v["found"] for k, v in out.items()})
    return out


# ---- MXFP4 vs BF16 ---------------------------------------------------------------------------
def mxfp4_figures(model_dir, texts) -> dict:
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.convert.glm53 import convert_glm53
    from dist_glm5.model.reference_loop import full_logits

    rows = [Ids(model_dir)(t[:512]) for t in texts[:6]]
    ref = load_model(model_dir, dtype=torch.float32, ops=get_backend("cpu").ops())
    with torch.no_grad():
        want = [full_logits(ref, r).float() for r in rows]
    del ref
    out = {"texts": "6 held-out texts x 512 tokens, KL(bf16 || mxfp4) per token"}
    for rule in ("quark", "ocp"):
        with tempfile.TemporaryDirectory() as tmp:
            convert_glm53(model_dir, Path(tmp) / "m", rule)
            q = load_model(Path(tmp) / "m", dtype=torch.float32, ops=get_backend("cpu").ops())
            kl, agree, n = 0.0, 0, 0
            with torch.no_grad():
                for r, w in zip(rows, want):
                    g = full_logits(q, r).float()
                    lp, lq = w.log_softmax(-1), g.log_softmax(-1)
                    kl += (lp.exp() * (lp - lq)).sum().item()
                    agree += (w.argmax(-1) == g.argmax(-1)).sum().item()
                    n += len(r)
            out[rule] = {"kl": round(kl / n, 5), "top1_agreement": round(agree / n, 4)}
    return out


# ---- one word repeated -----------------------------------------------------------------------
def repeated_word(model_dir, count: int) -> dict:
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.sampling.params import SamplingParams

    enc = Ids(model_dir)
    prompt = enc(b"the " * count)
    out = {"prompt": f"'the ' x {count} ({len(prompt)} tokens)"}
    for name, dsa in (
        ("sparse", DSAConfig(mode="sparse", dense_threshold=0)),
        ("reference", DSAConfig(mode="reference")),
    ):
        c = engine(model_dir, dsa=dsa, blocks=len(prompt) // 64 + 8, chunk=1024)
        (s,) = c.run([prompt], SamplingParams(max_tokens=48, ignore_eos=True))
        c.close()
        text = enc.text(s.output)
        out[name] = {"continuation": text, "keeps_repeating": text == ("the " * 12)[: len(text)]}
    return out


def run(args) -> int:
    from dist_glm5.checkpoint.default_model import ensure_default_model
    from dist_glm5.checkpoint.loader import load_model

    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_default_model()
    texts = heldout_texts()
    res: dict = {"model": str(model_dir)}
    if "bpb" in args.only:
        res["bits_per_byte"] = bpb(
            load_model(model_dir, dtype=torch.float32, ops=get_backend("cpu").ops()),
            texts,
            Ids(model_dir),
        )
        log.info("bits/byte: %s", res["bits_per_byte"])
    if "mtp" in args.only:
        res["mtp"] = mtp_figures(model_dir, texts, args.mtp_tokens)
        log.info("mtp: %s", res["mtp"])
    if "mxfp4" in args.only:
        res["mxfp4_vs_bf16"] = mxfp4_figures(model_dir, texts)
        log.info("mxfp4: %s", res["mxfp4_vs_bf16"])
    if "repeat" in args.only:
        res["repeated_word"] = repeated_word(model_dir, args.repeat_count)
        log.info("repeat: %s", res["repeated_word"])
    if "needles" in args.only:
        if args.stages > 1:
            import ray

            from dist_glm5.stages.ray_pipeline import local_cluster

            cluster = local_cluster(args.stages, cpus_per_node=2)
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        try:
            res["needles"] = needles(
                model_dir, args.needle_lengths, args.stages, args.reference_max
            )
        finally:
            if args.stages > 1:
                ray.shutdown()
                cluster.shutdown()
    text = json.dumps(res, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0
