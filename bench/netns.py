"""`dist-glm5 bench netns up|down|status|exec`: two Ray "nodes" on one machine, each in its own
network namespace, joined by a veth pair.

    dist-glm5 bench netns up          # namespaces, veth, `ray start --head` / `ray start --address`
    dist-glm5 bench netns status      # links, qdiscs, processes, the Ray nodes (JSON)
    dist-glm5 bench netns exec -- dist-glm5 --log-level INFO launch two-node \\
        --address 10.213.7.1:6379 --host 10.213.7.1 --ctx 4k --port 8000
    dist-glm5 bench netns down        # stops every process in the namespaces, deletes them

Layout (every name and address configurable, see --help): namespace `dg5-head` holds veth end
`dg5h` at 10.213.7.1/30 and the Ray head (GCS on port 6379); namespace `dg5-node1` holds `dg5n`
at 10.213.7.2/30 and a Ray worker node. Loopback is up in both. The veth is created directly
inside the namespaces (`ip link add ... netns`): nothing is added to, routed through or changed
in the root namespace, and the /30 is reachable only from the two namespaces. Each node gets
`--cpus` CPUs (default 1, so `launch two-node` places one stage per node with one thread each)
and a small object store. Ray's processes inherit `GLOO_SOCKET_IFNAME=<its veth>` so that the
stage workers' gloo pairs bind the veth (gloo's default resolves the hostname, which has no
address inside a namespace).

`down` is idempotent: it signals every process whose network namespace is one of ours (`ip netns
pids`: the Ray daemons, workers and anything run with `exec`; TERM, then KILL after a grace
period), then deletes the namespaces (which deletes the veth). It never runs `ray stop`, which
would stop every Ray on the machine, other users' local clusters included.

Where namespaces cannot be made (not Linux, not root, no iproute2, `ip netns` refused, no `ray`
on PATH) every subcommand but `status` says why and exits 2; nothing in the test suite depends
on this module's namespaces (tests/test_netns.py's live test is opt-in).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Topology:
    """Names and addresses of the two nodes (the defaults are the project's own test hosts)."""

    head_ns: str = "dg5-head"
    node_ns: str = "dg5-node1"
    head_if: str = "dg5h"
    node_if: str = "dg5n"
    head_ip: str = "10.213.7.1"
    node_ip: str = "10.213.7.2"
    prefix: int = 30
    ray_port: int = 6379
    cpus: int = 1
    object_store_mb: int = 128
    temp_dir: str = "/tmp/dg5-netns"
    link: str = "veth"  # "veth" (faults by tc netem) or "tun" (faults by the userspace link)
    ray: str = field(default_factory=lambda: _ray_exe())

    @property
    def address(self) -> str:
        """What `launch two-node --address` takes."""
        return f"{self.head_ip}:{self.ray_port}"

    @property
    def namespaces(self) -> tuple[str, str]:
        return (self.head_ns, self.node_ns)

    @property
    def control_file(self) -> Path:
        """The tun link's fault settings (JSON), read by its forwarder."""
        return Path(self.temp_dir) / "link.json"

    @property
    def token_file(self) -> Path:
        return Path(self.temp_dir) / "auth_token"

    def ends(self) -> list[tuple[str, str, str]]:
        """(namespace, veth end, address) of both nodes, the head first."""
        return [
            (self.head_ns, self.head_if, self.head_ip),
            (self.node_ns, self.node_if, self.node_ip),
        ]


def _ray_exe() -> str:
    """The `ray` script of this interpreter's environment (or the one on PATH)."""
    here = Path(sys.executable).with_name("ray")
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


def topology_from(args: argparse.Namespace) -> Topology:
    keys = Topology.__dataclass_fields__
    return Topology(**{k: getattr(args, k) for k in keys if getattr(args, k, None) is not None})


# ---- commands ------------------------------------------------------------------------------


def ns_exec(ns: str, cmd: list[str], env: dict[str, str] | None = None) -> list[str]:
    """`cmd` run inside namespace `ns` (with extra environment variables, through `env`)."""
    extra = [f"{k}={v}" for k, v in (env or {}).items()]
    return ["ip", "netns", "exec", ns, *(["env", *extra] if extra else []), *cmd]


def setup_commands(t: Topology) -> list[list[str]]:
    """Both namespaces, the link's two ends created inside them (a veth pair, or one tun device
    in each that the forwarder joins), loopback up, one /30. The ends are brought up by
    `link_up_commands` (after the forwarder has attached, for tun)."""
    cmds = [["ip", "netns", "add", ns] for ns in t.namespaces]
    if t.link == "veth":
        cmds.append(
            ["ip", "link", "add", t.head_if, "netns", t.head_ns, "type", "veth"]
            + ["peer", "name", t.node_if, "netns", t.node_ns]
        )
    elif t.link == "tun":
        cmds += [
            ["ip", "-n", ns, "tuntap", "add", "dev", dev, "mode", "tun"] for ns, dev, _ in t.ends()
        ]
    else:
        raise ValueError(f"link {t.link!r}: veth or tun")
    for ns, dev, ip in t.ends():
        cmds += [
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{ip}/{t.prefix}", "dev", dev],
        ]
    return cmds


def link_up_commands(t: Topology, up: bool = True) -> list[list[str]]:
    """Both ends of the link up (or down)."""
    return [["ip", "-n", ns, "link", "set", dev, "up" if up else "down"] for ns, dev, _ in t.ends()]


def tun_forwarder_command(t: Topology) -> list[str]:
    """The tun link's forwarder, run inside the head namespace (so `down` stops it)."""
    code = "from dist_glm5.bench.netns import tun_link_main; tun_link_main()"
    args = ["--head-if", t.head_if, "--node-ns", t.node_ns, "--node-if", t.node_if]
    return ns_exec(t.head_ns, [sys.executable, "-c", code, *args, "--control", str(t.control_file)])


def cluster_env(t: Topology) -> dict[str, str]:
    """What every process that joins or asks the two-node cluster needs: Ray (2.59+) turns
    token authentication on for local clusters, so both nodes and the driver share one token,
    written by `up` under the temp dir."""
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(t.token_file),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def ray_env(t: Topology, dev: str) -> dict[str, str]:
    return {"GLOO_SOCKET_IFNAME": dev, **cluster_env(t)}


def write_token(t: Topology) -> None:
    """The cluster's shared token (a fresh one per `up`; readable by root only)."""
    import secrets

    t.token_file.write_text(secrets.token_hex(32))
    t.token_file.chmod(0o600)


def ray_head_command(t: Topology) -> list[str]:
    cmd = [t.ray, "start", "--head", "--node-ip-address", t.head_ip, "--port", str(t.ray_port)]
    cmd += ["--include-dashboard", "false", *_ray_common(t, "head")]
    return ns_exec(t.head_ns, cmd, ray_env(t, t.head_if))


def ray_node_command(t: Topology) -> list[str]:
    cmd = [t.ray, "start", "--address", t.address, "--node-ip-address", t.node_ip]
    cmd += _ray_common(t, "node1")
    return ns_exec(t.node_ns, cmd, ray_env(t, t.node_if))


def _ray_common(t: Topology, name: str) -> list[str]:
    return [
        "--num-cpus",
        str(t.cpus),
        "--num-gpus",
        "0",
        "--object-store-memory",
        str(t.object_store_mb * 2**20),
        "--disable-usage-stats",
        "--temp-dir",
        f"{t.temp_dir}/{name}",
    ]


def ray_status_command(t: Topology) -> list[str]:
    return ns_exec(t.head_ns, [t.ray, "status", "--address", t.address], cluster_env(t))


# ---- checks --------------------------------------------------------------------------------


def preflight(need_tc: bool = False, geteuid=os.geteuid, which=shutil.which) -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if geteuid() != 0:
        return (
            f"network namespaces need root (euid {geteuid()}); run as root, e.g. "
            "`sudo dist-glm5 bench netns up`"
        )
    if which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install iproute2"
    if need_tc and which("tc") is None:
        return "`tc` (iproute2) is not installed: apt-get install iproute2"
    r = _run(["ip", "netns", "list"], check=False)
    if r.returncode != 0:
        return f"`ip netns list` failed: {r.stderr.strip() or r.returncode}"
    return None


def refuse_unless_possible(need_tc: bool = False) -> None:
    why = preflight(need_tc)
    if why is not None:
        raise RuntimeError(f"cannot make the two network namespaces: {why}")


def _run(cmd: list[str], check: bool = True, timeout: float = 60, **kw):
    log.debug("+ %s", " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def existing_namespaces() -> set[str]:
    r = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def ns_pids(ns: str) -> list[int]:
    r = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def ray_nodes(t: Topology, timeout: float = 30) -> list[str]:
    """The alive Ray node ids (hex) `ray status` lists, [] when the head does not answer."""
    try:
        r = _run(ray_status_command(t), check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return []
    if r.returncode != 0:
        return []
    active = r.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
    return re.findall(r"node_([0-9a-f]+)", active)


def wait_nodes(t: Topology, n: int = 2, timeout: float = 90) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        nodes = ray_nodes(t)
        if len(nodes) >= n:
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(nodes)} Ray node(s) alive after {timeout:.0f}s, wanted {n}")
        time.sleep(1.0)


# ---- up / down / status --------------------------------------------------------------------


def up(t: Topology, timeout: float = 120) -> dict:
    """Both nodes up (idempotent: left as they are when both Ray nodes answer, else rebuilt)."""
    refuse_unless_possible()
    have = existing_namespaces()
    if set(t.namespaces) <= have and link_kind(t) == t.link and len(ray_nodes(t, 20)) >= 2:
        log.info("the two nodes are already up")
        return status(t)
    if have & set(t.namespaces):
        log.info("rebuilding the partial setup")
        down(t)
    t0 = time.monotonic()
    try:
        Path(t.temp_dir).mkdir(parents=True, exist_ok=True)
        write_token(t)
        for cmd in setup_commands(t):
            _run(cmd)
        if t.link == "tun":
            start_forwarder(t)
        for cmd in link_up_commands(t):
            _run(cmd)
        start_ray(t, ray_head_command(t), "head")
        start_ray(t, ray_node_command(t), "node1")
        wait_nodes(t, 2, timeout)
    except BaseException:
        log.error("bringing the nodes up failed; tearing down what was made")
        down(t)
        raise
    log.info("two Ray nodes up in %.1fs (address %s)", time.monotonic() - t0, t.address)
    return status(t)


def start_ray(t: Topology, cmd: list[str], name: str) -> None:
    """`ray start` (it daemonises): its output goes to a file, never to a pipe its daemons would
    hold open."""
    out = Path(t.temp_dir) / f"ray-start-{name}.log"
    with open(out, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=180)
    if r.returncode != 0:
        tail = out.read_text()[-2000:]
        raise RuntimeError(f"`ray start` ({name}) failed ({r.returncode}): {tail}")


def start_forwarder(t: Topology, timeout: float = 15) -> None:
    Path(t.temp_dir, "tun-link.ready").unlink(missing_ok=True)
    write_control(t, LinkFault())
    out = open(Path(t.temp_dir) / "tun-link.log", "w")
    subprocess.Popen(
        tun_forwarder_command(t), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    ready = Path(t.temp_dir) / "tun-link.ready"
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the tun link's forwarder did not start: see {out.name}")
        time.sleep(0.1)


def link_kind(t: Topology) -> str | None:
    """ "veth" or "tun": what the head's end of the link is (None: no link)."""
    r = _run(["ip", "-n", t.head_ns, "-d", "link", "show", "dev", t.head_if], check=False)
    if r.returncode != 0:
        return None
    return "veth" if "veth" in r.stdout else "tun" if "tun" in r.stdout else None


def restart_node(t: Topology, timeout: float = 120) -> None:
    """Start the worker node's Ray again (after the head declared it dead and it exited)."""
    for pid in ns_pids(t.node_ns):
        _signal(pid, signal.SIGKILL)
    start_ray(t, ray_node_command(t), "node1")
    wait_nodes(t, 2, timeout)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_processes(ns: str, grace: float = 5.0) -> int:
    """TERM every process in namespace `ns`, KILL those left after `grace` seconds."""
    pids = ns_pids(ns)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and ns_pids(ns):
        time.sleep(0.2)
    for pid in ns_pids(ns):
        log.info("%s: pid %d did not stop on TERM: KILL", ns, pid)
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and ns_pids(ns):
        time.sleep(0.1)
    return len(pids)


def down(t: Topology, grace: float = 5.0) -> None:
    """Stop every process in the namespaces, delete them (and so the veth). Idempotent."""
    if geteuid_is_root() and shutil.which("ip"):
        have = existing_namespaces()
        for ns in t.namespaces:
            if ns in have:
                n = stop_processes(ns, grace)
                log.info("%s: stopped %d process(es)", ns, n)
        for ns in t.namespaces:
            if ns in have:
                _run(["ip", "netns", "del", ns], check=False)
    else:
        refuse_unless_possible()


def geteuid_is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def status(t: Topology) -> dict:
    why = preflight()
    out: dict = {"topology": asdict(t), "address": t.address, "possible": why is None}
    if why is not None:
        out["why_not"] = why
        return out
    have = existing_namespaces()
    out["namespaces"] = {}
    for ns, dev, _ in t.ends():
        if ns not in have:
            out["namespaces"][ns] = None
            continue
        link = _run(["ip", "-n", ns, "-br", "addr", "show", "dev", dev], check=False)
        qdisc = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev], check=False)
        out["namespaces"][ns] = {
            "link": link.stdout.strip() or link.stderr.strip(),
            "qdisc": qdisc.stdout.strip(),
            "processes": len(ns_pids(ns)),
        }
    out["ray_nodes"] = ray_nodes(t) if t.head_ns in have else []
    return out


# ---- faults --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFault:
    """What the link does to every packet, in each direction: a delay, a loss probability."""

    delay_ms: float = 0.0
    loss: float = 0.0

    def describe(self) -> str:
        parts = [f"delay {self.delay_ms:g} ms"] if self.delay_ms else []
        parts += [f"loss {self.loss:.0%}"] if self.loss else []
        return ", ".join(parts) or "none"


def netem_available(t: Topology) -> bool:
    """Whether this kernel has tc's netem qdisc (tried on the head's veth end, then removed)."""
    if link_kind(t) != "veth":
        return False
    r = _run(ns_exec(t.head_ns, netem_command(t.head_if, LinkFault(1.0))), check=False)
    if r.returncode != 0:
        log.info("tc netem unavailable: %s", r.stderr.strip())
        return False
    _run(ns_exec(t.head_ns, ["tc", "qdisc", "del", "dev", t.head_if, "root"]), check=False)
    return True


def netem_command(dev: str, f: LinkFault) -> list[str]:
    cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "netem"]
    cmd += ["delay", f"{f.delay_ms:g}ms"] if f.delay_ms else []
    cmd += ["loss", f"{f.loss * 100:g}%"] if f.loss else []
    return cmd


