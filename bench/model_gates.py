"""`dist-glm5 bench model-gates`: the default model (or --model) against what a newcomer sees, each
figure beside its gate, through the product's own doors:
- code: greedy continuation of a short Python snippet (`/v1/completions`): the text, whether its
  lines read as Python (indentation, then a name, keyword, string, comment or bracket) and the
  longest run of spaces that is not indentation;
- tools: 21 chat requests through the openai client against `launch single-node`, named and
  required tool_choice, functions taking free strings and integers: finish_reason "tool_calls";
- json_object: 10 requests, the reply parses as an object; json_schema: 10 schemas of free
  strings (and one integer), the reply validates (`jsonschema`);
- needles (held-out keys and values in held-out code, through two stages on the sparse path,
  answers equal to the dense reference path's) and MTP acceptance and speed-up:
  bench/quality.py's, rerun here.

Budget: a byte tokenizer spends a token on every byte the grammar forces (a one-argument call
is 65 bytes of tags), so each request gets the bytes its skeleton forces (the tags, names and keys
of a call, the keys and punctuation of a schema's object) plus 64 tokens of the model's own.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)
FREE_TOKENS = 64
SNIPPET = '''import os


def list_files(root):
    """Return the path of every file under root."""
    result = []
    for dirpath, dirnames, filenames in os.walk(root):
'''
GATES = {
    "tools": 19 / 21,
    "json_object": 9 / 10,
    "json_schema": 9 / 10,
    "needles": 5 / 6,
    "mtp_acceptance": 0.75,
}


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the shipped one)")
    p.add_argument("--only", nargs="*", default=["code", "api", "needles", "mtp"])
    p.add_argument("--needle-lengths", type=int, nargs="*", default=[4096, 16384, 65536])
    p.add_argument("--gate-lengths", type=int, nargs="*", default=[4096, 16384])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--index-keys",
        choices=["exact", "int8"],
        default="exact",
        help="the needles' sparse runs with these index keys (the reference's stay exact)",
    )
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.set_defaults(func=run)


# ---- the requests ------------------------------------------------------------------------------
def schema_of(props: dict, closed: bool = False) -> dict:
    """An object schema of {key: JSON type}, every key required; closed: no other keys."""
    s = {
        "type": "object",
        "properties": {k: {"type": t} for k, t in props.items()},
        "required": list(props),
    }
    return {**s, "additionalProperties": False} if closed else s


def _fn(fname: str, **props: str) -> dict:
    return {"type": "function", "function": {"name": fname, "parameters": schema_of(props)}}


TOOL_CASES = [  # (tools, the one to call, the user's message)
    ([_fn("get_weather", city="string")], "get_weather", "What is the weather in Oslo?"),
    ([_fn("add_items", count="integer")], "add_items", "Add 3 items to my list."),
    ([_fn("send_message", to="string", text="string")], "send_message", "Tell Ada hello."),
    ([_fn("set_limit", limit="integer", unit="string")], "set_limit", "Limit it to 20 per day."),
    (
        [_fn("find_user", name="string"), _fn("add_items", count="integer")],
        "find_user",
        "Who is Tim?",
    ),
    ([_fn("resize", width="integer", height="integer")], "resize", "Make it 640 by 480."),
    ([_fn("open_file", path="string")], "open_file", "Open the config file."),
]
JSON_PROMPTS = [
    "Give me a JSON object describing a cat.",
    "Return the settings as JSON.",
    "A JSON object with a name and an age, please.",
    "Describe Paris in JSON.",
    "List two colors in JSON.",
    "Reply in JSON.",
    "What is 2 + 2? Answer in JSON.",
    "A user record as JSON.",
    "Make a JSON config for a server.",
    "Summarise this in JSON: the sky is blue.",
]
SCHEMAS = [
    {"name": "string", "city": "string"},
    {"title": "string"},
    {"user": "string", "email": "string"},
    {"path": "string", "mode": "string"},
    {"word": "string", "count": "integer"},
    {"first": "string", "last": "string"},
    {"color": "string"},
    {"key": "string", "value": "string"},
    {"host": "string", "port": "integer"},
    {"language": "string", "file": "string"},
]


def tool_requests() -> list[dict]:
    """21 requests: each case named, required, and named again with the function listed second."""
    from dist_glm5.checkpoint.byte_chat import glm_call

    out = []
    for tools, name, msg in TOOL_CASES:
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        skeleton = glm_call(
            {"name": name, "arguments": dict.fromkeys(fn["parameters"]["required"], "")}
        )
        named = {"type": "function", "function": {"name": name}}
        for choice, listed in ((named, tools), ("required", [tools[0]]), (named, tools[::-1])):
            if choice == "required" and tools[0]["function"]["name"] != name:
                listed = [t for t in tools if t["function"]["name"] == name]
            out.append(
                dict(
                    messages=[{"role": "user", "content": msg}],
                    tools=listed,
                    tool_choice=choice,
                    max_tokens=len(skeleton) + FREE_TOKENS,
                    temperature=0,
                )
            )
    return out


# ---- checks ------------------------------------------------------------------------------------
_PY_LINE = re.compile(r"^\s*([A-Za-z_#@\"'(\[\])}]|$)")


def longest_repeat(text: str) -> int:
    """The most times a phrase of 1-3 words follows itself back to back (`the the the`, and p4's
    `the path the path the path`): a loop, where no line of Python says one thing three times."""
    best = 1
    for k in (1, 2, 3):
        phrase = r"[A-Za-z_]\w*" + r"[ \t]+[A-Za-z_]\w*" * (k - 1)
        for m in re.finditer(rf"\b({phrase})(?:[ \t]+\1\b)+", text):
            best = max(best, len(m.group(0).split()) // k)
    return best


def longest_line_repeat(text: str, period_max: int = 4) -> int:
    """The most times a block of 1..period_max lines, not all blank, follows itself back to back
    (p4u's `        return the path.` three times and more; v2's `if self._alk(self):` and its
    body, two lines, at step 2,700): a loop of lines, which longest_repeat's words on one line
    do not see. A block the budget cut short counts when its lines are the block's, the last one
    a non-blank prefix of the block's."""
    lines, best = text.split("\n"), 1
    n = len(lines)
    for p in range(1, period_max + 1):
        for i in range(n - p + 1):
            block = lines[i : i + p]
            if not any(line.strip() for line in block):
                continue
            reps, j = 1, i + p
            while lines[j : j + p] == block:
                reps, j = reps + 1, j + p
            rest = lines[j:]  # the text's end, when shorter than a block: a cut repeat?
            k = len(rest)
            if 0 < k <= p and rest[:-1] == block[: k - 1] and rest[-1].strip():
                reps += block[k - 1].startswith(rest[-1])
            best = max(best, reps)
    return best


