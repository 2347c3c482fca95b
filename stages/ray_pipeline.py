"""The pipeline as Ray actors: one actor per (stage, rank), one placement-group bundle per stage.

Ray places and supervises the workers (STRICT_SPREAD puts each stage on its own node when the
cluster has enough nodes); control messages are msgpack over zmq (the coordinator binds a ROUTER,
each worker connects a DEALER named "stage/rank"); hidden states and all-reduces go through
torch.distributed (gloo on CPU). A worker that raises reports a WorkerError; one that dies is seen
through its actor's task ref. Either way recv() raises StageFailure naming the stage and rank.

A worker that stops without dying (SIGSTOP, a hung host, a cut link) is found by its heartbeats:
each worker beats every `heartbeat_interval` s from a thread of its own; one silent for
`heartbeat_timeout` s fails (late but not yet timed out, it makes `stalled` say so, and /health
answers 503). A step without a result within the step timeout names the earliest worker that has
not finished it (heartbeats and StepTimings carry each worker's progress).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from dataclasses import replace

import zmq

from dist_glm5.engine.config import EngineConfig, StageSpec
from dist_glm5.engine.messages import (
    Heartbeat,
    Hello,
    Shutdown,
    StepPlan,
    StepResult,
    StepTiming,
    WorkerError,
    pack,
    unpack,
)
from dist_glm5.engine.pipeline import StageFailure
from dist_glm5.model.config import ModelConfig
from dist_glm5.planning.partition import partition_layers

from .worker import serve

log = logging.getLogger(__name__)
TIMINGS_KEPT = 1024
POLL_MS = 50  # how often recv() looks at Ray and the heartbeats while nothing arrives
WATCH_EVERY_S = 0.1  # at most this often (each look asks Ray)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _actor_class():
    import ray

    @ray.remote
    class StageWorkerActor:
        def run(self, spec: StageSpec, coord_addr: str, dist_init: str | None) -> None:
            serve(spec, coord_addr, dist_init)

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def rendezvous(self) -> str:
            """torch.distributed's meeting point on this worker's node (global rank 0 listens
            there, wherever Ray placed it)."""
            ip = ray.util.get_node_ip_address()
            return f"tcp://{ip}:{free_port(ip)}"

    return StageWorkerActor


class RayPipeline:
    def __init__(
        self,
        engine: EngineConfig,
        cpus_per_worker: float = 1.0,
        startup_timeout: float | None = None,
    ):
        import ray

        cfg = ModelConfig.from_hf(engine.model_dir)
        self.engine = engine
        self.ranges = partition_layers(cfg, engine.layout.stages)
        self.stages, self.ranks = engine.layout.stages, engine.layout.ranks
        self.specs = [
            StageSpec(engine, w, (self.ranges[w.stage].start, self.ranges[w.stage].stop))
            for w in engine.layout.workers
        ]
        host, address = engine.host, engine.address
        self.host, self.cpus = host, cpus_per_worker
        self.startup_timeout = startup_timeout or engine.startup_timeout
        if not ray.is_initialized():
            # "local": always a fresh cluster, never one a crashed run left behind
            ray.init(
                address=address or "local",
                include_dashboard=False,
                log_to_driver=False,
                **({} if address else {"num_cpus": max(2, self.stages * self.ranks)}),
            )
        if engine.threads is None:  # a worker uses its share of its node's cores
            engine = replace(engine, threads=self._threads_per_worker())
            self.engine, self.specs = engine, [replace(s, engine=engine) for s in self.specs]
        self.threads = engine.threads
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(
            zmq.ROUTER_MANDATORY, 1
        )  # sending to a vanished worker is an error, not a drop
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.coord_addr = f"tcp://{host}:{port}"
        self.actors, self.refs, self.pg = [], [], None
        # per-step times of the non-sampling stages: the latest few for inspection (bounded), and
        # those not yet taken by the coordinator (drained every step)
        self.timings: deque[StepTiming] = deque(maxlen=TIMINGS_KEPT)
        self._fresh: list[StepTiming] = []
        self.beat_timeout = engine.heartbeat_timeout
        # late (but not yet failed): a few beats missed, and a third of the way to the timeout
        self.beat_late = max(3 * engine.heartbeat_interval, engine.heartbeat_timeout / 3)
        self.stalled: str | None = None  # which worker is late, while one is (read by /health)
        self._start()

    def _threads_per_worker(self) -> int:
        """The cores of a node (the fewest any node has, and no more than this machine's) over
        the workers placed on it: a stage's ranks when stages are spread one per node, every
        worker when they share one node."""
        import ray

        nodes = [n for n in ray.nodes() if n["Alive"]]
        # Ray "nodes" on one host (a test cluster) share its cores: count hosts, not nodes
        hosts = {n.get("NodeManagerAddress") for n in nodes}
        spread = self.stages > 1 and len(hosts) >= self.stages
        per_node = self.ranks if spread else self.stages * self.ranks
        cpus = min(int(n["Resources"].get("CPU", 1)) for n in nodes)
        return max(1, min(cpus, os.cpu_count() or 1) // per_node)

    # ---- lifecycle ---------------------------------------------------------------------
    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        nodes = [n for n in ray.nodes() if n["Alive"]]
        strategy = "STRICT_SPREAD" if len(nodes) >= self.stages and self.stages > 1 else "PACK"
        if self.stages > 1 and strategy == "PACK":
            log.warning(
                "the Ray cluster has %d node(s) for %d stages: stages share a node",
                len(nodes),
                self.stages,
            )
        bundles = [{"CPU": self.cpus * self.ranks} for _ in range(self.stages)]
        self.pg = placement_group(bundles, strategy=strategy)
        ray.get(self.pg.ready(), timeout=self.startup_timeout)
        env = {"OMP_NUM_THREADS": str(self.threads)}
        if self.engine.backend == "hpu":  # the bridge's settings reach workers on other nodes
            from dist_glm5.backends.hpu.env import forwarded

            env.update(forwarded())
        if self.host.startswith("127."):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's pairs on loopback as well
        actor = _actor_class()
        self.actors = [
            actor.options(
                num_cpus=self.cpus,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, spec.stage),
            ).remote()
            for spec in self.specs
        ]
        # where Ray put each stage (asked before run(), which occupies the actor until shutdown)
        self.node_of_stage = {
            s.stage: n
            for s, n in zip(
                self.specs,
                # bounded: an actor placed on a node that has just become unreachable never answers
                ray.get([a.node_id.remote() for a in self.actors], timeout=self.startup_timeout),
            )
        }
        dist_init = None
        if len(self.specs) > 1:  # global rank 0 (stage 0, rank 0) opens it, on its own node
            if self.host.startswith("127."):  # one host: loopback
                dist_init = f"tcp://{self.host}:{free_port(self.host)}"
            else:  # a restart may place stage 0 on another node than the coordinator's
                dist_init = ray.get(self.actors[0].rendezvous.remote(), timeout=60)
        self.refs = [
            a.run.remote(spec, self.coord_addr, dist_init)
            for a, spec in zip(self.actors, self.specs)
        ]
        waiting = {(s.stage, s.rank) for s in self.specs}
        self.pids: dict[tuple[int, int], int] = {}
        self.beats: dict[tuple[int, int], float] = {}  # (stage, rank) -> last heard (monotonic)
        self.done: dict[tuple[int, int], int] = {}  # (stage, rank) -> last step it finished
        self.working: dict[tuple[int, int], int | None] = {}
        self.outstanding: dict[int, float] = {}  # step sent, no result yet -> when sent
        self.first_step: int | None = None  # the first step of this incarnation (older: stale)
        self.stalled, self._watched = None, 0.0
        deadline = time.monotonic() + self.startup_timeout
        while waiting:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"workers {sorted(waiting)} did not start within {self.startup_timeout:.0f}s"
                )
            if self.sock.poll(200):
                _, raw = self.sock.recv_multipart()
                msg = unpack(raw)
                if isinstance(msg, WorkerError):
                    raise StageFailure(msg.stage, msg.rank, msg.error)
                if isinstance(msg, Hello):
                    waiting.discard((msg.stage, msg.rank))
                    self.pids[(msg.stage, msg.rank)] = msg.pid
        now = time.monotonic()  # silence is counted from here (a load is not watched)
        self.beats = {k: now for k in self.pids}
        log.info(
            "pipeline up: %d stage(s) x %d rank(s) on nodes %s",
            self.stages,
            self.ranks,
            self.node_of_stage,
        )

    def _check_alive(self) -> None:
        import ray

        done, _ = ray.wait(self.refs, num_returns=1, timeout=0)
        if done:
            i = self.refs.index(done[0])
            spec = self.specs[i]
            from ray.exceptions import RayActorError

            try:
                ray.get(done[0])
                err = "worker exited"
            except RayActorError as e:
                err = f"worker process died ({type(e).__name__})"
            except Exception as e:  # the worker's own exception
                err = f"{type(e).__name__}: {e}"
            raise StageFailure(spec.stage, spec.rank, err)

    def _blame(self, msg: WorkerError, grace: float = 1.0) -> StageFailure:
        """A worker's error may only be the echo of a peer that died (gloo: connection reset):
        give Ray a moment to report a dead actor and name that one instead (Ray usually knows in
        a few hundred ms; the wait ends as soon as it does)."""
        import ray
        from ray.exceptions import RayActorError

        echo = "gloo" in msg.error or "Connection" in msg.error
        deadline = time.monotonic() + (grace if echo else 0.0)
        while True:
            done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0.05)
            for ref in done:
                spec = self.specs[self.refs.index(ref)]
                if (spec.stage, spec.rank) == (msg.stage, msg.rank):
                    continue
                try:
                    ray.get(ref)
                except RayActorError as e:
                    return StageFailure(
                        spec.stage, spec.rank, f"worker process died ({type(e).__name__})"
                    )
                except Exception:
                    pass
            if time.monotonic() >= deadline:
                break
        if echo:  # a peer that stopped without dying: the longest silent one is to blame
            silent = self._silent()
            if silent and silent[0][1] >= self.beat_late:
                (stage, rank), s = silent[0]
                return StageFailure(stage, rank, f"no heartbeat for {s:.1f}s ({msg.error})")
        return StageFailure(msg.stage, msg.rank, msg.error)

    # ---- watching ------------------------------------------------------------------------
    def _silent(self) -> list[tuple[tuple[int, int], float]]:
        """(worker, seconds since its last heartbeat), the longest silent first."""
        now = time.monotonic()
        return sorted(((k, now - t) for k, t in self.beats.items()), key=lambda x: -x[1])

    def _watch(self) -> None:
        """Every message that arrived has been read (silence is real): fail a dead worker or one
        silent past the heartbeat timeout; flag one that is late."""
        now = time.monotonic()
        if now - self._watched < WATCH_EVERY_S:
            return
        self._watched = now
        self._check_alive()
        silent = self._silent()
        if not silent:
            return
        (stage, rank), s = silent[0]
        if s >= self.beat_timeout:
            self.stalled = None
            raise StageFailure(
                stage,
                rank,
                f"no heartbeat for {s:.1f}s (timeout {self.beat_timeout:g}s): frozen or "
                f"unreachable (pid {self.pids.get((stage, rank))})",
            )
        stalled = f"stage {stage} rank {rank} silent for {s:.1f}s" if s >= self.beat_late else None
        if stalled and not self.stalled:
            log.warning("%s (fails at %gs)", stalled, self.beat_timeout)
        elif self.stalled and not stalled:
            log.info("every worker beats again")
        self.stalled = stalled

    def poll(self) -> None:
        """While idle: read what arrived and watch the workers (StageFailure as in recv())."""
        while self.sock.poll(0):
            msg = self._take(self.sock.recv_multipart()[-1])
            if isinstance(msg, StepResult):  # nothing is outstanding: an old pipeline's
                log.warning("dropping a result for step %d nobody waits for", msg.step)
        self._watch()

    def _take(self, raw: bytes):
        """Book one message: returns it if recv() should look at it (a result or an error)."""
        msg = unpack(raw)
        k = (getattr(msg, "stage", -1), getattr(msg, "rank", -1))
        if isinstance(msg, Heartbeat):
            if self.pids.get(k) != msg.pid:
                return None  # an old incarnation's last beat, or a worker not up yet
            self.beats[k] = time.monotonic()
            self.done[k] = max(self.done.get(k, -1), msg.done)
            self.working[k] = msg.working
            return None
        step = getattr(msg, "step", None)
        if step is not None and (self.first_step is None or step < self.first_step):
            log.warning("dropping %s for step %s of a previous pipeline", type(msg).__name__, step)
            return None
        if isinstance(msg, StepTiming):
            self.done[k] = max(self.done.get(k, -1), msg.step)
            self.timings.append(msg)
            self._fresh.append(msg)
            del self._fresh[:-TIMINGS_KEPT]  # nobody taking them: keep it bounded
            return None
        if isinstance(msg, StepResult):
            self.outstanding.pop(msg.step, None)
            for t in msg.stage_times:
                key = (t.stage, t.rank)
                self.done[key] = max(self.done.get(key, -1), msg.step)
        return msg if isinstance(msg, (StepResult, WorkerError)) else None

    def _late_step(self, timeout: float) -> StageFailure:
        """No result within the step timeout: name the earliest worker that has not finished the
        oldest outstanding step (a stage runs only after the one before it)."""
        step = min(self.outstanding) if self.outstanding else -1
        now = time.monotonic()
        for spec in self.specs:
            k = (spec.stage, spec.rank)
            if self.done.get(k, -1) < step:
                on = self.working.get(k)
                return StageFailure(
                    spec.stage,
                    spec.rank,
                    f"step {step} not done within the step timeout ({timeout:g}s): "
                    f"{f'working on step {on}' if on is not None else 'idle'}, last finished "
                    f"step {self.done.get(k, -1)}, last heartbeat "
                    f"{now - self.beats.get(k, now):.1f}s ago",
                )
        last = self.specs[-1]
        return StageFailure(last.stage, last.rank, f"no result for step {step} within {timeout:g}s")

    def _stop(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        self.actors, self.refs, self.pg = [], [], None
        while self.sock.poll(0):  # drop whatever the old workers still had in flight
            self.sock.recv_multipart()

    def restart(self) -> None:
        self._stop()
        self._start()

    def close(self) -> None:
        import ray

        for s in self.specs:
            try:
                self.sock.send_multipart([s.id.identity, pack(Shutdown("close"))])
            except zmq.ZMQError:
                pass
        ray.wait(self.refs, num_returns=len(self.refs), timeout=10)
        self._stop()
        self.sock.close()
        self.ctx.term()

    @property
    def cache(self):
        return self.engine.cache

    def take_timings(self) -> list[StepTiming]:
        """The stage timings that arrived since the last call."""
        fresh, self._fresh = self._fresh, []
        return fresh

    # ---- traffic -----------------------------------------------------------------------
    def send(self, plan: StepPlan) -> None:
        if self.first_step is None:
            self.first_step = plan.step
        self.outstanding[plan.step] = time.monotonic()
        raw = pack(plan)
        for s in self.specs:
            try:
                self.sock.send_multipart([s.id.identity, raw])
            except zmq.ZMQError as e:
                raise StageFailure(s.stage, s.rank, f"cannot reach the worker: {e}") from e

    def recv(self, timeout: float) -> StepResult:
        """The next step result; StageFailure when a worker reports an error, dies, goes silent
        past the heartbeat timeout, or no result comes within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            if self.sock.poll(POLL_MS):
                msg = self._take(self.sock.recv_multipart()[-1])
                if isinstance(msg, StepResult):
                    return msg
                if isinstance(msg, WorkerError):
                    raise self._blame(msg)
                if self.sock.poll(0):
                    continue  # read everything that arrived before judging anyone silent
            self._watch()
            if time.monotonic() > deadline:
                raise self._late_step(timeout)


def local_cluster(nodes: int, cpus_per_node: int = 4):
    """A Ray cluster of `nodes` nodes on this machine (how tests stand up 'two nodes')."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False}
    )
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus_per_node)
    cluster.wait_for_nodes()
    return cluster


os.environ.setdefault("RAY_DEDUP_LOGS", "0")
