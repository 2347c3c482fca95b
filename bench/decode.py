"""Whole-model decode and prefill, MXFP4 against BF16 against transformers, MEASURED side by side in
one run, with each decode step held against its roofline bound (`bench decode`).

The model is issue 11's "small" GLM-5-architecture model: transformers' GlmMoeDsaConfig with vocab
8192, hidden 1024, 8 layers (first dense), 64 routed experts top-8 + 1 shared, moe_intermediate
512, q_lora 256, kv_lora 128, 8 heads (nope 64, rope 32, v 64), indexer 8 heads x 64, index_topk
256. transformers builds it (random init, seed 0) and saves it in bf16; `convert glm53` encodes
its routed experts to MXFP4. Both are cached under $DIST_GLM5_HOME/bench/.

Per thread count, batch 1, a 128-token prompt then `--new-tokens` greedy tokens:
- ours MXFP4 (the backend's packed kernel), ours BF16, ours MXFP4 through the reference ops
  (dequantise-then-GEMM: today's path before the kernel), transformers BF16 (`generate`);
- decode tok/s = (new_tokens - 1) / (time of the whole generation - time of the prefill alone),
  best of `--repeats`;
- the decode step against its roofline bound: the bytes the step must read (planning/roofline.py's
  decode_bytes: weights, the experts 8 routes touch, indexer keys, selected MLA rows) over the
  read bandwidth measured in the same run at the same thread count.
Goals (issue 11): MXFP4 >= 2x BF16 and >= 4x transformers BF16 at 1 and 2 threads; the step within
2x of its bound; MXFP4 prefill no slower than BF16 prefill.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from dist_glm5.backends import get_backend
from dist_glm5.bench.generate_vs_hf import best

log = logging.getLogger(__name__)

SMALL = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    first_k_dense_replace=1,
    n_routed_experts=64,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=256,
    kv_lora_rank=128,
    num_attention_heads=8,
    num_key_value_heads=8,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=256,
    max_position_embeddings=65536,  # flatness is measured at 32K (the weights do not depend on it)
    bos_token_id=0,
    eos_token_id=1,
)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2, help="best of N")
    p.add_argument(
        "--reference-tokens",
        type=int,
        default=6,
        help="new tokens for the slow dequantise-then-GEMM reference (0: skip it)",
    )
    p.add_argument("--no-hf", action="store_true", help="leave transformers out")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def small_model_dirs() -> tuple[Path, Path]:
    """(bf16 dir, mxfp4 dir) of the small model, made once."""
    from dist_glm5.checkpoint.default_model import cache_root
    from dist_glm5.convert.glm53 import convert_glm53

    root = cache_root() / "bench" / "small"
    bf16, mx = root / "bf16", root / "mxfp4"
    if not (bf16 / "config.json").exists():
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        log.info("building the small model with transformers (random init, seed 0) in %s", bf16)
        torch.manual_seed(0)
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**SMALL)).to(torch.bfloat16).eval()
        model.save_pretrained(bf16)
        del model
    if not (mx / "config.json").exists():
        log.info("encoding its routed experts to MXFP4 in %s", mx)
        convert_glm53(bf16, mx)
    for d in (bf16, mx):  # a cache made when the context stopped at 16K: the same weights
        cfg_path = d / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("max_position_embeddings") != SMALL["max_position_embeddings"]:
            log.info("%s: max_position_embeddings -> %d", d, SMALL["max_position_embeddings"])
            cfg["max_position_embeddings"] = SMALL["max_position_embeddings"]
            cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return bf16, mx


def small_models(w4a8: bool = False) -> dict:
    """The small model as every command loads it (CPU ops, sparse DSA: the default, dense, is the
    reference attention, which the planned decode step declines): {"mxfp4", "bf16"}, and
    "w4a8" (the MXFP4 file with the int8-activation experts kernel) when asked."""
    from dataclasses import replace

    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.dsa_config import DSAConfig

    bf16_dir, mx_dir = small_model_dirs()
    ops, sparse = get_backend("cpu").ops(), DSAConfig(mode="sparse")
    models = {
        "mxfp4": load_model(mx_dir, ops=ops, dsa=sparse),
        "bf16": load_model(bf16_dir, ops=ops, dsa=sparse),
    }
    if w4a8:
        from dist_glm5.kernels.mxfp4_w4a8 import moe_mxfp4_w4a8
        from dist_glm5.ops.experts import ExpertsOps

        w4 = ExpertsOps("cpu-w4a8", moe_mxfp4_w4a8, ops.experts.dense)
        models["w4a8"] = load_model(mx_dir, ops=replace(ops, experts=w4), dsa=sparse)
    return models


def measure_prefill(model, prompt: list[int], repeats: int) -> float:
    """Best seconds from a prompt to its first sampled token (one sequence, an empty cache, the
    whole prompt in one forward: the prefill row of llama-bench -p N), after one warm-up (kernel
    build, allocator)."""
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    with torch.no_grad():
        generate(model, [prompt], one)
        return best(lambda: generate(model, [prompt], one), repeats)


def measure_ours(model, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    full = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t_pre = measure_prefill(model, prompt, repeats)
    with torch.no_grad():
        t_all = best(lambda: generate(model, [prompt], full), repeats)
    step = (t_all - t_pre) / (new_tokens - 1)
    return {"prefill_s": t_pre, "decode_ms": 1e3 * step, "decode_tok_s": 1 / step}


def measure_ours_steps(model, prompts: list[list[int]], steps: int, repeats: int) -> dict:
    """Aggregate decode of len(prompts) sequences stepping together after their prompts: the
    prompts are prefilled once, untimed (chunks of 2048, one sequence at a time), then `repeats`
    runs of `steps` greedy steps follow on from each other; the best run counts (the context
    grows by steps x repeats over the prompt, a rounding error at a deep one). What llama-bench
    -d (one sequence) and llama-batched-bench (B sequences) time."""
    from dist_glm5.model.kv_cache import Chunk
    from dist_glm5.model.reference_loop import blocks_needed

    B, chunk = len(prompts), 2048
    cache = model.new_cache(blocks_needed([len(p) + steps * repeats + 1 for p in prompts], 64), 64)
    toks, pos = [], [len(p) for p in prompts]
    with torch.no_grad():
        for i, p in enumerate(prompts):
            for a in range(0, len(p), chunk):
                b = cache.prepare([Chunk(i, a, min(chunk, len(p) - a))])
                h, _ = model(torch.tensor(p[a : a + chunk]), b, cache)
            toks.append(int(model.logits(model.final_norm(h[-1:])).argmax(-1)))

        def run():
            nonlocal toks
            for _ in range(steps):
                b = cache.prepare([Chunk(i, pos[i], 1) for i in range(B)])
                h, _ = model(torch.tensor(toks), b, cache)
                toks = model.logits(model.final_norm(h)).argmax(-1).tolist()
                for i in range(B):
                    pos[i] += 1

        t = best(run, repeats)
    for i in range(B):
        cache.release(i)
    return {"step_ms": 1e3 * t / steps, "decode_tok_s": B * steps / t}


def measure_hf(hf, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf(ids, use_cache=True)
        t_pre = best(lambda: hf(ids, use_cache=True), repeats)
        t_all = best(
            lambda: hf.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            ),
            repeats,
        )
    step = (t_all - t_pre) / (new_tokens - 1)
    return {"prefill_s": t_pre, "decode_ms": 1e3 * step, "decode_tok_s": 1 / step}


def bound_ms(cfg, context: int, bandwidth: float, experts_mxfp4: bool) -> tuple[float, float]:
    """(bytes, ms) a batch-1 decode step must read at `bandwidth` (computed)."""
    from dist_glm5.planning.roofline import HBM, decode_bytes

    (r,) = decode_bytes(
        cfg,
        1,
        context,
        1,
        1,
        HBM("this machine", bandwidth, 1),
        expert_bytes=0.53125 if experts_mxfp4 else 2,
        weight_bytes=2,
        idx_bytes=cfg.index_head_dim * 2,
        mla_bytes=cfg.kv_cache_dim * 2,
    )
    return r.total, 1e3 * r.total / bandwidth


def run(args: argparse.Namespace) -> int:
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.obs.bandwidth import read_bandwidth
    from dist_glm5.ops import reference_ops

    bf16_dir, mx_dir = small_model_dirs()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, SMALL["vocab_size"], (args.prompt_len,), generator=g).tolist()
    models = small_models()
    cfg = models["bf16"].cfg
    n_params = sum(t.numel() for t in models["bf16"].state_dict().values())
    hf = None
    if not args.no_hf:
        from transformers import GlmMoeDsaForCausalLM

        hf = GlmMoeDsaForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).eval()
    rows = []
    ctx = args.prompt_len + args.new_tokens // 2
    for nt in args.threads:
        bw = read_bandwidth(nt)
        torch.set_num_threads(nt)
        res = {"threads": nt, "bandwidth_gb_s": bw / 1e9}
        for name, m in models.items():
            res[name] = measure_ours(m, prompt, args.new_tokens, args.repeats)
            b, ms = bound_ms(cfg, ctx, bw, name == "mxfp4")
            res[name] |= {"bound_ms": ms, "bytes_per_step": b}
            res[name]["of_bound"] = res[name]["decode_ms"] / ms
        if args.reference_tokens > 1:
            ref = load_model(mx_dir, ops=reference_ops(), dsa=DSAConfig(mode="sparse"))
            res["mxfp4_reference"] = measure_ours(ref, prompt, args.reference_tokens, 1)
            del ref
        if hf is not None:
            res["hf_bf16"] = measure_hf(hf, prompt, args.new_tokens, args.repeats)
        rows.append(res)
        report(res)
    print(
        f"\nmodel: {n_params / 1e6:.0f}M parameters ({bf16_dir}); prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, batch 1; bounds are computed bytes over the measured "
        "bandwidth"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))
    return 0


def report(r: dict) -> None:
    nt = r["threads"]
    print(f"\n{nt} thread(s), read bandwidth {r['bandwidth_gb_s']:.1f} GB/s (measured)")
    print(
        f"  {'path':<18} {'decode tok/s':>12} {'step ms':>8} {'bound ms':>8} {'x bound':>7}"
        f" {'prefill s':>9}"
    )
    for name in ("mxfp4", "bf16", "mxfp4_reference", "hf_bf16"):
        if name not in r:
            continue
        x = r[name]
        bound = f"{x['bound_ms']:>8.2f} {x['of_bound']:>6.1f}x" if "bound_ms" in x else " " * 16
        print(
            f"  {name:<18} {x['decode_tok_s']:>12.1f} {x['decode_ms']:>8.1f} {bound}"
            f" {x['prefill_s']:>9.3f}"
        )
    mx, bf = r["mxfp4"], r["bf16"]
    print(
        f"  MXFP4 / BF16 decode {mx['decode_tok_s'] / bf['decode_tok_s']:.2f}x (goal >= 2); "
        f"prefill BF16 / MXFP4 {bf['prefill_s'] / mx['prefill_s']:.2f}x (goal >= 1)"
    )
    if "hf_bf16" in r:
        print(
            f"  MXFP4 / transformers BF16 decode "
            f"{mx['decode_tok_s'] / r['hf_bf16']['decode_tok_s']:.2f}x (goal >= 4)"
        )
    if "mxfp4_reference" in r:
        print(
            f"  MXFP4 kernel / dequantise-then-GEMM decode "
            f"{mx['decode_tok_s'] / r['mxfp4_reference']['decode_tok_s']:.2f}x"
        )