def write_control(t: Topology, f: LinkFault) -> None:
    tmp = t.control_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(f)))
    tmp.replace(t.control_file)


def apply_fault(t: Topology, f: LinkFault) -> None:
    """Both directions of the link get `f` (LinkFault() clears it): tc netem on each veth end,
    or the tun link's forwarder's settings."""
    if t.link == "tun":
        write_control(t, f)
        return
    for ns, dev, _ in t.ends():
        if f == LinkFault():
            _run(ns_exec(ns, ["tc", "qdisc", "del", "dev", dev, "root"]), check=False)
        else:
            _run(ns_exec(ns, netem_command(dev, f)))


def cut(t: Topology, cut: bool = True) -> None:
    """The link cut (`ip link set <head end> down`) or restored (up)."""
    _run(["ip", "-n", t.head_ns, "link", "set", t.head_if, "down" if cut else "up"])


def tun_link_main(argv: list[str] | None = None) -> None:
    """The tun link's forwarder: packets read from one end are written to the other after the
    control file's delay, unless its loss drops them (each direction on its own; order kept).
    Runs inside the head namespace; opens the worker's end from a thread moved into its
    namespace."""
    import heapq
    import random
    import select

    p = argparse.ArgumentParser()
    p.add_argument("--head-if", required=True)
    p.add_argument("--node-ns", required=True)
    p.add_argument("--node-if", required=True)
    p.add_argument("--control", required=True)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    head = open_tun(a.head_if)
    node = _open_tun_in(a.node_ns, a.node_if)
    other = {head: node, node: head}
    control = Path(a.control)
    fault, mtime, checked = LinkFault(), 0.0, 0.0
    rng = random.Random(0)
    queue: list = []  # (due, seq, fd, packet)
    seq = 0
    Path(control.parent / "tun-link.ready").write_text(str(os.getpid()))
    log.info("tun link %s <-> %s/%s up", a.head_if, a.node_ns, a.node_if)
    while True:
        now = time.monotonic()
        if now - checked > 0.1:
            checked = now
            mtime, fault = _reread_fault(control, mtime, fault)
        wait = min(0.1, max(0.0, queue[0][0] - now)) if queue else 0.1
        ready, _, _ = select.select([head, node], [], [], wait)
        now = time.monotonic()
        for fd in ready:
            try:
                pkt = os.read(fd, 65536)
            except OSError:
                continue
            if fault.loss and rng.random() < fault.loss:
                continue
            seq += 1
            heapq.heappush(queue, (now + fault.delay_ms / 1e3, seq, other[fd], pkt))
        _deliver_due(queue, now)


