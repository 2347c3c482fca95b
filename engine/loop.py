"""The engine loop: one thread owns the coordinator; servers and batch jobs talk to it through
queues.

Thread contract. From any thread: `submit()`, `abort()`, `state`, `health()`, `metrics_snapshot()`,
`max_model_len`, `close()`. Everything else (the coordinator, its scheduler and sequences while
they run) belongs to the engine thread.

`submit(prompt_ids, params, request_id=None) -> Handle`. The handle's `events` queue receives, in
order:
- ("delta", Delta(token_ids, text, logprobs, prompt_logprobs)), zero or more times (a NamedTuple):
  token_ids the new token ids (list[int]) since the last delta; logprobs theirs (one dict per id,
  when the request asked for logprobs); prompt_logprobs the prompt's, once, on the first delta
  with ids (when asked; None otherwise); text
  the new text (str) from the engine's incremental detokenizer, "" when the model has no
  tokenizer. The server never decodes. Text may lag the ids: a multi-byte UTF-8 character split
  across tokens waits for its last token, and while the request has stop strings the last
  len(longest stop) - 1 characters wait (they could begin a stop string). Everything is released
  before "done": the texts concatenate to the completion's text (== Sequence.text), which stops
  before a stop string. Ids already sent are never taken back; when a stop string ends the request,
  the final Sequence.output no longer holds the tokens that made it up, so take the final ids and
  usage from "done".
- then exactly one terminal event:
  ("done", Sequence): seq.finish_reason is "stop", "length" or "abort" (abort(): a client that went
      away or an explicit cancel); seq.output the final ids, seq.text the final text, seq.logprobs,
      seq.prompt_logprobs; usage = len(seq.prompt), len(seq.output).
  ("invalid", message): refused at admission, nothing ran (a bad value, or a request that can never
      fit: prompt + max_tokens over `max_model_len`; the message states the limit): a 400.
  ("error", message): serving it failed. A stage failed (the message names stage and rank; the
      other started requests fail too and hear it before the pipeline restarts; waiting requests
      stay queued and are served after the restart), or this request alone failed (its own
      sampling): a 500.

`abort(request_id, why=...)` (a Handle is accepted too): the request finishes with reason "abort"
(a "done" event), its blocks are free at once in the ledger and every stage drops it with the next
step; a chunk still in flight is discarded. Each abort is logged (INFO: id, why, tokens so far).
Aborting an unknown or finished request does nothing.

`state` -> EngineState(status, reason): "ok"; "stalled" (a worker's heartbeat is late: it may be
frozen; reason names it); "restarting" (a failure is being recovered: the pipeline is reloading);
"dead" (the loop cannot serve: restarts failed, or the loop itself crashed; reason says why; every
request then gets "error"). `health()` -> the same with `.ok` (True only when "ok") and `.detail`:
/health answers 503 unless ok.

`metrics_snapshot()` -> stages.metrics.EngineMetrics, a copy taken under the loop's lock (counters,
gauges, fixed-bucket histograms of TTFT, inter-token latency, end-to-end latency and queue time;
see engine/metrics.py for the fields and suggested Prometheus names). TTFT is submit -> first
delta with tokens; inter-token latency is observed once per later delta with tokens (a step that
emits an accepted MTP draft and a bonus token is one observation); e2e is submit -> done; queue
time is submit -> the first plan the scheduler put the request in.

Memory: the loop keeps a request only while it runs; after its terminal event nothing in the
engine refers to its Sequence (only the Handle the caller holds).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from dist_glm5.engine.coordinator import Coordinator
from dist_glm5.engine.metrics import EngineMetrics
from dist_glm5.engine.scheduler import Sequence
from dist_glm5.sampling.params import SamplingParams

log = logging.getLogger(__name__)
RESTART_ATTEMPTS = 3  # then the engine is dead
RESTART_BACKOFF_S = 1.0  # doubled after each failed attempt


class Delta(NamedTuple):
    token_ids: list[int]
    text: str
    logprobs: list[dict] = []  # never mutated
    prompt_logprobs: list[dict | None] | None = None


@dataclass(frozen=True)
class EngineState:
    status: str  # "ok" | "stalled" | "restarting" | "dead"
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def detail(self) -> str:
        return self.reason if self.ok else f"engine {self.status}: {self.reason}"


@dataclass
class Handle:
    request_id: object
    events: "queue.Queue[tuple[str, object]]" = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    queued: bool = True  # queue time not yet observed
    seq: Sequence | None = None
    sent: int = 0  # token ids published
    text_sent: int = 0  # characters of text published


class EngineLoop:
    def __init__(self, coordinator: Coordinator):
        self.c = coordinator
        self.inbox: "queue.Queue[tuple[list[int], SamplingParams, Handle]]" = queue.Queue()
        self.aborts: "queue.Queue[object]" = queue.Queue()
        self.live: dict[object, Handle] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards self.metrics against a concurrent snapshot
        self.metrics = EngineMetrics(cache_blocks=coordinator.scheduler.block_manager.num_blocks)
        self._state = EngineState("ok")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self.thread.start()

    # ---- any thread ------------------------------------------------------------------------
    def submit(
        self, prompt: list[int], params: SamplingParams, request_id: object = None
    ) -> Handle:
        h = Handle(request_id if request_id is not None else f"req-{next(self._ids)}")
        if self._state.status == "dead":
            h.events.put(("error", self._state.detail))
            return h
        self.inbox.put((prompt, params, h))
        self._wake.set()
        if self._state.status == "dead":  # it died while we queued: nobody will answer
            self._fail_inbox(self._state.detail)
        return h

    def abort(self, request: object, why: str = "the client went away or cancelled") -> None:
        rid = request.request_id if isinstance(request, Handle) else request
        self.aborts.put((rid, why))
        self._wake.set()

    @property
    def state(self) -> EngineState:
        st = self._state
        if st.status == "ok":
            status, why = self.c.status
            if status != "ok":
                return EngineState(status, why)
            if not self.thread.is_alive() and not self.stop.is_set():
                return EngineState("dead", "the engine thread stopped")
        return st

    def health(self) -> EngineState:
        return self.state

    @property
    def max_model_len(self) -> int:
        """The longest prompt + max_tokens the engine admits (the context, or the cache)."""
        return self.c.scheduler.max_len

    def metrics_snapshot(self) -> EngineMetrics:
        with self._lock:
            return self.metrics.snapshot()

    def close(self) -> None:
        self.stop.set()
        self._wake.set()
        self.thread.join(timeout=30)
        self.c.close()

    # ---- the engine thread ----------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:  # never die silently: say so, and fail everyone waiting
            log.exception("the engine loop crashed")
            self._die(f"the engine loop crashed: {type(e).__name__}: {e}")

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.c.failure is not None:  # its requests' errors are out: now the restart
                self._restart(self.c.failure)
            self._admit()
            self._abort()
            if not self.c.has_work:
                if self.c.poll():  # a worker found dead or frozen while idle
                    self._publish()
                self._refresh()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.c.step()  # a stage failure returns its failed requests, restart pending
            except Exception as e:  # a bug: fail what started, publish, then restart
                log.exception("engine step failed")
                why = f"engine failure: {type(e).__name__}: {e}"
                self.c.fail(why)
            self._publish()
            self._refresh()

    def _admit(self) -> None:
        while True:
            try:
                prompt, params, h = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                h.seq = self.c.add(prompt, params)
            except Exception as e:  # ValueError normally; anything else is still this request's
                with self._lock:
                    self.metrics.invalid += 1
                h.events.put(("invalid", str(e)))
                continue
            with self._lock:
                self.metrics.prompt_tokens += len(h.seq.prompt)
            if h.request_id in self.live:
                log.warning("request id %r is in use; aborts will reach the newer", h.request_id)
            self.live[h.request_id] = h

    def _abort(self) -> None:
        aborted = False
        while True:
            try:
                rid, why = self.aborts.get_nowait()
            except queue.Empty:
                break
            h = self.live.get(rid)
            if h is not None and h.seq is not None and not h.seq.finished:
                s = h.seq
                log.info(
                    "request %r aborted (%s) after %d of %d tokens, %.2fs after submit",
                    rid,
                    why,
                    len(s.output),
                    s.params.max_tokens,
                    time.perf_counter() - h.submitted,
                )
                self.c.abort(s)
                aborted = True
        if aborted:  # published now, not after the next step
            self._publish()

    def _publish(self) -> None:
        now = time.perf_counter()
        for rid, h in list(self.live.items()):
            try:
                self._publish_one(h, now)
            except Exception as e:  # this request's events alone
                log.exception("publishing request %r failed", rid)
                self.live.pop(rid, None)
                h.events.put(("error", f"{type(e).__name__}: {e}"))

    def _publish_one(self, h: Handle, now: float) -> None:
        s, m = h.seq, self.metrics
        if h.queued and s.scheduled_at is not None:
            h.queued = False
            with self._lock:  # submit -> first scheduled, not -> first published
                m.queue.observe(max(0.0, s.scheduled_at - h.submitted))
        toks = s.output[h.sent :]
        upto = len(s.text) - (0 if s.finished else s.text_hold)
        text = s.text[h.text_sent : upto] if upto > h.text_sent else ""
        if toks or text:
            lps = s.logprobs[h.sent : h.sent + len(toks)] if s.params.logprobs is not None else []
            plp = None
            if toks and h.sent == 0 and s.params.prompt_logprobs is not None:
                plp = list(s.prompt_logprobs)
            h.events.put(("delta", Delta(list(toks), text, lps, plp)))
            h.sent = max(h.sent, len(s.output))
            h.text_sent = max(h.text_sent, upto)
        if toks:
            with self._lock:
                m.generation_tokens += len(toks)
                if h.first_token is None:
                    h.first_token = now
                    m.ttft.observe(now - h.submitted)
                else:
                    m.itl.observe(now - h.last_token)
            h.last_token = now
        if not s.finished:
            return
        del self.live[h.request_id]
        with self._lock:
            m.e2e.observe(now - h.submitted)
            m.finished[s.finish_reason] = m.finished.get(s.finish_reason, 0) + 1
        if s.finish_reason == "error":
            h.events.put(("error", s.error))
        else:
            h.events.put(("done", s))

    def _refresh(self) -> None:
        """Gauges and the counters the coordinator keeps, copied under the lock."""
        c, sched = self.c, self.c.scheduler
        with self._lock:
            m = self.metrics
            m.running = len(sched.running)
            m.waiting = len(sched.waiting)
            m.preempted = sched.num_preempted_waiting
            m.queue_length = m.waiting + self.inbox.qsize()
            m.cache_usage = sched.block_manager.usage
            m.preemptions = sched.num_preemptions
            m.pipeline_restarts = c.stats.restarts
            m.steps = c.stats.steps
            m.mtp_drafts, m.mtp_accepted = c.stats.drafts_proposed, c.stats.drafts_accepted
            m.stage_busy_seconds = {(k.stage, k.rank): v for k, v in c.stats.stage_busy.items()}

    def _restart(self, why: str) -> None:
        """Restart the pipeline (a few attempts, backing off); the failed requests' errors were
        published before this."""
        delay = RESTART_BACKOFF_S
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            self._state = EngineState("restarting", why)
            try:
                t0 = time.monotonic()
                self.c.restart(why)
                self._state = EngineState("ok")
                log.info("pipeline restarted in %.1fs", time.monotonic() - t0)
                return
            except Exception as e:
                log.exception("pipeline restart %d of %d failed", attempt, RESTART_ATTEMPTS)
                why = f"pipeline restart failed: {type(e).__name__}: {e}"
                # the queued requests hear now rather than after every attempt (nothing hangs)
                self._fail_waiting(why)
                if attempt < RESTART_ATTEMPTS and self.stop.wait(delay):
                    break  # closing: no more attempts
                delay *= 2
        raise RuntimeError(why)  # the loop dies: _main marks the engine dead and fails everyone

    def _fail_waiting(self, why: str) -> None:
        """Fail every request still queued (none has started: the pipeline is down)."""
        for h in list(self.live.values()):
            if h.seq is not None and not h.seq.finished:
                h.seq.error = why
                self.c.scheduler.finish(h.seq, "error")
        self._publish()
        self._fail_inbox(why)

    def _die(self, why: str) -> None:
        self._state = EngineState("dead", why)
        self.c.status = ("dead", why)
        for h in list(self.live.values()):
            h.events.put(("error", f"engine dead: {why}"))
        self.live.clear()
        self._fail_inbox(f"engine dead: {why}")

    def _fail_inbox(self, why: str) -> None:
        while True:
            try:
                _, _, h = self.inbox.get_nowait()
            except queue.Empty:
                return
            h.events.put(("error", why))
