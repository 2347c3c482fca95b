"""`dist-glm5 bench link-faults`: two-node serving while the link between the nodes misbehaves.

    dist-glm5 bench link-faults                           # delay, loss, cut; nodes up and down
    dist-glm5 bench link-faults --faults cut --cut-seconds 40 --keep-nodes

The two nodes are `dist-glm5 bench netns`'s (brought up here unless they already are; torn down
at the end unless --keep-nodes). A server, `launch two-node --address HEAD:6379 --host HEAD_IP`
on the embedded model with a small --ctx, serves in the head namespace with one stage on each
node (its "pipeline up ... on nodes {...}" log line is checked for two distinct node ids). The
client runs in this process, in a thread moved into the head namespace (it reaches the server
there); `--concurrency` workers send greedy /v1/completions (a few fixed prompts, `--max-tokens`
each, ignore_eos) with token ids in the response.

1. Fault-free: each prompt once; its token ids are the reference.
2. Per fault, `--requests` requests (no new one after `--phase-seconds`; each given up on after
   `--request-timeout`):
   (a) delay: `--delay-ms` (200) on every packet, each direction, for the whole phase;
   (b) loss: `--loss` (5%) of the packets dropped, each direction, for the whole phase;
   (c) cut: the head's end of the link set down `--cut-after` seconds after the phase's first
       request (mid-decode: a fault-free request takes about a second), up again
       `--cut-seconds` later.
   A request is exact (its token ids equal the reference), failed with an error that names the
   stage ("stage N rank R failed: ...") within the timeout (acceptable), or a violation: wrong
   tokens, an error that names no stage, or no answer within --request-timeout ("hung").
   Time to recover: from the fault's end (the qdisc removed, the link up again) to the first
   exact answer, the phase's own or, if none came after it, a probe request's (one a second;
   given up after `--recover-seconds`). When the cut outlasted
   Ray's health checks, the head declares the worker node dead and its raylet exits when the
   link returns; with --rejoin (default) the node is started again (`ray start --address`) and
   the table says so.

Faults on the link: tc netem on both veth ends where the kernel has netem (CONFIG_NET_SCH_NETEM);
where it does not (this machine's kernel), `--link auto` makes the link a tun device in each
namespace joined by netns's userspace forwarder, which applies the same delay and loss per
direction. The cut is `ip link set <head end> down` on either link.

Timeouts: the server gets `--step-timeout` and `--heartbeat-timeout` when `launch two-node`
has those flags. TODO(issue 24): until they land, the server runs with the coordinator's
default step timeout (300 s) and no heartbeat: the request timeout defaults to 360 s then.

Prints one table row per fault: requests, exact, failed (with the first message), violations,
max latency, time to recover. Exit status 1 when any fault had a violation or did not recover.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import netns, serve

log = logging.getLogger(__name__)

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land",
    "def fibonacci(n):",
    "The capital of France is",
    "In 1492, Columbus",
    "Water boils at",
]
STAGE_RE = re.compile(r"stage \d+ rank \d+")
DEFAULT_STEP_TIMEOUT = 300.0  # the coordinator's, while launch has no --step-timeout


def register(p: argparse.ArgumentParser) -> None:
    netns.add_topology_args(p, link_default="auto")
    p.add_argument(
        "--faults",
        default="delay,loss,cut",
        help="comma-separated, in order, from: delay, loss, cut",
    )
    p.add_argument("--delay-ms", type=float, default=200.0, help="delay of every packet")
    p.add_argument("--loss", type=float, default=0.05, help="fraction of the packets dropped")
    p.add_argument("--cut-after", type=float, default=2.0, help="cut: s after the first request")
    p.add_argument("--cut-seconds", type=float, default=10.0, help="cut: how long the link is down")
    p.add_argument("--requests", type=int, default=8, help="requests per fault")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--phase-seconds", type=float, default=180.0, help="no new request after this")
    p.add_argument("--step-timeout", type=float, default=20.0, help="the server's, if it has it")
    p.add_argument(
        "--heartbeat-timeout", type=float, default=5.0, help="the server's, if it has it"
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=45.0,
        help="the server's pipeline (re)start timeout: a restart attempt during a cut gives up "
        "after it and the next one tries again",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        help="a request not answered within this is 'hung' (default: step + heartbeat timeout "
        "+ 30 s, or 360 s while launch has no --step-timeout)",
    )
    p.add_argument("--recover-seconds", type=float, default=300.0, help="give up recovering after")
    p.add_argument("--port", type=int, default=8000, help="the server's port (head namespace)")
    p.add_argument("--ctx", default="4k", help="the server's --ctx")
    p.add_argument("--server-args", default="", help="more `launch two-node` flags")
    p.add_argument(
        "--no-rejoin",
        dest="rejoin",
        action="store_false",
        help="do not restart a worker node the head declared dead",
    )
    p.add_argument("--keep-nodes", action="store_true", help="leave the two nodes up at the end")
    p.add_argument("--output", help="write the results as JSON here")
    p.set_defaults(func=run)


# ---- the server --------------------------------------------------------------------------------


def launch_flags() -> set[str]:
    """The flags `launch two-node` has now (the timeout flags are being added)."""
    r = subprocess.run(
        [sys.executable, "-m", "dist_glm5.launch.cli", "launch", "two-node", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return set(re.findall(r"--[a-z][a-z-]+", r.stdout))


def server_command(t: netns.Topology, args: argparse.Namespace, flags: set[str]) -> list[str]:
    cmd = [sys.executable, "-m", "dist_glm5.launch.cli", "--log-level", "INFO", "launch"]
    cmd += ["two-node", "--address", t.address, "--host", t.head_ip, "--port", str(args.port)]
    cmd += ["--ctx", str(args.ctx)]
    if "--step-timeout" in flags:
        cmd += ["--step-timeout", f"{args.step_timeout:g}"]
    if "--heartbeat-timeout" in flags:
        cmd += ["--heartbeat-timeout", f"{args.heartbeat_timeout:g}"]
    if "--startup-timeout" in flags:
        cmd += ["--startup-timeout", f"{args.startup_timeout:g}"]
    return cmd + args.server_args.split()


class Server(serve.Server):
    """`launch two-node` in the head namespace; its stderr kept in a file for the placement (its
    own start: a timeout and the namespace; bench serve's close)."""

    def __init__(self, t: netns.Topology, cmd: list[str], log_path: Path, timeout: float = 300):
        self.log_path = log_path
        self.err = open(log_path, "w")
        self.p = subprocess.Popen(
            netns.ns_exec(t.head_ns, cmd, netns.cluster_env(t)),
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            self.close()
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"the server did not become ready in {timeout:.0f}s:\n{tail}")
        ready = json.loads(box[0])
        self.url, self.model = ready["url"], ready["model"]

    def placements(self) -> list[dict[int, str]]:
        """Every "pipeline up ... on nodes {...}" the server logged (one per (re)start)."""
        out = []
        for m in re.finditer(r"pipeline up: .* on nodes (\{.*\})", self.log_path.read_text()):
            out.append(dict(re.findall(r"(\d+): '([0-9a-f]+)'", m.group(1))))
        return out

    def close(self) -> None:
        super().close()  # terminate, then kill after 30 s
        self.err.close()


# ---- the client --------------------------------------------------------------------------------


@dataclass
class Result:
    prompt: int
    sent: float  # seconds since the phase began
    latency: float = 0.0
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    status: str = ""  # exact | failed | wrong | unnamed | hung


def request(http, url: str, model: str, prompt: int, max_tokens: int, timeout: float) -> Result:
    import httpx

    body = {
        "model": model,
        "prompt": PROMPTS[prompt],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = Result(prompt, 0.0)
    t0 = time.monotonic()
    try:
        resp = http.post(f"{url}/completions", json=body, timeout=timeout)
        if resp.status_code == 200:
            r.tokens = resp.json()["choices"][0]["token_ids"]
        else:
            try:
                r.error = f"HTTP {resp.status_code}: {resp.json()['error']['message']}"
            except Exception:
                r.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
    except httpx.TimeoutException:
        r.error, r.status = f"no answer within {timeout:.0f}s", "hung"
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
    r.latency = time.monotonic() - t0
    return r


def judge(r: Result, reference: dict[int, list[int]]) -> Result:
    if r.status == "hung":
        return r
    if r.error:
        r.status = "failed" if STAGE_RE.search(r.error) else "unnamed"
    else:
        r.status = "exact" if r.tokens == reference[r.prompt] else "wrong"
    return r


def phase(
    http, url: str, model: str, args, reference: dict[int, list[int]], timeout: float
) -> tuple[list[Result], float]:
    """`--requests` requests over `--concurrency` workers; none started after --phase-seconds."""
    t0 = time.monotonic()
    todo = list(range(args.requests))
    lock = threading.Lock()
    results: list[Result] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo or time.monotonic() - t0 > args.phase_seconds:
                    return
                i = todo.pop(0)
            sent = time.monotonic() - t0
            r = request(http, url, model, i % len(PROMPTS), args.max_tokens, timeout)
            r.sent = sent
            with lock:
                results.append(judge(r, reference))

    with cf.ThreadPoolExecutor(args.concurrency) as ex:
        for f in [ex.submit(worker) for _ in range(args.concurrency)]:
            f.result()
    return results, t0


def recover(
    http, url: str, model: str, args, reference, timeout: float, since: float, done: list[float]
) -> tuple[float, str]:
    """Seconds from `since` (the fault's end) until a request was exact again: the first of the
    phase's own exact requests that finished after it (`done`: their monotonic finish times),
    else probe requests, one a second (inf if none is exact within --recover-seconds)."""
    after = [d for d in done if d >= since]
    if after:
        return min(after) - since, ""
    last = ""
    while time.monotonic() - since < args.recover_seconds:
        left = args.recover_seconds - (time.monotonic() - since)
        r = judge(request(http, url, model, 0, args.max_tokens, min(timeout, left)), reference)
        if r.status == "exact":
            return time.monotonic() - since, ""
        last = r.error or r.status
        time.sleep(1.0)
    return float("inf"), last


# ---- the run -----------------------------------------------------------------------------------


def choose_link(t: netns.Topology, link: str) -> str:
    if link != "auto":
        return link
    if netem_in_kernel():
        return "veth"
    log.warning(
        "this kernel has no tc netem (CONFIG_NET_SCH_NETEM): the faults go through a tun link "
        "and netns's userspace forwarder instead of netem on a veth"
    )
    return "tun"


def netem_in_kernel() -> bool:
    """Whether `tc qdisc ... netem` works: tried on the loopback of a throwaway namespace."""
    ns = "dg5-netem-probe"
    subprocess.run(["ip", "netns", "add", ns], capture_output=True, timeout=30)
    try:
        cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        r = subprocess.run(netns.ns_exec(ns, cmd), capture_output=True, text=True, timeout=30)
        return r.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def run(args: argparse.Namespace) -> int:
    why = netns.preflight(need_tc=True)
    if why is not None:
        print(f"link-faults: cannot make the two network namespaces: {why}", file=sys.stderr)
        return 2
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in faults if f not in ("delay", "loss", "cut")]
    if bad:
        print(f"link-faults: unknown fault(s) {bad}: delay, loss, cut", file=sys.stderr)
        return 2
    t = netns.topology_from(args)
    t = netns.Topology(**{**asdict(t), "link": choose_link(t, args.link)})
    flags = launch_flags()
    have = {f for f in ("--step-timeout", "--heartbeat-timeout") if f in flags}
    if have:
        timeout = args.request_timeout or args.step_timeout + args.heartbeat_timeout + 30
    else:  # TODO(issue 24): the flags are being added; until then the default 300 s applies
        log.warning(
            "launch two-node has no --step-timeout/--heartbeat-timeout yet: the server runs "
            "with the default step timeout (%.0f s)",
            DEFAULT_STEP_TIMEOUT,
        )
        timeout = args.request_timeout or DEFAULT_STEP_TIMEOUT + 60
    netns.up(t)
    out: dict = {"topology": asdict(t), "timeouts_passed": sorted(have), "request_timeout": timeout}
    box: dict = {}

    def body() -> None:  # in the head namespace: the client's sockets reach the server there
        try:
            netns.enter(t.head_ns)
            box["rows"] = serve_and_fault(t, args, flags, faults, timeout, out)
        except BaseException as e:
            box["error"] = e

    try:
        th = threading.Thread(target=body, name="link-faults")
        th.start()
        th.join()
    finally:
        if not args.keep_nodes:
            netns.down(t)
    if "error" in box:
        raise box["error"]
    rows = box["rows"]
    print_table(rows, out, timeout)
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1, default=str))
    return 0 if all(r["ok"] for r in rows) else 1