def code_check(text: str) -> dict:
    """Do the lines read as Python, how long is the longest run of spaces past indentation, and
    does a phrase or a line repeat back to back (`return the the the ...`: indented right, and a
    loop, not Python: longest_repeat, longest_line_repeat)."""
    lines = text.split("\n")
    pythonic = sum(bool(_PY_LINE.match(line)) for line in lines)
    inner = [m.group(0) for line in lines for m in re.finditer(r" {2,}", line.lstrip(" "))]
    # a line of spaces only indents nothing: the whole line is a run (but the last line, up to
    # 16 spaces, may be an indentation the budget cut short)
    body = lines[:-1] if len(lines[-1]) <= 16 else lines
    inner += [x for x in body if x and not x.strip(" ")]
    longest = max((len(s) for s in inner), default=0)
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]{2,}", text)
    repeats = max(longest_repeat(text), longest_line_repeat(text))
    return {
        "lines": len(lines),
        "python_lines": pythonic,
        "longest_inner_spaces": longest,
        "names": len(words),
        "distinct_names": len(set(words)),
        "longest_repeat": repeats,
        "pass": pythonic == len(lines)
        and longest < 4
        and len(words) >= 5
        and len(set(words)) >= 3
        and repeats < 3,
    }


# ---- the server --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "dist_glm5.launch.cli",
        "launch",
        "single-node",
        "--port",
        str(port),
    ]
    cmd += ["--threads", str(threads)] + (["--model", model] if model else [])
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            urllib.request.urlopen(url + "/models", timeout=5)
            return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not answer /v1/models within 600 s")


