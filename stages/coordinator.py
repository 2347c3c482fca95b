"""The coordinator: schedules micro-batches across the stages and collects what the last stage
sampled.

It sees messages and token ids, never modules: plans go out through a Pipeline (in-process for one
stage and one rank, or Ray actors talking zmq + torch.distributed), results come back. MTP drafts
are proposed and verified on the last stage; the coordinator only feeds each draft back as the next
step's [token, draft]. A stage failure fails the started requests with an error naming the stage and
rank, then the pipeline is restarted so the next request is served.
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field, replace

from dist_glm5.sampling.params import SamplingParams, check_vocab

from .engine_config import StageId
from .pipeline import Pipeline, StageFailure
from .scheduler import Scheduler, SchedulerConfig, Sequence

log = logging.getLogger(__name__)


@dataclass
class Stats:
    steps: int = 0
    tokens: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    stage_busy: dict[StageId, float] = field(default_factory=dict)  # seconds busy per worker
    peak_rss_mb: float = 0.0  # the last stage's (the one that reports results)

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
        step_timeout: float = 300.0,
    ):
        self.pipeline, self.sched_cfg, self.eos, self.vocab = pipeline, sched, eos, vocab_size
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(sched, eos)
        self.step_timeout = step_timeout
        self.ids = itertools.count()
        self.step_ids = itertools.count()
        self.in_flight = 0
        self.stats = Stats()
        self.finished: list[Sequence] = []
        self.step_events: dict[
            tuple[int, int, int], list
        ] = {}  # (step, stage, rank) -> profiler spans

    def add(self, prompt: list[int], params: SamplingParams) -> Sequence:
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary 0..{self.vocab - 1}"
            )
        check_vocab(params, self.vocab)
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer; this model has none (use stop_token_ids)"
            )
        if (
            not params.greedy and params.seed is None
        ):  # every rank of the last stage must draw the same numbers
            params = replace(params, seed=random.getrandbits(63))
        seq = Sequence(next(self.ids), list(prompt), params)
        if params.max_tokens == 0:
            seq.finish_reason = "length"
            self.finished.append(seq)
            return seq
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """Fill the pipeline with plans, then take one result. Returns sequences that finished."""
        while self.in_flight < self.sched_cfg.microbatches:
            plan = self.scheduler.next_plan(next(self.step_ids))
            if plan is None:
                break
            self.pipeline.send(plan)
            self.in_flight += 1
        if self.in_flight == 0:
            return []
        try:
            res = self.pipeline.recv(self.step_timeout)
        except StageFailure as e:
            return self._fail(e)
        self.in_flight -= 1
        self.stats.steps += 1
        self.stats.peak_rss_mb = max(self.stats.peak_rss_mb, res.peak_rss_mb)
        if res.events and res.stage_times:
            t = res.stage_times[0]
            self.step_events[(res.step, t.stage, t.rank)] = res.events
        for t in getattr(self.pipeline, "timings", []):
            if t.events:
                self.step_events[(t.step, t.stage, t.rank)] = t.events
        for t in res.stage_times:
            k = StageId(t.stage, t.rank)
            self.stats.stage_busy[k] = self.stats.stage_busy.get(k, 0.0) + t.seconds
        done = self.scheduler.on_result(res.step, res.outputs)
        for o in res.outputs:
            self.stats.tokens += len(o.tokens)
            if o.accepted is not None:
                self.stats.drafts_proposed += 1
                self.stats.drafts_accepted += o.accepted
        done += self._check_stop_strings()
        self.finished += done
        return done

    def _check_stop_strings(self) -> list[Sequence]:
        done = []
        for s in list(self.scheduler.running):
            if not s.params.stop or s.finished or s.in_flight:
                continue
            text = self.tokenizer.decode(s.output)
            hits = [text.find(x) for x in s.params.stop if x in text]
            if hits:
                cut = min(hits)
                while s.output and len(self.tokenizer.decode(s.output[:-1])) >= cut:
                    s.output.pop()  # drop the tokens that make up the stop string (not returned)
                if s.output and len(self.tokenizer.decode(s.output)) > cut:
                    s.output.pop()
                self.scheduler.finish(s, "stop")
                done.append(s)
        return done

    def _fail(self, e: StageFailure) -> list[Sequence]:
        log.error("%s; failing the started requests and restarting the pipeline", e)
        failed = self.scheduler.fail_all_started(str(e))
        self.in_flight = 0
        self.pipeline.restart()
        self.finished += failed
        return failed

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
        while len(seqs) < len(prompts) or self.scheduler.has_work or self.in_flight:
            while order and arrivals[order[0]] <= n:
                i = order.pop(0)
                seqs[i] = self.add(prompts[i], params[i])
            self.step()
            n += 1
            if not self.scheduler.has_work and not self.in_flight and order:
                n = max(n, arrivals[order[0]])
        return [seqs[i] for i in range(len(prompts))]

    def close(self) -> None:
        self.pipeline.close()