def serve_and_fault(t, args, flags, faults, timeout, out) -> list[dict]:
    import httpx

    logs = Path(t.temp_dir)
    srv = Server(t, server_command(t, args, flags), logs / "link-faults-server.log")
    rows: list[dict] = []
    try:
        places = srv.placements()
        out["placement"] = places
        nodes = set(places[-1].values()) if places else set()
        log.info("server %s; stages on nodes %s", srv.url, places[-1] if places else "?")
        if len(nodes) != 2:
            raise RuntimeError(f"the two stages are not on two nodes: {places}")
        with httpx.Client(limits=httpx.Limits(max_connections=args.concurrency + 2)) as http:
            reference = {}
            t0 = time.monotonic()
            for i in range(len(PROMPTS)):
                r = request(http, srv.url, srv.model, i, args.max_tokens, timeout)
                if r.error or len(r.tokens) != args.max_tokens:
                    raise RuntimeError(f"the fault-free request {i} failed: {r.error or r.tokens}")
                reference[i] = r.tokens
            out["fault_free_s"] = (time.monotonic() - t0) / len(PROMPTS)
            log.info("fault-free: %.2f s a request", out["fault_free_s"])
            for name in faults:
                rows.append(one_fault(name, t, args, http, srv, reference, timeout))
                log.info("%s: %s", name, rows[-1])
        out["placement"] = srv.placements()
    finally:
        srv.close()
    out["rows"] = rows
    return rows


