"""`bench peers`' parts that need no llama.cpp build: the tokenizer it gives the small model (what
llama.cpp's converter requires of it) and the parsers of llama-bench / llama-batched-bench output
(samples cut from real runs of b11434 on this machine)."""

from __future__ import annotations

import sys

import pytest

from dist_glm5.bench import peers
from dist_glm5.bench.peers import (
    GLM_SPECIALS,
    PeerFailed,
    check_types,
    parse_batched_bench,
    parse_llama_bench,
    prepare_tokenizer,
)


def test_tokenizer_has_the_models_vocab_and_glms_specials_last(tmp_path):
    from transformers import AutoTokenizer

    prepare_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 8192
    assert max(tok.vocab.values()) == 8191  # the converter asserts every id < vocab_size
    assert tok.convert_ids_to_tokens(list(range(8188, 8192))) == list(GLM_SPECIALS)
    added = tok.get_added_vocab()  # the GLM path looks these up by name
    assert [added[s] for s in GLM_SPECIALS] == [8188, 8189, 8190, 8191]
    text = "Hello world, I've 12345 things: 我想 🦙\n\tdone"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: any text round-trips
    assert max(ids) < 8188
    # GLM-4's split: digits in groups of at most three, contractions on their own
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("I've 12345")
    assert [p for p, _ in pieces] == ["I", "'ve", "Ġ", "123", "45"]


def test_tokenizer_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    prepare_tokenizer(a)
    prepare_tokenizer(b)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


# two records of `llama-bench -m small-bf16.gguf -t 1 -r 3 -p 128 -n 32 -d 0,128,4096 -o json`
# (pp128 at depth 0, tg32 at depth 4096), verbatim but for the model's directory
LLAMA_BENCH_JSON = """
[
 {"build_commit": "unknown", "build_number": 11434, "cpu_info": "AMD EPYC", "gpu_info": "",
  "backends": "CPU",
  "model_filename": "DIST_GLM5_HOME/peers/llama.cpp-b11434/gguf/small-bf16.gguf",
  "model_type": "glm-dsa ?B BF16", "model_size": 1507940096, "model_n_params": 753423808,
  "n_batch": 2048, "n_ubatch": 512, "n_threads": 1, "cpu_mask": "0x0", "cpu_strict": false,
  "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "n_cpu_moe": 0,
  "split_mode": "layer", "main_gpu": 0, "no_kv_offload": false, "flash_attn": -1,
  "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none",
  "load_mode": "auto", "lazy_mode": "auto", "embeddings": false, "no_op_offload": 0,
  "no_host": false, "repack": true, "fit_target": 0, "fit_min_ctx": 0, "n_prompt": 128,
  "n_gen": 0, "n_depth": 0, "test_time": "2026-12-01T20:44:39Z", "avg_ns": 1337892923,
  "stddev_ns": 34917167, "avg_ts": 95.71621, "stddev_ts": 2.493612,
  "samples_ns": [1303962061, 1335997557, 1373719152], "samples_ts": [98.1624, 95.8086, 93.1777]},
 {"build_commit": "unknown", "build_number": 11434, "cpu_info": "AMD EPYC", "gpu_info": "",
  "backends": "CPU",
  "model_filename": "DIST_GLM5_HOME/peers/llama.cpp-b11434/gguf/small-bf16.gguf",
  "model_type": "glm-dsa ?B BF16", "model_size": 1507940096, "model_n_params": 753423808,
  "n_batch": 2048, "n_ubatch": 512, "n_threads": 1, "cpu_mask": "0x0", "cpu_strict": false,
  "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "n_cpu_moe": 0,
  "split_mode": "layer", "main_gpu": 0, "no_kv_offload": false, "flash_attn": -1,
  "devices": "auto", "tensor_split": "0.00", "tensor_buft_overrides": "none",
  "load_mode": "auto", "lazy_mode": "auto", "embeddings": false, "no_op_offload": 0,
  "no_host": false, "repack": true, "fit_target": 0, "fit_min_ctx": 0, "n_prompt": 0,
  "n_gen": 32, "n_depth": 4096, "test_time": "2026-12-01T20:46:15Z", "avg_ns": 971225699,
  "stddev_ns": 116858511, "avg_ts": 33.259251, "stddev_ts": 3.887018,
  "samples_ns": [1098148846, 868093028, 947435225], "samples_ts": [29.1399, 36.8624, 33.7754]}
]
"""
# `llama-batched-bench -m small-bf16.gguf -c 8192 -t 1 -npp 128 -ntg 32 -npl 1,8,32`'s stdout
BATCHED_BENCH_TEXT = (
    "\nllama_batched_bench: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, "
    "is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1\n"
    """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     32 |    1 |    160 |    1.349 |    94.88 |    0.828 |    38.64 |    2.177 |    73.49 |
|   128 |     32 |    8 |   1280 |   10.968 |    93.36 |    4.720 |    54.24 |   15.688 |    81.59 |
|   128 |     32 |   32 |   5120 |   44.993 |    91.04 |   14.206 |    72.08 |   59.200 |    86.49 |

"""
)


