"""`dist-glm5 bench netns` / `link-faults` without namespaces: the commands they would run, the
clear refusal where namespaces cannot be made, the verdict on a request.

The live test (two namespaces, two Ray nodes, one stage on each) needs root and iproute2 and
takes about a minute: it runs only with DIST_GLM5_NETNS_TESTS=1."""

from __future__ import annotations

import os
import shutil

import pytest

from dist_glm5.bench import link_faults, netns
from dist_glm5.launch.cli import build_parser, main

T = netns.Topology(ray="ray")


def test_setup_stays_inside_the_namespaces():
    cmds = netns.setup_commands(T)
    assert cmds[:2] == [["ip", "netns", "add", "dg5-head"], ["ip", "netns", "add", "dg5-node1"]]
    veth = cmds[2]
    assert veth[:3] == ["ip", "link", "add"] and "veth" in veth
    # both ends are created inside their namespaces: nothing appears in the root namespace
    assert veth[veth.index("dg5h") + 1 : veth.index("dg5h") + 3] == ["netns", "dg5-head"]
    assert veth[-2:] == ["netns", "dg5-node1"]
    for cmd in cmds[3:]:
        assert cmd[:3] in (["ip", "-n", "dg5-head"], ["ip", "-n", "dg5-node1"]), cmd
    assert ["ip", "-n", "dg5-head", "link", "set", "lo", "up"] in cmds
    assert ["ip", "-n", "dg5-node1", "addr", "add", "10.213.7.2/30", "dev", "dg5n"] in cmds
    assert not any("route" in c for c in cmds)
    tun = netns.setup_commands(netns.Topology(ray="ray", link="tun"))
    assert ["ip", "-n", "dg5-head", "tuntap", "add", "dev", "dg5h", "mode", "tun"] in tun


def test_ray_commands_bounded_and_in_their_namespaces():
    head = netns.ray_head_command(T)
    assert head[:4] == ["ip", "netns", "exec", "dg5-head"]
    assert "GLOO_SOCKET_IFNAME=dg5h" in head
    i = head.index("ray")
    assert head[i : i + 3] == ["ray", "start", "--head"]
    assert head[head.index("--node-ip-address") + 1] == "10.213.7.1"
    assert head[head.index("--num-cpus") + 1] == "1"
    node = netns.ray_node_command(T)
    assert node[:4] == ["ip", "netns", "exec", "dg5-node1"]
    assert node[node.index("--address") + 1] == "10.213.7.1:6379"
    assert "--head" not in node and "--include-dashboard" not in node
    assert "GLOO_SOCKET_IFNAME=dg5n" in node


def test_faults_as_commands():
    f = netns.LinkFault(delay_ms=200)
    assert netns.netem_command("dg5h", f)[-3:] == ["netem", "delay", "200ms"]
    assert netns.netem_command("dg5h", netns.LinkFault(loss=0.05))[-2:] == ["loss", "5%"]
    assert netns.LinkFault().describe() == "none"


def test_refuses_clearly_when_not_root():
    why = netns.preflight(geteuid=lambda: 1000)
    assert "root" in why and "1000" in why
    why = netns.preflight(geteuid=lambda: 0, which=lambda name: None)
    assert "iproute2" in why


def test_cli_says_why_and_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(netns, "preflight", lambda *a, **k: "network namespaces need root")
    assert main(["bench", "netns", "up"]) == 2
    assert "network namespaces need root" in capsys.readouterr().err
    assert main(["bench", "link-faults"]) == 2
    assert "network namespaces need root" in capsys.readouterr().err


def test_cli_parses():
    a = build_parser().parse_args(["bench", "netns", "exec", "--", "launch", "--help"])
    assert a.command == ["launch", "--help"] and a.link == "veth"
    a = build_parser().parse_args(["bench", "netns", "up", "--link", "tun", "--cpus", "2"])
    assert netns.topology_from(a).link == "tun" and netns.topology_from(a).cpus == 2
    a = build_parser().parse_args(["bench", "link-faults", "--faults", "cut"])
    assert a.link == "auto" and a.faults == "cut"


def test_server_command_passes_timeouts_only_when_launch_has_them():
    a = build_parser().parse_args(["bench", "link-faults", "--step-timeout", "15"])
    cmd = link_faults.server_command(T, a, set())
    assert "--step-timeout" not in cmd
    i = cmd.index("two-node")
    assert cmd[i + 1 : i + 5] == ["--address", "10.213.7.1:6379", "--host", "10.213.7.1"]
    cmd = link_faults.server_command(T, a, {"--step-timeout", "--heartbeat-timeout"})
    assert cmd[cmd.index("--step-timeout") + 1] == "15"


def test_judge():
    ref = {0: [1, 2, 3]}
    j = link_faults.judge
    assert j(link_faults.Result(0, 0, tokens=[1, 2, 3]), ref).status == "exact"
    assert j(link_faults.Result(0, 0, tokens=[1, 2, 4]), ref).status == "wrong"
    err = "HTTP 500: stage 1 rank 0 failed: no heartbeat for 5s"
    assert j(link_faults.Result(0, 0, error=err), ref).status == "failed"
    assert j(link_faults.Result(0, 0, error="HTTP 500: boom"), ref).status == "unnamed"


@pytest.mark.skipif(
    os.environ.get("DIST_GLM5_NETNS_TESTS") != "1",
    reason="opt-in: DIST_GLM5_NETNS_TESTS=1 (root, iproute2; about a minute)",
)
def test_two_ray_nodes_in_two_namespaces():
    assert netns.preflight() is None, netns.preflight()
    assert shutil.which("ray") or os.path.exists(netns.Topology().ray)
    t = netns.Topology(head_ns="dg5t-head", node_ns="dg5t-node1", temp_dir="/tmp/dg5t-netns")
    try:
        st = netns.up(t)
        assert len(set(st["ray_nodes"])) == 2
        netns.down(t)
        netns.down(t)  # idempotent
        assert not set(t.namespaces) & netns.existing_namespaces()
    finally:
        netns.down(t)