def one_fault(name, t, args, http, srv, reference, timeout) -> dict:
    fault = {
        "delay": netns.LinkFault(delay_ms=args.delay_ms),
        "loss": netns.LinkFault(loss=args.loss),
        "cut": None,
    }[name]
    restarts0 = len(srv.placements())
    cutter = None
    if fault is not None:
        netns.apply_fault(t, fault)
        label = fault.describe()
    else:
        label = f"cut {args.cut_seconds:g}s at +{args.cut_after:g}s"
        restored: list[float] = []
        cutter = threading.Thread(target=cut_link, args=(t, args, restored), daemon=True)
    try:
        if cutter is not None:
            cutter.start()
        results, t0 = phase(http, srv.url, srv.model, args, reference, timeout)
    finally:
        if cutter is not None:
            cutter.join()
        else:
            netns.apply_fault(t, netns.LinkFault())
    since = restored[0] if cutter is not None and restored else time.monotonic()
    done = [t0 + r.sent + r.latency for r in results if r.status == "exact"]
    rejoined = cutter is not None and len(restored) > 1
    recovered, last = recover(http, srv.url, srv.model, args, reference, timeout, since, done)
    by = {s: [r for r in results if r.status == s] for s in ("exact", "failed")}
    bad = [r for r in results if r.status not in ("exact", "failed")]
    late = [r for r in by["failed"] if r.latency > timeout]
    return {
        "fault": name,
        "label": label,
        "requests": len(results),
        "exact": len(by["exact"]),
        "failed": len(by["failed"]),
        "failed_message": by["failed"][0].error if by["failed"] else "",
        "violations": [asdict(r) for r in bad + late],
        "max_latency_s": max((r.latency for r in results), default=0.0),
        "recover_s": recovered,
        "recover_error": last,
        "pipeline_restarts": len(srv.placements()) - restarts0,
        "rejoined": rejoined,
        "results": [asdict(r) for r in results],
        "ok": not bad and not late and recovered != float("inf") and len(results) > 0,
    }