def test_parse_llama_bench():
    assert parse_llama_bench(LLAMA_BENCH_JSON) == [
        {
            "test": "pp",
            "tokens": 128,
            "depth": 0,
            "threads": 1,
            "tok_s": 95.71621,
            "stddev": 2.493612,
        },
        {
            "test": "tg",
            "tokens": 32,
            "depth": 4096,
            "threads": 1,
            "tok_s": 33.259251,
            "stddev": 3.887018,
        },
    ]


def test_parse_batched_bench():
    rows = parse_batched_bench(BATCHED_BENCH_TEXT)
    assert [(r["b"], r["n_kv"], r["s_tg"]) for r in rows] == [
        (1, 160, 38.64),
        (8, 1280, 54.24),
        (32, 5120, 72.08),
    ]
    assert rows[0] == {
        "pp": 128,
        "tg": 32,
        "b": 1,
        "n_kv": 160,
        "t_pp": 1.349,
        "s_pp": 94.88,
        "t_tg": 0.828,
        "s_tg": 38.64,
        "t": 2.177,
        "s": 73.49,
    }
    assert parse_batched_bench("llama_batched_bench: n_kv_max = 8192\n\nmain: done\n") == []


def test_check_types_refuses_a_file_that_is_not_what_its_name_says():
    ok = {"blk.1.ffn_up_exps.weight": "MXFP4", "blk.1.attn_q_a.weight": "BF16", "n.weight": "F32"}
    check_types("mxfp4-experts", ok)
    with pytest.raises(PeerFailed):
        check_types("mxfp4-experts", ok | {"blk.1.attn_q_a.weight": "Q8_0"})
    with pytest.raises(PeerFailed):
        check_types("bf16", ok)
    with pytest.raises(PeerFailed):
        check_types("mxfp4_moe", ok)  # MXFP4_MOE makes the other 2-D weights Q8_0


def test_table_pairs_each_llama_row_with_ours_at_the_same_depth_and_batch():
    import argparse

    from dist_glm5.bench.peers import table

    lc = {
        "bench": parse_llama_bench(LLAMA_BENCH_JSON),  # pp 128 @ 0, tg 32 @ 4096
        "batched": parse_batched_bench(BATCHED_BENCH_TEXT),  # B = 1, 8, 32
    }
    ours = {"decode_tok_s": 20.0, "prefill_tok_s": 100.0, "depth": {4096: 16.0}}
    ours["batched"] = {8: 80.0}  # B = 32 not run
    res = {"threads": {1: {"ours": {"bf16": ours}, "llama": {"bf16": lc}}}}
    rows = {r["what"]: r for r in table(res, argparse.Namespace(formats=["bf16"]))}
    assert rows["prefill 128"]["ratio"] == pytest.approx(100.0 / 95.71621)
    assert rows["decode 32 @ depth 4096"]["ratio"] == pytest.approx(16.0 / 33.259251)
    assert rows["batched decode B=1"]["ratio"] == pytest.approx(20.0 / 38.64)
    assert rows["batched decode B=8"]["ratio"] == pytest.approx(80.0 / 54.24)
    assert rows["batched decode B=32"]["ratio"] is None
    assert rows["batched decode B=32"]["not_measured"] == "not run at this batch"


def test_table_pairs_each_prefill_length_with_ours():
    import argparse

    from dist_glm5.bench.peers import table

    pp4k = {"test": "pp", "tokens": 4096, "depth": 0, "threads": 1, "tok_s": 50.0, "stddev": 0}
    lc = {"bench": parse_llama_bench(LLAMA_BENCH_JSON) + [pp4k], "batched": []}
    mine = {"decode_tok_s": 20.0, "prefill_tok_s": 100.0, "depth": {}, "batched": {}}
    ours = {"bf16": {**mine, "prefill": {4096: 60.0}}, "mxfp4": mine}  # mxfp4: 4096 not run
    per = {"ours": ours, "llama": {f: lc for f in ("bf16", "mxfp4_moe")}}
    rows = table({"threads": {1: per}}, argparse.Namespace(formats=["bf16", "mxfp4_moe"]))
    got = {(r["ours_format"], r["what"]): r for r in rows}
    assert got[("bf16", "prefill 128")]["ratio"] == pytest.approx(100.0 / 95.71621)
    assert got[("bf16", "prefill 4096")]["ratio"] == pytest.approx(60.0 / 50.0)
    assert got[("mxfp4", "prefill 4096")]["ratio"] is None
    assert got[("mxfp4", "prefill 4096")]["not_measured"] == "not run at this length"


