"""The coordinator and stage worker in one process: continuous batching, chunked prefill,
micro-batches, MTP speculative decoding with rollback, against the single-process generate()."""

from __future__ import annotations

import pytest
import torch
from runtime_util import coordinator, prompts

from dist_glm5.backends import get_backend
from dist_glm5.model.reference_loop import generate, mtp_one_shot
from dist_glm5.ops.linear import native_bf16_gemm
from dist_glm5.sampling.params import SamplingParams
from dist_glm5.sampling.rejection import verify_draft
from dist_glm5.stages.worker import StageWorker

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(default_model):
    ps = prompts([5, 70, 300, 33, 1])
    return ps, [g.token_ids for g in generate(default_model, ps, GREEDY)]


@pytest.mark.parametrize("mtp", [False, True])
def test_mixed_lengths_arriving_at_different_times_equal_generate(
    default_model_dir, reference, mtp
):
    ps, want = reference
    c = coordinator(default_model_dir, mtp=mtp)
    out = c.run(ps, GREEDY, arrivals=[0, 1, 3, 8, 20])
    assert [s.output for s in out] == want
    assert all(s.finish_reason == "length" for s in out)
    if mtp:
        assert (
            c.stats.acceptance is not None
        )  # reported (the embedded model's MTP layer is random: ~0)


@pytest.mark.xfail(
    native_bf16_gemm(),
    strict=False,
    reason="CPUs with native bf16 GEMM (AVX512-BF16): a prefill chunk's tail of <= 32 rows goes "
    "through the C product, the whole prompt through torch's bf16 GEMM; an ulp apart, they flip "
    "a near-tie of the random model (70-token prompt, chunks 48 + 22). Exact tokens across "
    "chunkings need batch-invariant products (issue 26's note)",
)
def test_bfloat16_serving_dtype_equals_generate_in_bfloat16(default_model_dir, reference):
    """bf16 (the serving dtype) through the coordinator (chunked prefill, micro-batches, MTP) gives
    the tokens of the single-process loop on the same bf16 weights."""
    from dist_glm5.checkpoint.loader import load_model

    ps, _ = reference
    model = load_model(default_model_dir, dtype=torch.bfloat16, ops=get_backend("cpu").ops())
    want = [g.token_ids for g in generate(model, ps, GREEDY)]
    c = coordinator(default_model_dir, mtp=True, dtype="bfloat16", chunk_tokens=48)
    assert c.pipeline.worker.model.dtype == torch.bfloat16
    assert [s.output for s in c.run(ps, GREEDY, arrivals=[0, 1, 3, 8, 20])] == want


class OracleDrafts(StageWorker):
    """Proposes the true next token on even steps and a wrong one on odd steps, so both the accept
    path (draft + bonus, two positions kept) and the reject path (rollback) run."""

    truth: dict[int, list[int]] = {}

    def propose(self, seq_id, st, mtp_logits):
        n = len(st.history)  # the draft would be output token n
        want = self.truth[seq_id]
        good = n < len(want) and n % 2 == 0
        return (want[n] if good else (want[n] + 1) % 256 if n < len(want) else 0), None


def test_mtp_accept_and_reject_paths_keep_greedy_output(default_model_dir, reference):
    ps, want = reference
    OracleDrafts.truth = dict(enumerate(want))
    c = coordinator(default_model_dir, mtp=True, worker_cls=OracleDrafts)
    out = c.run(ps, GREEDY)
    assert [s.output for s in out] == want
    acc = c.stats.acceptance
    assert 0.2 < acc < 0.9, acc  # both paths taken
    assert c.stats.steps < sum(len(w) for w in want)  # accepted drafts saved steps


class RecordedDrafts(OracleDrafts):
    """OracleDrafts' proposals (accepts and rejects in a fixed pattern), keeping the MTP layer's
    logits each proposal was made from: (sequence, output tokens so far, logits)."""

    seen: list = []

    def propose(self, seq_id, st, mtp_logits):
        self.seen.append((seq_id, len(st.history), mtp_logits.clone()))
        return super().propose(seq_id, st, mtp_logits)