def _open_tun_in(ns: str, name: str) -> int:
    """open_tun(name) in namespace `ns`, from a thread moved into it (the caller stays)."""
    import threading

    box: list = []

    def open_node() -> None:
        try:
            enter(ns)
            box.append(open_tun(name))
        except BaseException as e:  # reported by the calling thread
            box.append(e)

    th = threading.Thread(target=open_node)
    th.start()
    th.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _reread_fault(control: Path, mtime: float, fault: LinkFault) -> tuple[float, LinkFault]:
    """The control file's mtime and fault if it changed since `mtime`, else the ones given (an
    unreadable file is logged and keeps them)."""
    try:
        m = control.stat().st_mtime
        if m != mtime:
            mtime, fault = m, LinkFault(**json.loads(control.read_text()))
            log.info("fault: %s", fault.describe())
    except (OSError, ValueError) as e:
        log.info("control file: %s", e)
    return mtime, fault


def _deliver_due(queue: list, now: float) -> None:
    """Write the queued packets due by `now` to their ends, in order."""
    import heapq

    while queue and queue[0][0] <= now:
        _, _, fd, pkt = heapq.heappop(queue)
        try:
            os.write(fd, pkt)
        except OSError:  # that end is down: the packet is lost, as on a cut cable
            pass


def open_tun(name: str) -> int:
    """Attach to tun device `name` of the calling thread's namespace (no packet info header)."""
    import fcntl
    import struct

    tunsetiff, iff_tun, iff_no_pi = 0x400454CA, 0x0001, 0x1000
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, tunsetiff, struct.pack("16sH", name.encode(), iff_tun | iff_no_pi))
    return fd