def cut_link(t: netns.Topology, args, restored: list[float]) -> None:
    time.sleep(args.cut_after)
    netns.cut(t, True)
    log.info("link cut")
    try:
        time.sleep(args.cut_seconds)
    finally:
        netns.cut(t, False)
        restored.append(time.monotonic())
        log.info("link restored")
    # a cut longer than Ray's health checks: the head declared the worker node dead, and its
    # raylet exits once it hears so; an operator would start it again
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if len(netns.ray_nodes(t, timeout=10)) < 2:
            if not args.rejoin:
                log.warning("the worker node left the Ray cluster during the cut")
                return
            log.warning("the worker node left the Ray cluster during the cut: starting it again")
            netns.restart_node(t)
            restored.append(time.monotonic())
            return
        time.sleep(2.0)


def print_table(rows: list[dict], out: dict, timeout: float) -> None:
    t = out["topology"]
    print(
        f"link faults: two Ray nodes ({t['head_ns']} / {t['node_ns']}, {t['link']} link), "
        f"fault-free {out.get('fault_free_s', 0):.2f} s a request, request timeout "
        f"{timeout:.0f} s, timeouts passed to the server: {out['timeouts_passed'] or 'none'}"
    )
    for i, p in enumerate(out.get("placement", [])):
        print(f"pipeline {'up' if i == 0 else 'restarted'} on nodes {p}")
    head = (
        f"{'fault':<26} {'requests':>8} {'exact':>5} {'failed':>6} {'bad':>3} "
        f"{'max lat s':>9} {'recover s':>9} {'restarts':>8}  failed with (first message)"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        rec = f"{r['recover_s']:.1f}" if r["recover_s"] != float("inf") else "never"
        note = " (node rejoined)" if r["rejoined"] else ""
        print(
            f"{r['label']:<26} {r['requests']:>8} {r['exact']:>5} {r['failed']:>6} "
            f"{len(r['violations']):>3} {r['max_latency_s']:>9.1f} {rec:>9} "
            f"{r['pipeline_restarts']:>8}  {r['failed_message'][:120]}{note}"
        )
        for v in r["violations"][:3]:
            print(f"    violation: {v['status']} after {v['latency']:.1f}s: {v['error'][:160]}")
        if r["recover_error"]:
            print(f"    not recovered: {r['recover_error'][:160]}")
