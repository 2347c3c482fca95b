"""The engine loop: one thread owns the coordinator; servers and batch jobs talk to it through
queues.

`submit()` may be called from any thread; it returns a Handle whose queue receives
("delta", token ids) as tokens are produced, then ("done", Sequence), ("invalid", message) for a
request the engine refused, or ("error", message) when serving it failed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from dist_glm5.sampling.params import SamplingParams
from dist_glm5.stages.coordinator import Coordinator
from dist_glm5.stages.scheduler import Sequence

log = logging.getLogger(__name__)


@dataclass
class Handle:
    events: "queue.Queue[tuple[str, object]]" = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    seq: Sequence | None = None
    sent: int = 0


class EngineLoop:
    def __init__(self, coordinator: Coordinator):
        self.c = coordinator
        self.inbox: "queue.Queue[tuple[list[int], SamplingParams, Handle]]" = queue.Queue()
        self.live: list[Handle] = []
        self.stop = threading.Event()
        self.metrics = {
            "requests": 0,
            "requests_failed": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "ttft_sum": 0.0,
            "ttft_count": 0,
        }
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def submit(self, prompt: list[int], params: SamplingParams) -> Handle:
        h = Handle()
        self.inbox.put((prompt, params, h))
        return h

    def _admit(self) -> None:
        while True:
            try:
                prompt, params, h = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                h.seq = self.c.add(prompt, params)
            except ValueError as e:
                h.events.put(("invalid", str(e)))
                continue
            self.metrics["requests"] += 1
            self.metrics["prompt_tokens"] += len(prompt)
            self.live.append(h)

    def _publish(self) -> None:
        now = time.perf_counter()
        for h in list(self.live):
            s = h.seq
            if len(s.output) > h.sent:
                if h.first_token is None:
                    h.first_token = now
                    self.metrics["ttft_sum"] += now - h.submitted
                    self.metrics["ttft_count"] += 1
                h.events.put(("delta", s.output[h.sent :]))
                self.metrics["completion_tokens"] += len(s.output) - h.sent
                h.sent = len(s.output)
            if s.finished:
                self.live.remove(h)
                if s.finish_reason == "error":
                    self.metrics["requests_failed"] += 1
                    h.events.put(("error", s.error))
                else:
                    h.events.put(("done", s))

    def _run(self) -> None:
        while not self.stop.is_set():
            self._admit()
            if not self.live:
                time.sleep(0.002)
                continue
            try:
                self.c.step()
            except (
                Exception
            ) as e:  # the loop must survive: fail what started, restart, keep serving
                log.exception("engine step failed")
                self.c.scheduler.fail_all_started(f"engine failure: {type(e).__name__}: {e}")
                self.c.in_flight = 0
                self.c.pipeline.restart()
            self._publish()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.c.close()