def enter(ns: str) -> None:
    """Move the calling thread (only it) into namespace `ns`: sockets it opens afterwards live
    there. Used by a client thread that must talk to a server inside the head namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


# ---- CLI -------------------------------------------------------------------------------------


def add_topology_args(p: argparse.ArgumentParser, link_default: str = "veth") -> None:
    d = Topology()
    p.add_argument("--head-ns", default=d.head_ns, help="the head node's network namespace")
    p.add_argument("--node-ns", default=d.node_ns, help="the worker node's network namespace")
    p.add_argument("--head-if", default=d.head_if, help="the veth end in the head namespace")
    p.add_argument("--node-if", default=d.node_if, help="the veth end in the worker namespace")
    p.add_argument("--head-ip", default=d.head_ip, help="the head's address on the veth")
    p.add_argument("--node-ip", default=d.node_ip, help="the worker's address on the veth")
    p.add_argument("--prefix", type=int, default=d.prefix, help="prefix length of the veth net")
    p.add_argument("--ray-port", type=int, default=d.ray_port, help="the head's GCS port")
    p.add_argument("--cpus", type=int, default=d.cpus, help="Ray CPUs per node")
    p.add_argument(
        "--object-store-mb", type=int, default=d.object_store_mb, help="Ray object store per node"
    )
    p.add_argument("--temp-dir", default=d.temp_dir, help="Ray's temp dir root (logs, sockets)")
    p.add_argument(
        "--link",
        choices=["veth", "tun"] + (["auto"] if link_default == "auto" else []),
        default=link_default,
        help="veth (faults by tc netem), or a tun device in each namespace joined by a userspace "
        "forwarder that applies the faults itself (for kernels without netem)"
        + ("; auto: veth where the kernel has netem, else tun" if link_default == "auto" else ""),
    )


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up", "down", "status", "exec"])
    p.add_argument(
        "command", nargs="*", help="exec: the command to run in the head namespace, after --"
    )
    add_topology_args(p)
    p.add_argument("--timeout", type=float, default=120, help="up: seconds to wait for the nodes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    t = topology_from(args)
    if args.action != "status":
        why = preflight()
        if why is not None:
            print(f"netns: cannot make the two network namespaces: {why}", file=sys.stderr)
            return 2
    if args.action == "up":
        print(json.dumps(up(t, args.timeout), indent=1))
    elif args.action == "down":
        down(t)
        print(json.dumps({"down": list(t.namespaces)}))
    elif args.action == "status":
        print(json.dumps(status(t), indent=1))
    else:
        cmd = list(args.command)
        if not cmd:
            print("netns exec: give a command after --", file=sys.stderr)
            return 2
        return subprocess.call(ns_exec(t.head_ns, cmd, cluster_env(t)))
    return 0
