"""Continuous batching with chunked prefill, micro-batches and the KV block ledger (pure Python:
no torch here).

Requests join and leave between steps. Each step's plan takes sequences that are not already in
flight: decodes first (one token, or [token, draft] with MTP), then prefill chunks of at most
`chunk_tokens`, within `step_tokens`. With M micro-batches a plan takes at most ceil(active / M)
sequences, so M plans can be in the pipeline at once and every stage stays busy.

Consecutive prefill chunks of one sequence may be in flight together (a stage runs them in order,
so chunk k+1 finds chunk k's cache): a long prompt keeps every stage busy on its own.
A sequence's `num_computed` counts positions whose KV is valid on every stage. A rejected draft
simply does not count: the next chunk starts at that position and overwrites it, on every stage
and in the MTP layer's cache alike (caches are written by position).

The cache (nano-vllm's BlockManager, one ledger for every stage): a request that can never fit
(prompt + max_tokens beyond the context or the cache) is refused when it is added. A waiting
request is admitted only when the blocks of its whole prefill are free (with one block of headroom
per running sequence); its prompt's blocks go out with its first chunk, a decode's new block with
that decode. When a running sequence cannot grow, the newest sequences not in flight are
preempted (their blocks freed, their KV recomputed later from prompt + output: greedy output is
unchanged) so the oldest keep going. Blocks freed here are reused by the next plan at the
earliest, and every stage runs plans in order, so a chunk still in flight for a finished or
aborted sequence writes its old blocks before anyone else's does.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from dist_glm5.engine.messages import SeqOutput, SeqWork, StepPlan
from dist_glm5.model.block_manager import BlockManager
from dist_glm5.sampling.params import SamplingParams

STEPS_KEPT = 4096  # steps remembered (for profiles): bounded, not one per step forever


class StepKind(NamedTuple):
    """What a step carried, for profiles."""

    kind: str  # "prefill" (any prompt chunk in it) or "decode"
    rows: int  # sequences in it (was the batch whole)


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_scheduled: int = 0  # positions handed to the pipeline (ahead while chunks fly)
    prefill_to: int = 0  # positions to prefill: the prompt (+ the output, after a preemption)
    new_blocks: list[int] = field(default_factory=list)  # granted, not yet sent to the workers
    draft: int | None = None
    in_flight: int = 0  # chunks of this sequence in the pipeline
    params_sent: bool = False  # the workers hold its sampling state
    scheduled_at: float | None = None  # perf_counter() when first put in a plan (queue time)
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    steps: int = 0
    preemptions: int = 0
    # detokenised output (the coordinator's incremental detokenizer; "" without a tokenizer) and
    # how many of its trailing characters may not be streamed yet (they could begin a stop string)
    text: str = ""
    text_hold: int = 0
    detok: object | None = None

    def __post_init__(self) -> None:
        self.prefill_to = self.prefill_to or len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_to

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, a: int, b: int) -> list[int]:
        """Tokens at positions a..b-1 of prompt + output (what a recompute prefills)."""
        n = len(self.prompt)
        if b <= n:
            return self.prompt[a:b]
        return self.prompt[a:] + self.output[max(0, a - n) : b - n]


@dataclass(frozen=True)
class SchedulerConfig:
    max_seqs: int = 64
    chunk_tokens: int = 256
    step_tokens: int = 1024
    microbatches: int = 2
    mtp: bool = False
    max_model_len: int = 1 << 20


class Scheduler:
    def __init__(
        self, cfg: SchedulerConfig, eos: tuple[int, ...], num_blocks: int, block_size: int
    ):
        self.cfg, self.eos = cfg, eos
        self.block_manager = BlockManager(num_blocks, block_size)
        # the longest sequence (prompt + output) ever admitted: the planned context, or the cache
        self.max_len = min(cfg.max_model_len, self.block_manager.capacity)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted (holding blocks), oldest first
        self.by_id: dict[int, Sequence] = {}
        self.release: list[int] = []  # finished: the next plan tells every stage to drop them
        self.preempted: list[int] = []  # preempted: the next plan drops their cache only
        self.sent: dict[int, list[tuple[Sequence, SeqWork]]] = {}  # step -> what went out
        self.steps: dict[int, StepKind] = {}  # the last STEPS_KEPT steps planned
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request, or refuse it (ValueError saying the limit) if it can never fit."""
        want = len(seq.prompt) + max(seq.params.max_tokens, 1)
        if want > self.max_len:
            why = (
                f"the cache of {self.block_manager.capacity} tokens"
                if self.max_len < self.cfg.max_model_len
                else "the planned context"
            )
            raise ValueError(
                f"this model's maximum context length is {self.max_len} tokens ({why}); the "
                f"request needs {want}: {len(seq.prompt)} prompt tokens + max_tokens "
                f"{seq.params.max_tokens}. Shorten the prompt or lower max_tokens"
            )
        self.by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish a request with reason "abort" wherever it is; its blocks are free at once and
        every stage drops it with the next plan (a chunk still in flight is ignored)."""
        s = self.by_id.get(seq_id)
        if s is not None:
            self.finish(s, "abort")
        return s

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.release or self.preempted)

    @property
    def num_preempted_waiting(self) -> int:
        return sum(1 for s in self.waiting if s.preemptions)

    # ---- planning ------------------------------------------------------------------------
    def next_plan(self, step: int) -> StepPlan | None:
        self._admit()
        # prefill chunks may fly together; a decode waits for the sequence's previous result
        ready = [
            s
            for s in self.running
            if ((s.num_scheduled < s.prefill_to) if s.prefilling else not s.in_flight)
        ]
        limit = math.ceil(len(self.running) / self.cfg.microbatches) if self.running else 0
        budget = self.cfg.step_tokens
        work: list[tuple[Sequence, SeqWork]] = []
        for s in sorted(ready, key=lambda s: s.prefilling):  # decodes first, oldest first
            if len(work) >= limit or budget <= 0:
                break
            if s.finished or s not in self.running:  # preempted for an older one just now
                continue
            w = self._work_for(s, budget, {x.seq_id for x, _ in work})
            if w is None:
                continue
            budget -= len(w.tokens)
            work.append((s, w))
        if not work and not self.release and not self.preempted:
            return None
        if work:
            kind = "prefill" if any(s.prefilling for s, _ in work) else "decode"
            self.steps[step] = StepKind(kind, len(work))
            while len(self.steps) > STEPS_KEPT:
                del self.steps[next(iter(self.steps))]
        for s, w in work:
            s.in_flight += 1
            s.num_scheduled = w.start + len(w.tokens)
        plan = StepPlan(step, [w for _, w in work], self.release, self.preempted)
        self.release, self.preempted = [], []
        self.sent[step] = work
        return plan

    def _admit(self) -> None:
        bm = self.block_manager
        while self.waiting and len(self.running) < self.cfg.max_seqs:
            s = self.waiting[0]
            need = bm.need(s.seq_id, s.prefill_to)
            if need + len(self.running) > bm.num_free:  # first come, first served: wait
                return
            self.waiting.popleft()
            s.new_blocks = bm.grow(s.seq_id, s.prefill_to)  # sent with its first chunk
            self.running.append(s)

    def _work_for(self, s: Sequence, budget: int, taken: set[int]) -> SeqWork | None:
        if s.prefilling:
            a = s.num_scheduled
            b = min(s.prefill_to, a + min(self.cfg.chunk_tokens, budget))
        else:
            a = s.num_computed
            b = a + 1 + (s.draft is not None)
        if not self._make_room(s, b, taken):
            return None
        blocks, s.new_blocks = s.new_blocks + self.block_manager.grow(s.seq_id, b), []
        params = None if s.params_sent else s.params
        s.params_sent = True
        if s.scheduled_at is None:
            s.scheduled_at = time.perf_counter()
        if s.prefilling:
            final = b == s.prefill_to
            want_plp = (
                s.params.prompt_logprobs is not None
                and a < len(s.prompt)
                and len(s.prompt_logprobs) < len(s.prompt) - 1
            )
            return SeqWork(
                s.seq_id,
                a,
                s.tokens(a, b),
                sample=final,
                params=params,
                prompt_logprobs_from=1 if want_plp else None,
                lookahead=None if final else s.tokens(b, b + 1)[0],
                blocks=blocks,
            )
        toks = [s.output[-1]] + ([s.draft] if s.draft is not None else [])
        return SeqWork(s.seq_id, a, toks, sample=True, draft=s.draft, params=params, blocks=blocks)

    def _make_room(self, s: Sequence, end: int, taken: set[int]) -> bool:
        """Blocks for `s` up to position `end`: preempt the newest sequences not in flight and
        not in this plan while short; if none is left and nothing newer is in flight, `s` itself
        (the newest) yields. False: `s` waits this step."""
        bm = self.block_manager
        need = bm.need(s.seq_id, end)
        if need <= bm.num_free:
            return True
        newer = self.running[self.running.index(s) + 1 :]
        for v in reversed(newer):
            if need <= bm.num_free:
                break
            if not v.in_flight and v.seq_id not in taken:
                self._preempt(v)
        if need <= bm.num_free:
            return True
        if not any(v.in_flight or v.seq_id in taken for v in newer) and not s.in_flight:
            self._preempt(s)
        return False

    def _preempt(self, s: Sequence) -> None:
        """Free `s`'s blocks and queue it first in line; it is recomputed from prompt + output."""
        self.block_manager.release(s.seq_id)
        self.running.remove(s)
        s.new_blocks = []
        s.num_computed = s.num_scheduled = 0
        s.prefill_to = len(s.prompt) + len(s.output)
        s.draft = None
        if len(s.prompt_logprobs) < len(s.prompt) - 1:
            s.prompt_logprobs = []  # incomplete: recomputed with the prompt
        s.preemptions += 1
        self.num_preemptions += 1
        if s.params_sent:
            self.preempted.append(s.seq_id)
        self.waiting.appendleft(s)

    # ---- results -------------------------------------------------------------------------
    def on_result(self, step: int, outputs: list[SeqOutput]) -> list[Sequence]:
        """Apply a step's outputs; returns the sequences that finished."""
        sent = self.sent.pop(step)
        by_seq = {o.seq_id: o for o in outputs}
        done = []
        for s, w in sent:
            s.in_flight -= 1
            if s.finished:  # aborted (or failed) while in flight: its output is dropped
                continue
            s.steps += 1
            o = by_seq.get(s.seq_id)
            if o is None:
                raise RuntimeError(f"step {step} returned no output for sequence {s.seq_id}")
            if o.error is not None:
                s.error = f"sequence {s.seq_id} failed: {o.error}"
                self.finish(s, "error")
                done.append(s)
                continue
            rejected = w.draft is not None and not o.accepted
            s.num_computed = max(s.num_computed, w.start + len(w.tokens) - int(rejected))
            if o.prompt_logprobs:
                s.prompt_logprobs += o.prompt_logprobs
                del s.prompt_logprobs[max(0, len(s.prompt) - 1) :]  # a recompute's output rows
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
                or s.num_computed + 2 > self.max_len
            ):
                s.finish_reason = s.finish_reason or "length"
                self.finish(s)
                done.append(s)
        return done

    def _stops(self, s: Sequence, t: int) -> bool:
        p = s.params
        if t in p.stop_token_ids or (
            t in self.eos
            and not p.ignore_eos
            # a grammar emits EOS only where it is complete (it wins over min_tokens)
            and (len(s.output) > p.min_tokens - 1 or p.grammar is not None)
        ):
            s.finish_reason = "stop"  # a stop token as the last allowed token is still a stop
        elif len(s.output) >= p.max_tokens:
            s.finish_reason = "length"
        return s.finished

    def finish(self, s: Sequence, reason: str | None = None) -> None:
        if reason:
            s.finish_reason = reason
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        self.block_manager.release(s.seq_id)
        if s.params_sent and s.seq_id in self.by_id:
            self.release.append(s.seq_id)  # the workers hold its state (and maybe cache)
        self.by_id.pop(s.seq_id, None)
        s.new_blocks = []

    def fail_started(self, error: str) -> list[Sequence]:
        """A stage failed: every started sequence is lost (the workers' caches and sampling state
        are gone). Those never started stay queued, in order."""
        failed = [s for s in [*self.running, *self.waiting] if s.params_sent]
        for s in failed:
            s.error = error
            s.finish_reason = "error"
            s.in_flight = 0
            self.by_id.pop(s.seq_id, None)
        keep = [s for s in self.running if not s.params_sent] + [
            s for s in self.waiting if not s.params_sent
        ]
        for s in keep:  # admitted but never sent: their blocks go back with the rest
            s.new_blocks = []
            s.in_flight = 0
        self.running, self.waiting = [], deque(keep)
        self.sent, self.release, self.preempted = {}, [], []
        self.block_manager.reset()
        return failed