def test_table_pairs_ours_w4a8_with_llama_cpp_mxfp4_files_only():
    import argparse

    from dist_glm5.bench.peers import table

    lc = {"bench": parse_llama_bench(LLAMA_BENCH_JSON), "batched": []}
    mine = {"decode_tok_s": 20.0, "prefill_tok_s": 100.0, "depth": {4096: 16.0}, "batched": {}}
    ours = {"bf16": mine, "mxfp4": mine, "w4a8": {**mine, "depth": {4096: 32.0}}}
    per = {"ours": ours, "llama": {f: lc for f in ("bf16", "mxfp4_moe")}}
    rows = table({"threads": {1: per}}, argparse.Namespace(formats=["bf16", "mxfp4_moe"]))
    pairs = {(r["llama_format"], r["ours_format"]) for r in rows}
    assert pairs == {("bf16", "bf16"), ("mxfp4_moe", "mxfp4"), ("mxfp4_moe", "w4a8")}
    deep = [r for r in rows if r["ours_format"] == "w4a8" and "4096" in r["what"]]
    assert deep[0]["ratio"] == pytest.approx(32.0 / 33.259251)


def test_measure_ours_steps_decodes_greedy_tokens_after_each_prompt(default_model):
    # the aggregate step it times continues each sequence where its prompt ended: the same
    # greedy tokens as the reference loop's generate (checked through a spy on the model)
    import torch

    from dist_glm5.bench.decode import measure_ours_steps
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(0, 256, (2, 70), generator=g).tolist()
    seen = []
    real = default_model.forward

    def spy(x, batch, cache, *a, **k):
        if all(c.length == 1 for c in batch.chunks):
            seen.append(x.tolist())
        return real(x, batch, cache, *a, **k)

    default_model.forward = spy
    try:
        r = measure_ours_steps(default_model, prompts, steps=3, repeats=1)
    finally:
        del default_model.forward
    assert r["decode_tok_s"] > 0 and len(seen) == 3
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    want = [x.token_ids for x in generate(default_model, prompts, greedy)]
    # step k feeds each sequence's token k (the first from the prompt's last logits)
    assert [list(col) for col in zip(*seen)] == want


def test_measure_prefill_times_a_prompt_to_its_first_token(default_model):
    from dist_glm5.bench.decode import measure_prefill

    prompt = list(range(3, 200))
    assert 0 < measure_prefill(default_model, prompt, repeats=2) < 60


def test_best_of_keeps_each_sides_faster_round_per_row():
    from dist_glm5.bench.peers import best_of

    a = {
        "ours": {"mxfp4": {"decode_tok_s": 100.0, "batched": {8: 300.0, 32: 500.0}}},
        "llama": {"bf16": {"bench": [{"tok_s": 90.0, "depth": 128}], "batched": [{"s_tg": 200.0}]}},
    }
    b = {
        "ours": {"mxfp4": {"decode_tok_s": 120.0, "batched": {8: 280.0, 32: 520.0}}},
        "llama": {"bf16": {"bench": [{"tok_s": 80.0, "depth": 128}], "batched": [{"s_tg": 210.0}]}},
    }
    m = best_of(a, b)
    assert m["ours"]["mxfp4"] == {"decode_tok_s": 120.0, "batched": {8: 300.0, 32: 520.0}}
    assert m["llama"]["bf16"]["bench"] == [{"tok_s": 90.0, "depth": 128}]
    assert m["llama"]["bf16"]["batched"] == [{"s_tg": 210.0}]


def test_a_llama_tool_killed_by_sigill_runs_again_with_repacking_off():
    """b11434's AMX Q8_0 kernels die with SIGILL (or SIGSEGV) on our Intel Xeon VM (the
    MXFP4_MOE file's Q8_0 weights); the bench runs the tool again with its repacking flag and
    says so. A stand-in tool that kills itself unless given the flag; other failures still stop
    the bench, with the signal named."""
    tool = (
        "import os, signal, sys\n"
        "if '--off' not in sys.argv: os.kill(os.getpid(), signal.SIGILL)\n"
        "print('rows')"
    )
    assert peers._run_llama([sys.executable, "-c", tool], ["--off"]) == ("rows\n", True)
    ok = [sys.executable, "-c", "print('rows')"]
    assert peers._run_llama(ok, ["--off"]) == ("rows\n", False)
    abort = "import os, signal\nos.kill(os.getpid(), signal.SIGABRT)"
    with pytest.raises(peers.PeerFailed, match="killed by SIGABRT"):
        peers._run_llama([sys.executable, "-c", abort], ["--off"])
    again = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"  # with the flag too
    with pytest.raises(peers.PeerFailed, match="killed by SIGSEGV"):
        peers._run_llama([sys.executable, "-c", again], ["--off"])