def api_gates(url: str) -> dict:
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    out: dict = {}

    def tool(req):
        r = client.chat.completions.create(model=model, **req)
        c = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return {"finish": c.finish_reason, "calls": calls, "content": c.message.content}

    def json_obj(prompt):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_object"},
            max_tokens=FREE_TOKENS + 2,
            temperature=0,
        )
        text = r.choices[0].message.content
        try:
            ok = isinstance(json.loads(text), dict)
        except ValueError:
            ok = False
        return {"text": text, "finish": r.choices[0].finish_reason, "ok": ok}

    def json_schema(props):
        schema = schema_of(props, closed=True)
        skeleton = json.dumps(dict.fromkeys(props, ""), separators=(",", ":"))
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Fill in: " + ", ".join(props)}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "gate", "schema": schema},
            },
            max_tokens=len(skeleton) + FREE_TOKENS,
            temperature=0,
        )
        text = r.choices[0].message.content
        try:
            jsonschema.validate(json.loads(text), schema)
            ok = True
        except (ValueError, jsonschema.ValidationError):
            ok = False
        return {"text": text, "finish": r.choices[0].finish_reason, "ok": ok}

    # one request first, alone: pydantic builds the client's response model on first use, and
    # threads doing that at once raise (openai 3.57, pydantic 2.13: "ChatCompletion has no
    # attribute __pydantic_core_schema__")
    reqs = list(tool_requests())
    first = tool(reqs[0])
    with ThreadPoolExecutor(8) as pool:
        tools = [first, *pool.map(tool, reqs[1:])]
        objs = list(pool.map(json_obj, JSON_PROMPTS))
        schemas = list(pool.map(json_schema, SCHEMAS))
    closed = sum(t["finish"] == "tool_calls" for t in tools)
    out["tools"] = {"closed": closed, "of": len(tools), "replies": tools}
    out["json_object"] = {"parsed": sum(o["ok"] for o in objs), "of": len(objs), "replies": objs}
    out["json_schema"] = {
        "validated": sum(o["ok"] for o in schemas),
        "of": len(schemas),
        "replies": schemas,
    }
    r = client.completions.create(model=model, prompt=SNIPPET, max_tokens=96, temperature=0)
    text = r.choices[0].text
    out["code"] = {"prompt": SNIPPET, "text": text, **code_check(text)}
    return out


# ---- the run -----------------------------------------------------------------------------------
def verdicts(res: dict) -> dict:
    v = {}
    if "api" in res:
        a = res["api"]
        v["code"] = a["code"]["pass"]
        v["tools"] = a["tools"]["closed"] / a["tools"]["of"] >= GATES["tools"]
        v["json_object"] = (
            a["json_object"]["parsed"] / a["json_object"]["of"] >= GATES["json_object"]
        )
        v["json_schema"] = (
            a["json_schema"]["validated"] / a["json_schema"]["of"] >= GATES["json_schema"]
        )
    if "needles" in res:
        n, found, equal = res["needles"], 0, True
        for length in res["gate_lengths"]:
            sparse = n[f"{length}_code_sparse_2stages"]
            found += sparse["found"]
            ref = n.get(f"{length}_code_reference")
            equal &= ref is not None and ref["got"] == sparse["got"]
        v["needles"] = found / (3 * len(res["gate_lengths"])) >= GATES["needles"] and equal
    if "mtp" in res:
        m = res["mtp"]
        v["mtp"] = (
            m["greedy_mtp"]["acceptance"] >= GATES["mtp_acceptance"] and m["greedy_speedup"] > 1
        )
    return v


