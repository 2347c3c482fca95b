"""Continuous batching with chunked prefill and micro-batches (pure Python: no torch here).

Requests join and leave between steps. Each step's plan takes sequences that are not already in
flight: decodes first (one token, or [token, draft] with MTP), then prefill chunks of at most
`chunk_tokens`, within `step_tokens`. With M micro-batches a plan takes at most ceil(active / M)
sequences, so M plans can be in the pipeline at once and every stage stays busy.

Consecutive prefill chunks of one sequence may be in flight together (a stage runs them in order,
so chunk k+1 finds chunk k's cache): a long prompt keeps every stage busy on its own.
A sequence's `num_computed` counts positions whose KV is valid on every stage. A rejected draft
simply does not count: the next chunk starts at that position and overwrites it, on every stage
and in the MTP layer's cache alike (caches are written by position).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from dist_glm5.sampling.params import SamplingParams
from dist_glm5.stages.messages import SeqOutput, SeqWork, StepPlan


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_scheduled: int = (
        0  # positions handed to the pipeline (ahead of num_computed while chunks fly)
    )
    draft: int | None = None
    in_flight: int = 0  # chunks of this sequence in the pipeline
    params_sent: bool = False
    finish_reason: str | None = None  # "stop", "length", "error"
    error: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    steps: int = 0

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerConfig:
    max_seqs: int = 64
    chunk_tokens: int = 256
    step_tokens: int = 1024
    microbatches: int = 2
    mtp: bool = False
    max_model_len: int = 1 << 20


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, eos: tuple[int, ...]):
        self.cfg, self.eos = cfg, eos
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[int, Sequence] = {}
        self.release: list[int] = []
        self.sent: dict[int, list[tuple[Sequence, SeqWork]]] = {}  # step -> what went out
        self.kinds: dict[int, str] = {}  # step -> "prefill" (any prompt chunk in it) or "decode"

    def add(self, seq: Sequence) -> None:
        if len(seq.prompt) >= self.cfg.max_model_len:
            raise ValueError(
                f"prompt of {len(seq.prompt)} tokens does not fit the context of "
                f"{self.cfg.max_model_len}"
            )
        self.by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_plan(self, step: int) -> StepPlan | None:
        while self.waiting and len(self.running) < self.cfg.max_seqs:
            self.running.append(self.waiting.popleft())
        ready = [
            s
            for s in self.running
            if not s.finished
            and (s.num_scheduled < len(s.prompt) if s.prefilling else not s.in_flight)
        ]
        if not ready:
            if (
                self.release
            ):  # nothing to run, but caches to free: an empty plan carries the release
                plan, self.release = StepPlan(step, [], self.release), []
                self.sent[step] = []
                return plan
            return None
        limit = math.ceil(len(self.running) / self.cfg.microbatches)
        budget = self.cfg.step_tokens
        work: list[tuple[Sequence, SeqWork]] = []
        for s in sorted(ready, key=lambda s: s.prefilling):  # decodes first
            if len(work) >= limit or budget <= 0:
                break
            w = self._work_for(s, budget)
            budget -= len(w.tokens)
            work.append((s, w))
        for s, w in work:
            s.in_flight += 1
            s.num_scheduled = w.start + len(w.tokens)
        plan = StepPlan(step, [w for _, w in work], self.release)
        self.release = []
        self.sent[step] = work
        self.kinds[step] = "prefill" if any(w.start < len(s.prompt) for s, w in work) else "decode"
        return plan

    def _work_for(self, s: Sequence, budget: int) -> SeqWork:
        params = None if s.params_sent else s.params
        s.params_sent = True
        if s.prefilling:
            a = s.num_scheduled
            b = min(len(s.prompt), a + min(self.cfg.chunk_tokens, budget))
            final = b == len(s.prompt)
            return SeqWork(
                s.seq_id,
                a,
                s.prompt[a:b],
                sample=final,
                params=params,
                prompt_logprobs_from=1 if s.params.prompt_logprobs is not None else None,
                lookahead=None if final else s.prompt[b],
            )
        toks = [s.output[-1]] + ([s.draft] if s.draft is not None else [])
        return SeqWork(s.seq_id, s.num_computed, toks, sample=True, draft=s.draft, params=params)

    def on_result(self, step: int, outputs: list[SeqOutput]) -> list[Sequence]:
        """Apply a step's outputs; returns the sequences that finished."""
        sent = self.sent.pop(step)
        by_seq = {o.seq_id: o for o in outputs}
        done = []
        for s, w in sent:
            s.in_flight -= 1
            s.steps += 1
            o = by_seq.get(s.seq_id)
            if o is None:
                raise RuntimeError(f"step {step} returned no output for sequence {s.seq_id}")
            rejected = w.draft is not None and not o.accepted
            s.num_computed = max(s.num_computed, w.start + len(w.tokens) - int(rejected))
            s.prompt_logprobs += o.prompt_logprobs
            if w.draft is not None:
                s.drafts_proposed += 1
                s.drafts_accepted += int(bool(o.accepted))
            if not w.sample:
                continue
            s.draft = o.draft if self.cfg.mtp else None
            for i, t in enumerate(o.tokens):
                s.output.append(t)
                if i < len(o.logprobs):
                    s.logprobs.append(o.logprobs[i])
                if self._stops(s, t):
                    break
            if (
                s.finished
                or len(s.output) >= s.params.max_tokens
                or s.num_computed + 2 > self.cfg.max_model_len
            ):
                s.finish_reason = s.finish_reason or "length"
                done.append(s)
        for s in done:
            self.finish(s)
        return done

    def _stops(self, s: Sequence, t: int) -> bool:
        p = s.params
        if len(s.output) >= p.max_tokens:
            s.finish_reason = "length"
        elif t in p.stop_token_ids or (
            t in self.eos and not p.ignore_eos and len(s.output) > p.min_tokens - 1
        ):
            s.finish_reason = "stop"
        return s.finished

    def finish(self, s: Sequence, reason: str | None = None) -> None:
        if reason:
            s.finish_reason = reason
        if s in self.running:
            self.running.remove(s)
            self.release.append(s.seq_id)
        elif s in self.waiting:
            self.waiting.remove(s)
        self.by_id.pop(s.seq_id, None)

    def fail_all_started(self, error: str) -> list[Sequence]:
        """A stage failed: every started sequence is lost (caches are gone). Waiting ones stay
        queued."""
        failed = list(self.running)
        for s in failed:
            s.error = error
            s.finish_reason = "error"
            s.in_flight = 0
            self.by_id.pop(s.seq_id, None)
        self.running, self.sent, self.release = [], {}, []
        return failed