def test_every_draft_reads_the_token_that_follows_its_row(
    default_model_dir, default_model, reference
):
    """Served, the MTP layer's last kept row (position q) must read token q + 1, as in training
    (row i reads h_i and t_{i+1}). After an accepted draft that token is the bonus; the worker
    gave that row the draft a second time, so the draft after every accepted one was made from
    the wrong token (the trained m3 accepted 0.38 of its drafts served and 0.66 teacher-forced on
    the same text). Oracle: the MTP pass over the finished sequence in one shot."""
    ps, want = reference
    RecordedDrafts.truth, RecordedDrafts.seen = dict(enumerate(want)), []
    c = coordinator(default_model_dir, mtp=True, worker_cls=RecordedDrafts, dtype="float32")
    assert [s.output for s in c.run(ps, GREEDY)] == want
    after_accept, last = 0, {}
    for sid, n, _ in RecordedDrafts.seen:
        after_accept += n - last.get(sid, n) == 2  # two tokens came: the draft and the bonus
        last[sid] = n
    assert after_accept >= 5, after_accept  # the path the bug was on ran
    for i, (p, w) in enumerate(zip(ps, want)):
        full = mtp_one_shot(default_model, p + w)
        for sid, n, lg in RecordedDrafts.seen:
            if sid == i and n < len(w):  # the proposal of output token n, from row L + n - 2
                torch.testing.assert_close(lg, full[len(p) + n - 2], rtol=0, atol=1e-4)


def test_chunked_prefill_and_microbatches_change_nothing(default_model_dir, reference):
    ps, want = reference
    for sched in (
        {"chunk_tokens": 7, "microbatches": 1},
        {"chunk_tokens": 1000, "microbatches": 4, "max_seqs": 2},
        {"step_tokens": 40},
    ):
        out = coordinator(default_model_dir, **sched).run(ps, GREEDY)
        assert [s.output for s in out] == want, sched


def test_rejection_sampler_emits_the_target_distribution():
    """p: target, q: a different proposal. Over many draws (draft ~ q, verified against p) the
    emitted token's frequencies must match p: total variation below 0.02 with 40,000 draws."""
    g = torch.Generator().manual_seed(0)
    V, n = 8, 40_000
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    counts = torch.zeros(V)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    accepted = 0
    for d in drafts.tolist():
        ok, repl = verify_draft(p, q, d, greedy=False, gen=g)
        accepted += ok
        counts[d if ok else repl] += 1
    tv = 0.5 * (counts / n - p).abs().sum().item()
    assert tv < 0.02, (tv, counts / n, p)
    expect_acc = torch.minimum(p, q).sum().item()  # P(accept) = sum min(p, q)
    assert abs(accepted / n - expect_acc) < 0.02


def test_greedy_verification():
    p = torch.tensor([0.1, 0.7, 0.2])
    assert verify_draft(p, None, 1, greedy=True, gen=None) == (True, None)
    assert verify_draft(p, None, 2, greedy=True, gen=None) == (False, 1)


def test_sampled_mtp_rows_mixed_with_greedy_rows(default_model_dir, reference):
    ps, want = reference
    params = [
        GREEDY,
        SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
    ] * 2 + [GREEDY]
    out = coordinator(default_model_dir, mtp=True).run(ps, params)
    for i in (0, 2, 4):
        assert out[i].output == want[i]
    assert out[1].output != want[1] and len(out[1].output) == 16


def test_batched_argmax_rows_beside_processed_rows(default_model_dir, reference):
    """A decode batch's plain greedy rows take one argmax over the batch (worker._plain_greedy);
    rows whose logits are processed (bad_words, min_tokens, a penalty) keep the per-row path in
    the same step. Each equals its own run alone (one row: the per-row path) and the plain rows
    equal generate()."""
    ps, want = reference
    ban = SamplingParams(max_tokens=16, ignore_eos=True, bad_words=((want[1][0],),))
    eos = want[2][3]  # a token this prompt's greedy text emits: as a stop id under min_tokens
    held = SamplingParams(max_tokens=16, stop_token_ids=(eos,), min_tokens=8)
    pen = SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    params = [GREEDY, ban, held, pen, GREEDY]
    together = coordinator(default_model_dir).run(ps, params)
    assert together[0].output == want[0] and together[4].output == want[4]
    assert want[1][0] not in together[1].output
    for i in (1, 2, 3):
        alone = coordinator(default_model_dir).run([ps[i]], params[i])
        assert together[i].output == alone[0].output, i