def summary(res: dict) -> str:
    """One line per gate: the figure, the gate, pass or FAIL."""
    v, lines = res["pass"], []

    def line(name: str, figure: str, gate: str) -> None:
        lines.append(f"{name:12} {figure:34} gate {gate:14} {'pass' if v[name] else 'FAIL'}")

    if "api" in res:
        a = res["api"]
        c = a["code"]
        fig = f"{c['python_lines']}/{c['lines']} lines, {c['names']} names, spaces "
        line("code", fig + str(c["longest_inner_spaces"]), "py, 5 names, < 4")
        line("tools", f"{a['tools']['closed']}/{a['tools']['of']} closed", "19/21")
        line("json_object", f"{a['json_object']['parsed']}/{a['json_object']['of']} parse", "9/10")
        js = a["json_schema"]
        line("json_schema", f"{js['validated']}/{js['of']} validate", "9/10")
    if "needles" in res:
        n = res["needles"]
        found = []
        for length in sorted({int(k.split("_")[0]) for k in n if k[0].isdigit()}):
            r = n.get(f"{length}_code_sparse_2stages")
            if r:  # misses that are another needle's value: the key matched to the wrong one
                swapped = f" ({r['other_needle']} swapped)" if r.get("other_needle") else ""
                found.append(f"{length}: {r['found']}/3{swapped}")
        line("needles", ", ".join(found), "5/6 at gates")
    if "mtp" in res:
        m = res["mtp"]
        fig = (
            f"accept {m['greedy_mtp']['acceptance']} +- {m['greedy_mtp']['acceptance_se']}, "
            f"{m['greedy_speedup']}x (a step costs "
            f"{m['greedy_step_cost_ratio']}x: pays past {m['greedy_break_even_acceptance']})"
        )
        line("mtp", fig, ">= 0.75, > 1x")
        if "greedy_draft_kinds" in m:  # what the acceptance is made of (teacher-forced)
            dk = m["greedy_draft_kinds"]
            kinds = ", ".join(
                f"{k} {v['agreement']} ({v['share']:.0%} of drafts)"
                for k, v in dk["by_kind"].items()
            )
            lines.append(f"{'':13}teacher-forced {dk['agreement']}: {kinds}")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    from dist_glm5.checkpoint.default_model import ensure_default_model

    from . import quality

    logging.basicConfig(level=logging.INFO)
    missing = sorted(set(args.gate_lengths) - set(args.needle_lengths))
    if "needles" in args.only and missing:  # checked before minutes of needles, not after
        raise SystemExit(
            f"--gate-lengths {missing} are not among --needle-lengths {args.needle_lengths}: "
            "the needle gate is judged on measured lengths (e.g. --needle-lengths 4096 "
            "--gate-lengths 4096)"
        )
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_default_model()
    res: dict = {"model": str(model_dir), "gate_lengths": args.gate_lengths, "gates": GATES}
    if "code" in args.only or "api" in args.only:
        proc, url = start_server(str(model_dir), args.threads)
        try:
            res["api"] = api_gates(url)
        finally:
            proc.terminate()
            proc.wait(60)
        log.info("code: %r", res["api"]["code"]["text"])
    if "mtp" in args.only:
        # 32 prompts x 64 tokens (~1,500 drafts): a standard error near 0.01, where 6 x 32
        # (~110) left 0.04 and could not tell 0.71 from 0.75
        res["mtp"] = quality.mtp_figures(model_dir, quality.heldout_texts(), 64, n_prompts=32)
    if "needles" in args.only:
        import ray

        from dist_glm5.stages.ray_pipeline import local_cluster

        cluster = local_cluster(2, cpus_per_node=2)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        try:
            res["needles"] = quality.needles(
                model_dir, args.needle_lengths, 2, max(args.gate_lengths), args.index_keys
            )
        finally:
            ray.shutdown()
            cluster.shutdown()
    res["pass"] = verdicts(res)
    text = json.dumps(res, indent=1)
    print(text)
    print(summary(res))
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0
