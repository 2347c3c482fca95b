"""The coordinator: schedules micro-batches across the stages and collects what the last stage
sampled.

It sees messages and token ids, never modules: plans go out through a Pipeline (in-process for one
stage and one rank, or Ray actors talking zmq + torch.distributed), results come back. MTP drafts
are proposed and verified on the last stage; the coordinator only feeds each draft back as the next
step's [token, draft]. Each sequence's text is detokenised incrementally here (one detokenizer per
sequence, a few tokens decoded per step), and stop strings are matched on it.

One failure path: a StageFailure raised by the pipeline's send(), recv() or poll() fails exactly the
started requests (their error names the stage and rank) and returns them from step() at once, so
their clients hear before the pipeline restarts; `failure` then says a restart is due, which the
next step() (or the engine loop, after publishing the errors) performs. Waiting requests stay
queued. A failure of one sequence alone (its sampling) fails that sequence only.
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field, replace

from dist_glm5.engine.config import StageId
from dist_glm5.engine.detokenizer import IncrementalDetokenizer
from dist_glm5.engine.messages import SeqOutput, StepResult
from dist_glm5.engine.pipeline import Pipeline, StageFailure
from dist_glm5.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from dist_glm5.sampling.params import SamplingParams, check_vocab

log = logging.getLogger(__name__)
EVENT_STEPS_KEPT = 4096  # profiler spans kept (steps x workers): bounded


@dataclass
class Stats:
    steps: int = 0
    tokens: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    restarts: int = 0
    stage_busy: dict[StageId, float] = field(default_factory=dict)  # seconds busy per worker
    peak_rss_mb: float = 0.0  # the last stage's (the one that reports results)
    # every stage's peak RSS (MiB) as its reporting worker last said: the last stage's from its
    # results, the others' from their step timings (Ray)
    stage_peak_rss_mb: dict[int, float] = field(default_factory=dict)

    @property
    def acceptance(self) -> float | None:
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else None


class Coordinator:
    def __init__(
        self,
        pipeline: Pipeline,
        sched: SchedulerConfig,
        eos: tuple[int, ...],
        vocab_size: int,
        tokenizer=None,
        step_timeout: float | None = None,
    ):
        self.pipeline, self.sched_cfg, self.eos, self.vocab = pipeline, sched, eos, vocab_size
        self.tokenizer = tokenizer
        cache = pipeline.cache
        self.scheduler = Scheduler(sched, tuple(eos), cache.blocks, cache.block_size)
        if step_timeout is None:  # the engine's (--step-timeout), else a generous default
            step_timeout = getattr(getattr(pipeline, "engine", None), "step_timeout", 300.0)
        self.step_timeout = step_timeout
        self.ids = itertools.count()
        self.step_ids = itertools.count()
        self.in_flight = 0
        self.stats = Stats()
        self._status: tuple[str, str] = ("ok", "")  # ("ok" | "restarting" | "dead", why)
        self.failure: str | None = None  # a stage failed: the pipeline restarts before next step
        self._done: list[Sequence] = []  # finished outside a step (max_tokens 0): next step's
        self.step_events: dict[tuple[int, int, int], list] = {}  # (step, stage, rank) -> spans

    @property
    def status(self) -> tuple[str, str]:
        """("ok", ""), ("stalled", which worker is late), ("restarting", why) or ("dead", why);
        read from any thread (/health)."""
        st = self._status
        if st[0] == "ok" and (late := getattr(self.pipeline, "stalled", None)):
            return ("stalled", late)
        return st

    @status.setter
    def status(self, value: tuple[str, str]) -> None:
        self._status = value

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.has_work or self.in_flight or self._done)

    def add(self, prompt: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; ValueError (naming the problem) for one the engine cannot serve."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling parameters must be SamplingParams, not {type(params)}")
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt if type(t) is not int or not 0 <= t < self.vocab]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary 0..{self.vocab - 1}"
            )
        check_vocab(params, self.vocab)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer; this model has none (use stop_token_ids)"
            )
        if not params.greedy and params.seed is None:
            # every rank of the last stage must draw the same numbers
            params = replace(params, seed=random.getrandbits(63))
        seq = Sequence(next(self.ids), list(prompt), params)
        if params.max_tokens == 0:
            seq.finish_reason = "length"
            self._done.append(seq)
            return seq
        self.scheduler.add(seq)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, params.stop, **_decode_kw(params))
        return seq

    def abort(self, seq: Sequence) -> None:
        """Finish `seq` with reason "abort"; every stage drops it with the next plan."""
        if not seq.finished:
            self.scheduler.abort(seq.seq_id)
            seq.detok = None

    def step(self) -> list[Sequence]:
        """Fill the pipeline with plans, then take one result. Returns sequences that finished
        (those a stage failure failed included: the restart waits for the next call)."""
        if self.failure is not None:
            self.restart(self.failure)
        done, self._done = self._done, []
        try:
            self._fill()
            if self.in_flight == 0:
                return done
            res = self.pipeline.recv(self.step_timeout)
        except StageFailure as e:
            return done + self._fail(e)
        self.in_flight -= 1
        self._record(res)
        outputs = {o.seq_id: o for o in res.outputs}
        touched = [s for s, _ in self.scheduler.sent.get(res.step, ()) if not s.finished]
        done += self.scheduler.on_result(res.step, res.outputs)
        self._count(res.outputs)
        for s in touched:
            if outputs.get(s.seq_id) is not None and outputs[s.seq_id].tokens:
                if self._text(s) and s not in done:
                    done.append(s)
        for s in done:
            s.detok = None  # released with the request
        return done

    def _fill(self) -> None:
        """Send plans until `microbatches` steps are in flight or the scheduler has none ready.
        A StageFailure from send() propagates with the failed step already counted."""
        while self.in_flight < self.sched_cfg.microbatches:
            plan = self.scheduler.next_plan(next(self.step_ids))
            if plan is None:
                break
            self.in_flight += 1  # counted before send: a failed send is a started step
            self.pipeline.send(plan)

    def _record(self, res: StepResult) -> None:
        """One result's step, peak RSS, busy times and profiler spans, then the other stages'."""
        self.stats.steps += 1
        self.stats.peak_rss_mb = max(self.stats.peak_rss_mb, res.peak_rss_mb)
        if res.events and res.stage_times:
            t = res.stage_times[0]
            self._keep_events(res.step, t.stage, t.rank, res.events)
        for t in res.stage_times:
            self._busy(t.stage, t.rank, t.seconds)
        if res.stage_times and res.peak_rss_mb:
            self._peak(res.stage_times[0].stage, res.peak_rss_mb)
        take = getattr(self.pipeline, "take_timings", None)
        for t in take() if take else ():  # the other stages' times (Ray), drained: bounded
            self._busy(t.stage, t.rank, t.busy_s)
            self._peak(t.stage, t.peak_rss_mb)
            if t.events:
                self._keep_events(t.step, t.stage, t.rank, t.events)

    def _count(self, outputs: list[SeqOutput]) -> None:
        """Tokens produced, and MTP drafts proposed and accepted."""
        for o in outputs:
            self.stats.tokens += len(o.tokens)
            if o.accepted is not None:
                self.stats.drafts_proposed += 1
                self.stats.drafts_accepted += o.accepted

    def _text(self, s: Sequence) -> bool:
        """Detokenise s's new tokens and match its stop strings; True if one ended it now."""
        if s.detok is None:
            return False
        p = s.params
        try:
            new_from = len(s.text)
            ids = s.output
            if s.finish_reason == "stop" and ids and not p.include_stop_str_in_output:
                if ids[-1] in p.stop_token_ids or (ids[-1] in self.eos and not p.ignore_eos):
                    ids = ids[:-1]  # as vLLM: the stop token is in the ids, not in the text
            s.text += s.detok.step(ids)
            if s.finished:
                s.text += s.detok.finish(ids)
            stops = s.detok.stops
            span = stops.span(s.text, new_from) if stops else None
        except Exception as e:  # this sequence's text alone: it fails, the others go on
            log.exception("sequence %d: detokenising failed", s.seq_id)
            s.error = f"sequence {s.seq_id} failed: {type(e).__name__}: {e}"
            was_running = not s.finished
            self.scheduler.finish(s, "error")
            return was_running
        if span is None:
            s.text_hold = 0 if s.finished or stops is None else min(len(s.text), stops.hold)
            return False
        # what follows the stop string is not returned, nor the string itself (unless
        # include_stop_str_in_output), nor the tokens that make it up
        cut = span[1] if p.include_stop_str_in_output else span[0]
        s.text, s.text_hold = s.text[:cut], 0
        kw = _decode_kw(p)
        while s.output and len(self.tokenizer.decode(s.output[:-1], **kw)) >= cut:
            s.output.pop()
        if s.output and len(self.tokenizer.decode(s.output, **kw)) > cut:
            s.output.pop()
        del s.logprobs[len(s.output) :]
        if s.finished:  # it ended by length or a stop id in the same step: the string wins
            s.finish_reason = "stop"
            return False
        self.scheduler.finish(s, "stop")
        return True

    def _busy(self, stage: int, rank: int, seconds: float) -> None:
        k = StageId(stage, rank)
        self.stats.stage_busy[k] = self.stats.stage_busy.get(k, 0.0) + seconds

    def _peak(self, stage: int, mb: float) -> None:
        peaks = self.stats.stage_peak_rss_mb
        peaks[stage] = max(peaks.get(stage, 0.0), mb)

    def _keep_events(self, step: int, stage: int, rank: int, events: list) -> None:
        self.step_events[(step, stage, rank)] = events
        while len(self.step_events) > EVENT_STEPS_KEPT:
            del self.step_events[next(iter(self.step_events))]

    def poll(self) -> list[Sequence]:
        """While idle: let the pipeline watch its workers. A failure found here fails what had
        started (normally nothing) and makes a restart due, as in step()."""
        watch = getattr(self.pipeline, "poll", None)
        if watch is None or self.failure is not None:
            return []
        try:
            watch()
        except StageFailure as e:
            return self._fail(e)
        return []

    def _fail(self, e: StageFailure) -> list[Sequence]:
        log.error("%s; failing the started requests, then restarting the pipeline", e)
        return self.fail(str(e))

    def fail(self, why: str) -> list[Sequence]:
        """Fail the started requests and make a restart due (step() or the engine loop runs it)."""
        failed = self.fail_started(why)
        self.failure = why
        self.status = ("restarting", why)  # unhealthy from now, not from the restart
        return failed

    def fail_started(self, error: str) -> list[Sequence]:
        """Fail every started request (the workers' state is lost); the waiting ones stay."""
        failed = self.scheduler.fail_started(error)
        for s in failed:
            s.detok = None
        self.in_flight = 0
        return failed

    def restart(self, why: str) -> None:
        """Restart the pipeline (new workers, empty caches). Raises if it cannot."""
        self.status = ("restarting", why)
        self.stats.restarts += 1
        self.pipeline.restart()
        self.failure = None
        self.status = ("ok", "")

    def run(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        arrivals: list[int] | None = None,
    ) -> list[Sequence]:
        """Serve `prompts`; prompt i joins after `arrivals[i]` steps (continuous batching)."""
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        arrivals = arrivals or [0] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        seqs: dict[int, Sequence] = {}
        n = 0
        while len(seqs) < len(prompts) or self.has_work:
            while order and arrivals[order[0]] <= n:
                i = order.pop(0)
                seqs[i] = self.add(prompts[i], params[i])
            self.step()
            n += 1
            if not self.has_work and order:
                n = max(n, arrivals[order[0]])
        return [seqs[i] for i in range(len(prompts))]

    def close(self) -> None:
        self.pipeline.close()


def _decode_kw(p: SamplingParams) -> dict:
    return {} if p.skip_special_tokens is None else {"skip_special_tokens": p.skip_special_tokens}
