"""A stage worker: one (stage, rank) of the pipeline. Owns a contiguous range of layers, their paged
caches and the weights from its shard; the first stage also the embedding, the last also the final
norm, lm_head, the sampler and the MTP layer.

`StageWorker.step(plan)` is the whole per-step logic, used in-process (tests, single process) or
inside `serve()` (a process, e.g. a Ray actor): control messages arrive over zmq, hidden states
over torch.distributed.

The cache is storage plus the block tables the plans send: the scheduler's ledger decides which
blocks a sequence holds; a worker never allocates. A sampling failure of one sequence is reported
in its SeqOutput and fails that sequence alone.

Structured output: a sequence whose params carry a grammar gets a GrammarMatcher here, on the last
stage, kept in step with its output: every row it samples from (a decode, a bonus token, an MTP
proposal, the target of a draft's verification) is masked by the grammar at that row's position,
and every emitted token is fed to the matcher. The matcher advances only on verified tokens, so a
rejected draft leaves nothing to undo; a draft the grammar forbids has target probability 0 and is
always rejected, and the token emitted instead comes from the masked distribution. After a
preemption the matcher is dropped with the cache and rebuilt from the output tokens.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.checkpoint.shards import ShardedCheckpoint, is_sharded
from dist_glm5.engine.config import StageSpec
from dist_glm5.engine.messages import SeqOutput, SeqWork, StageTime, StepPlan, StepResult
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.obs import profiler
from dist_glm5.obs.peak_rss import peak_rss_mb
from dist_glm5.obs.profiler import PROF
from dist_glm5.planning.partition import expert_ranges
from dist_glm5.sampling.grammar import GrammarMatcher
from dist_glm5.sampling.params import SamplingParams
from dist_glm5.sampling.rejection import verify_draft
from dist_glm5.sampling.sampler import (
    changes_logits,
    grammar_mask,
    make_generator,
    process_logits,
    sample_one,
    target_probs,
    token_logprobs,
    token_logprobs_rows,
)

from .host_memory import fix_mmap_threshold
from .tp import shard_tensor_parallel

log = logging.getLogger(__name__)


@dataclass
class SeqState:
    """What the last stage keeps per sequence: sampling parameters, RNG, outputs, pending draft."""

    params: SamplingParams
    gen: torch.Generator | None
    history: list[int] = field(default_factory=list)
    draft_q: torch.Tensor | None = None
    seen: set[int] = field(default_factory=set)  # prompt tokens, for the repetition penalty
    matcher: GrammarMatcher | None = None  # the grammar, fed `fed` tokens of the history
    fed: int = 0
    mask: tuple[int, torch.Tensor] | None = None  # (fed, allowed): one mask per position


def _shard_selection(model_dir: str, spec: StageSpec) -> tuple[int | None, int | None]:
    """Which part of a sharded checkpoint this worker opens: its own stage (and EP rank) when the
    checkpoint was sharded for this layout, else the whole checkpoint (the loader keeps what it
    owns)."""
    if not is_sharded(model_dir):
        return None, None
    meta = ShardedCheckpoint(model_dir).meta
    if meta["stages"] != spec.stages or meta["layers"][spec.stage] != list(spec.layers):
        return None, None
    ep = spec.engine.layout.ep
    return spec.stage, (spec.rank if meta["ep"] == ep and ep > 1 else None)


class StageWorker:
    def __init__(self, spec: StageSpec, comm=None, backend=None):
        """backend: the engine's (dist_glm5.backends), loaded here when not given. On the CPU the
        model runs as loaded; another backend's `stage` runtime places it on its device, pads
        each step to its buckets and warms up before the first plan."""
        eng = spec.engine
        if eng.threads:
            torch.set_num_threads(eng.threads)
        fix_mmap_threshold()  # before the first weights: peak RSS is what is live (host_memory)
        self.spec, self.comm = spec, comm
        backend = backend or get_backend(eng.backend)
        cfg = ModelConfig.from_hf(eng.model_dir)
        self.cfg = cfg
        layers = range(*spec.layers) if spec.layers else range(cfg.num_hidden_layers)
        self.first, self.last = spec.stage == 0, spec.stage == spec.stages - 1
        if eng.mtp and self.last and cfg.num_nextn_predict_layers == 0:
            raise ValueError(
                f"--mtp needs an MTP layer, but {eng.model_dir} has num_nextn_predict_layers=0"
            )
        ep = eng.layout.ep
        experts = expert_ranges(cfg.n_routed_experts, ep)[spec.rank] if ep > 1 else None
        t0 = time.perf_counter()
        self.model = load_model(
            eng.model_dir,
            dtype=getattr(torch, eng.dtype) if eng.dtype else None,
            shard=_shard_selection(eng.model_dir, spec),
            placement=eng.placement,
            layers=layers,
            embed=self.first,
            head=self.last,
            mtp=self.last and eng.mtp,
            experts=experts,
            ops=backend.ops(),
            dsa=eng.dsa,
        )
        if spec.ranks > 1:
            shard_tensor_parallel(
                self.model, spec.rank, spec.ranks, ep, comm.all_reduce, comm.all_gather_mask
            )
        PROF.enabled = eng.profile
        if eng.profile:  # hooks from outside the model, after tensor parallelism set its reduces
            profiler.install(self.model)
        self.rt = backend.stage(  # the backend's stage runtime (backends/stage.py)
            self.model,
            blocks=eng.cache.blocks,
            block_size=eng.cache.block_size,
            max_model_len=eng.scheduler.max_model_len,
            gather_cap_bytes=eng.dsa.gather_cap_bytes,
            step_tokens=eng.scheduler.step_tokens,
            name=f"s{spec.stage}-r{spec.rank}",
        )
        self.cache = self.rt.new_cache(cfg, self.model.cache_layers, self.model.dtype)
        self.seqs: dict[int, SeqState] = {}
        self.eos = tuple(cfg.eos_token_id)
        self._tokenizer = None  # loaded with the first grammar
        self.busy = 0.0
        log.info(
            "%s: layers %d..%d loaded in %.2fs",
            spec.id,
            layers.start,
            layers.stop - 1,
            time.perf_counter() - t0,
        )
        self.rt.warmup(self.cache)

    # ---- one step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, plan: StepPlan) -> StepResult | None:
        with PROF.span("step"):
            res = self._step(plan)
        if res is not None and self.spec.engine.profile:
            res.events = [list(e) for e in PROF.take()]
        return res

    def _step(self, plan: StepPlan) -> StepResult | None:
        t0 = time.perf_counter()
        for sid in plan.release:
            self.cache.release(sid)
            self.seqs.pop(sid, None)
        for sid in plan.preempted:  # its KV is recomputed later; sampling state (RNG) stays
            self.cache.release(sid)
            if (st := self.seqs.get(sid)) is not None:  # rebuilt from the output when it resumes
                st.matcher, st.mask = None, None
        for w in plan.work:
            self.cache.assign(w.seq_id, w.blocks)
        if not plan.work:
            return (
                StepResult(plan.step, [], [StageTime(self.spec.stage, self.spec.rank, 0.0)])
                if self.last and self.spec.rank == 0
                else None
            )
        chunks = [Chunk(w.seq_id, w.start, len(w.tokens)) for w in plan.work]
        batch = self.rt.prepare(self.cache, chunks)  # maybe padded: pad rows are never sampled
        T = batch.num_tokens
        if self.first:
            x = torch.tensor([t for w in plan.work for t in w.tokens], dtype=torch.int64)
            x = self.rt.inputs(x, T)
        else:
            tw = time.perf_counter()
            with PROF.span("recv_wait"):
                x = self.comm.recv_hidden((T, self.cfg.hidden_size), self.model.dtype, plan.step)
            t0 += time.perf_counter() - tw  # waiting for the previous stage is not busy time
        h, _ = self.rt.forward(x, batch, self.cache)
        if not self.last:
            with PROF.span("transfer"):
                self.comm.send_hidden(h, plan.step)
            self.busy += time.perf_counter() - t0
            return None
        with PROF.span("sampler"):
            outputs = self._sample(plan, batch, h)
        dt = time.perf_counter() - t0
        self.busy += dt
        if self.spec.rank != 0:
            return None
        return StepResult(
            plan.step, outputs, [StageTime(self.spec.stage, self.spec.rank, dt)], peak_rss_mb()
        )

    def _state(self, w: SeqWork) -> SeqState:
        st = self.seqs.get(w.seq_id)
        if st is None:
            if w.params is None:
                raise ValueError(f"sequence {w.seq_id} arrived without sampling parameters")
            st = self.seqs[w.seq_id] = SeqState(w.params, make_generator(w.params))
        return st

    def _sample(self, plan: StepPlan, batch, h: torch.Tensor) -> list[SeqOutput]:
        m = self.model
        hn = m.final_norm(h)
        # The rows the sampling sequences read (the last; a draft's two), through lm_head in one
        # product: one GEMM over the batch, not a GEMV of the largest dense weight per sequence.
        rows, at = [], []
        for w, (_, b) in zip(plan.work, batch.spans):
            at.append(len(rows))
            if w.sample:
                rows += range(b - (1 if w.draft is None else 2), b)
        lg = m.logits(hn[torch.tensor(rows, device=hn.device)]).cpu() if rows else None
        argmax = self._plain_greedy(plan, lg, at)
        outputs, mtp_chunks, mtp_rows, mtp_next, mtp_seqs = [], [], [], [], []
        for k, (w, (a, b), i) in enumerate(zip(plan.work, batch.spans, at)):
            try:
                out, emitted, rejected, st = self._sample_one(w, hn, a, b, lg, i, argmax.get(k))
            except Exception as e:  # this sequence's own failure (a bad value): it alone fails
                log.warning("%s: sequence %d failed in sampling: %s", self.spec.id, w.seq_id, e)
                outputs.append(SeqOutput(w.seq_id, [], error=f"{type(e).__name__}: {e}"))
                continue
            outputs.append(out)
            if m.has_mtp:
                n_valid = len(w.tokens) - int(rejected)
                # the tokens at the valid rows' positions and the one after them: an accepted
                # draft is both w.tokens[1] and emitted[0], and its row's next token is the bonus
                # (emitted[-1]); with all of `emitted` appended that row read the draft again
                actual = w.tokens[:n_valid] + ([emitted[-1]] if w.sample else [w.lookahead])
                if None in actual:
                    raise ValueError(
                        f"sequence {w.seq_id}: a non-final prefill chunk needs its lookahead token "
                        "for MTP"
                    )
                mtp_chunks.append(Chunk(w.seq_id, w.start, n_valid))
                mtp_rows.append(torch.arange(a, a + n_valid))
                mtp_next += actual[1 : n_valid + 1]
                mtp_seqs.append((out, st, w.sample))
        if mtp_chunks:
            with PROF.span("draft"):  # the MTP layer and its proposal (launch profile's "draft")
                self._draft(batch, hn, mtp_chunks, mtp_rows, mtp_next, mtp_seqs)
        return outputs

    def _draft(self, batch, hn, mtp_chunks, mtp_rows, mtp_next, mtp_seqs) -> None:
        """The MTP layer over this step's accepted rows; each sampling sequence's next draft."""
        m = self.model
        nxt, rows = torch.tensor(mtp_next), torch.cat(mtp_rows)
        # the same chunks give the same batch (a decode step whose draft was accepted, or
        # none proposed): its metadata is reused; otherwise (a rejected draft's shorter
        # chunk, a prefill) prepared anew, maybe padded like the layers' step
        same = mtp_chunks == batch.chunks
        mb = batch if same else self.rt.prepare(self.cache, mtp_chunks)
        T, h_rows = mb.num_tokens, hn[rows.to(hn.device)]
        x = self.rt.inputs(nxt, T), self.rt.inputs(h_rows, T)
        hm = self.rt.forward_mtp(*x, mb, self.cache)
        for (out, st, sampled), (_, e) in zip(mtp_seqs, mb.spans):
            if sampled:
                out.draft, st.draft_q = self.propose(
                    out.seq_id, st, m.mtp_logits(hm[e - 1 : e])[0].cpu()
                )

    def _plain_greedy(self, plan: StepPlan, lg, at: list[int]) -> dict:
        """{work index: token, or (its row's, the next row's) argmax for a draft} for the rows
        whose token is their raw logits' argmax (greedy, no grammar or logprobs, logits
        process_logits leaves alone), in one argmax over the batch instead of a processed copy
        and an argmax per row (tens of us each: 1.5 -> 0.9 ms of sampling a step at 32 sequences
        of the embedded model). A greedy draft is kept when it is its row's argmax, and the bonus
        is the next row's (verify_draft's greedy rule without its one-hot copies: this and the
        per-row sampling 0.087 -> 0.058 ms a step, one sequence of a trained model). The same
        ids: torch.argmax keeps the lowest on a tie, as the per-row path."""
        pick, drafts = [], []
        for k, w in enumerate(plan.work):
            st = self.seqs.get(w.seq_id)
            p = st.params if st is not None else w.params
            if not w.sample or p is None or not p.greedy:
                continue
            if p.grammar is not None or p.logprobs is not None:
                continue
            if w.prompt_logprobs_from is not None and p.prompt_logprobs is not None:
                continue
            n = len(st.history) if st is not None else 0
            if w.draft is not None:  # the bonus row comes after the draft: n + 1 tokens out
                if not changes_logits(p, n) and not changes_logits(p, n + 1):
                    drafts.append(k)
            elif not changes_logits(p, n):
                pick.append(k)
        out: dict = {}
        if len(pick) >= 2:  # one row: the per-row path costs the same
            out.update(zip(pick, lg[[at[k] for k in pick]].argmax(-1).tolist()))
        if drafts:
            am = lg[[r for k in drafts for r in (at[k], at[k] + 1)]].argmax(-1).tolist()
            out.update((k, (am[2 * j], am[2 * j + 1])) for j, k in enumerate(drafts))
        return out

    def _sample_one(
        self,
        w: SeqWork,
        hn: torch.Tensor,
        a: int,
        b: int,
        lg_all,
        i: int,
        argmax: int | tuple | None,
    ):
        """One sequence's rows [a, b) of the normed hidden: its prompt logprobs, its sampled
        token(s) or draft verification -> (output, emitted, draft rejected, state). lg_all[i:]:
        the logits of the rows it samples from (its last; a draft's last two); argmax: its token
        (a draft's: its two rows' argmax), when _plain_greedy took it, else None."""
        m = self.model
        st = self._state(w)
        p = st.params
        out = SeqOutput(w.seq_id, [])
        if w.prompt_logprobs_from is not None and p.prompt_logprobs is not None:
            lg = m.logits(hn[a:b]).cpu()  # sampling runs on the host (no copy on the CPU)
            nxt = w.tokens[1:] + ([w.lookahead] if w.lookahead is not None else [])
            first = max(0, w.prompt_logprobs_from - w.start - 1)  # rows before it: not asked
            if first < len(nxt):
                rows = lg[first : len(nxt)]
                out.prompt_logprobs += token_logprobs_rows(rows, nxt[first:], p.prompt_logprobs)
        if p.repetition_penalty != 1.0:  # the prompt's tokens (a decode's: the output's)
            st.seen.update(w.tokens[: len(w.tokens) - (w.draft is not None)])
        emitted, rejected = [], False
        if w.sample:
            self._grammar(st)
            if w.draft is None:
                lg = lg_all[i]
                tok = (
                    argmax
                    if argmax is not None
                    else sample_one(self._processed(st, lg, st.history), p, st.gen)
                )
                self._advance(st, tok)
                emitted, rows = [tok], [lg]
            else:
                lg = lg_all[i : i + 2]
                if argmax is not None:  # _plain_greedy's: (this row's, the next row's) argmax
                    ok, repl = argmax[0] == w.draft, argmax[0]
                else:
                    # under a grammar the target is masked: a forbidden draft has p = 0, never
                    # accepted
                    pr = target_probs(self._processed(st, lg[0], st.history), p)
                    ok, repl = verify_draft(pr, st.draft_q, w.draft, p.greedy, st.gen)
                out.accepted = int(ok)
                if ok:
                    self._advance(st, w.draft)
                    if argmax is not None:
                        bonus = argmax[1]
                    else:
                        nxt = self._processed(st, lg[1], st.history + [w.draft])
                        bonus = sample_one(nxt, p, st.gen)
                    self._advance(st, bonus)
                    emitted, rows = [w.draft, bonus], [lg[0], lg[1]]
                else:
                    self._advance(st, repl)
                    emitted, rows, rejected = [repl], [lg[0]], True
            if p.logprobs is not None:
                out.logprobs = [token_logprobs(r, t, p.logprobs) for r, t in zip(rows, emitted)]
            st.history.extend(emitted)
            out.tokens = emitted
        return out, emitted, rejected, st

    def propose(
        self, seq_id: int, st: SeqState, mtp_logits: torch.Tensor
    ) -> tuple[int, torch.Tensor | None]:
        """The next draft from the MTP layer's logits: drawn like a target token (same processing,
        the same grammar mask), with its proposal distribution q kept for the rejection sampler
        (None for greedy rows)."""
        proc = self._processed(st, mtp_logits, st.history)
        return sample_one(proc, st.params, st.gen), None if st.params.greedy else target_probs(
            proc, st.params
        )

    # ---- structured output ---------------------------------------------------------------
    def _grammar(self, st: SeqState) -> GrammarMatcher | None:
        """The sequence's matcher, built on first use (or after a preemption) from its output."""
        spec = st.params.grammar
        if spec is None or st.matcher is not None:
            return st.matcher
        if self._tokenizer is None:
            from dist_glm5.checkpoint.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.spec.engine.model_dir)
            if self._tokenizer is None:
                raise ValueError("structured output needs the checkpoint's tokenizer")
        st.matcher = GrammarMatcher(spec, self._tokenizer, self.cfg.vocab_size, self.eos)
        st.fed, st.mask = 0, None
        for t in st.history:
            self._advance(st, t)
        return st.matcher

    def _advance(self, st: SeqState, token: int) -> None:
        if st.matcher is None:
            return
        if not st.matcher.accept(token):  # never emitted: the sequence fails instead
            raise RuntimeError(f"token {token} is not allowed by the grammar here")
        st.fed += 1

    def _processed(self, st: SeqState, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """One row's logits after the request's processing and, under a grammar, its mask at the
        matcher's position (computed once per position: a proposal and the verification of the
        same draft share it)."""
        x = process_logits(logits, st.params, history, self.eos, st.seen)
        if st.matcher is None:
            return x
        if st.mask is None or st.mask[0] != st.fed:
            st.mask = (st.fed, st.matcher.allowed())
        return grammar_mask(x, logits, st.mask[1])


# ---- process mode -----------------------------------------------------------------------
class HeartbeatThread(threading.Thread):
    """Beats to the coordinator every `interval` s over a DEALER socket of its own (zmq sockets
    are not thread-safe). The main thread sets `working` / `done` as steps start and finish."""

    def __init__(self, ctx, spec: StageSpec, coord_addr: str, interval: float):
        super().__init__(name=f"heartbeat-{spec.stage}-{spec.rank}", daemon=True)
        import zmq

        self.spec, self.interval = spec, interval
        self.sock = ctx.socket(zmq.DEALER)
        # its own identity: the ROUTER would drop one of two peers that share "stage/rank"
        self.sock.setsockopt(zmq.IDENTITY, b"hb/" + spec.id.identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 8)  # a coordinator that stopped reading: drop, not hoard
        self.sock.connect(coord_addr)
        self.working: int | None = None
        self.done = -1
        self.stopping = threading.Event()

    def run(self) -> None:
        import zmq

        from dist_glm5.engine.messages import Heartbeat, pack

        pid = os.getpid()
        try:
            while not self.stopping.is_set():
                beat = Heartbeat(self.spec.stage, self.spec.rank, pid, self.done, self.working)
                try:
                    self.sock.send(pack(beat), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the queue is full: the coordinator is not reading, nothing to add
                self.stopping.wait(self.interval)
        finally:
            self.sock.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)


def serve(spec: StageSpec, coord_addr: str, dist_init: str | None) -> None:
    """Run one worker until Shutdown: plans in over zmq (DEALER to the coordinator's ROUTER),
    results and errors out the same way; hidden states over torch.distributed; heartbeats from a
    thread of their own."""
    import zmq

    from dist_glm5.backends.comm import Comm
    from dist_glm5.engine.messages import Hello, Shutdown, StepTiming, WorkerError, pack, unpack

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, spec.id.identity)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(coord_addr)
    beat = HeartbeatThread(ctx, spec, coord_addr, spec.engine.heartbeat_interval)
    beat.start()
    comm, step = None, None
    try:
        backend = get_backend(spec.engine.backend)
        if spec.stages * spec.ranks > 1:
            args = (spec.stage, spec.rank, spec.stages, spec.ranks, dist_init)
            if backend.comm is None:
                # gloo gives up after the step timeout (and a margin): the coordinator's own
                # timeout fires first and names the stage that is late, not the one waiting
                comm = Comm(*args, timeout_s=max(120.0, spec.engine.step_timeout + 60.0))
            else:
                comm = backend.comm(*args)
        worker = StageWorker(spec, comm, backend)
        sock.send(pack(Hello(spec.stage, spec.rank, os.getpid())))
        while True:
            msg = unpack(sock.recv())
            if isinstance(msg, Shutdown):
                break
            step = beat.working = msg.step
            t0, s0, b0 = (
                worker.busy,
                comm.send_seconds if comm else 0.0,
                comm.bytes_sent if comm else 0,
            )
            res = worker.step(msg)
            beat.done, beat.working = msg.step, None
            if res is not None:
                sock.send(pack(res))
            elif (spec.rank == 0 and not worker.last) or spec.engine.profile:
                sock.send(
                    pack(
                        StepTiming(
                            msg.step,
                            spec.stage,
                            worker.busy - t0,
                            comm.send_seconds - s0 if comm else 0.0,
                            comm.bytes_sent - b0 if comm else 0,
                            peak_rss_mb(),
                            spec.rank,
                            [list(e) for e in PROF.take()] if spec.engine.profile else [],
                        )
                    )
                )
    except (
        Exception
    ) as e:  # reported, never swallowed: the coordinator fails the in-flight requests
        log.exception("%s failed", spec.id)
        sock.send(
            pack(
                WorkerError(
                    spec.stage,
                    spec.rank,
                    step,
                    f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                )
            )
        )
        raise
    finally:
        beat.stop()
        if comm is not None:
            comm.close()
        sock.close()
        ctx.term()
