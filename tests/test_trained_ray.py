"""The trained default model served under Ray in two pipeline stages (a local two-node cluster):
MTP speculative decoding really accepts and really rejects (with the KV rollback) while greedy
output stays that of MTP off, and a needle a few thousand tokens back is found through sparse DSA.
"""

from __future__ import annotations

import random

import pytest
import torch
from runtime_util import ray_nodes, require_trained_weights

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.default_model import TRAINED_DIR
from dist_glm5.checkpoint.tokenizer import load_tokenizer
from dist_glm5.engine.config import CacheConfig, EngineConfig, Layout
from dist_glm5.engine.coordinator import Coordinator
from dist_glm5.engine.scheduler import SchedulerConfig
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.sampling.params import SamplingParams
from dist_glm5.train.corpus import frozen_heldout, make_needles, needle_prompt

require_trained_weights()
SPARSE = DSAConfig(mode="sparse", dense_threshold=0)  # selection on at every context length
TOK = load_tokenizer(TRAINED_DIR)  # the shipped vocabulary: bytes, or with space runs and tags


@pytest.fixture(scope="module")
def cluster():
    with ray_nodes(2, cpus_per_node=2) as c:
        yield c


def serve(mtp: bool, dsa: DSAConfig, blocks: int = 64) -> Coordinator:
    from dist_glm5.stages.ray_pipeline import RayPipeline

    cfg = ModelConfig.from_hf(TRAINED_DIR)
    engine = EngineConfig(
        str(TRAINED_DIR),
        Layout(2, 1, 1),
        CacheConfig(blocks),
        SchedulerConfig(chunk_tokens=1024),
        dsa,
        mtp=mtp,
        dtype="float32",
    )
    return Coordinator(
        RayPipeline(engine), engine.scheduler, cfg.eos_token_id, cfg.vocab_size, step_timeout=300
    )


class DraftLedger:
    """Counts, from the scheduler's side, every verified draft: accepted (then the step emitted
    the draft and a bonus token) or rejected (then the next work of that sequence starts AT the
    draft's position: its KV, written on both stages and in the MTP cache, is overwritten)."""

    def __init__(self, coord: Coordinator):
        self.accepted_with_bonus = self.rejected = self.rolled_back = 0
        self.bad: list[str] = []
        self.expect_start: dict[int, int] = {}
        sched = coord.scheduler
        plan_fn, result_fn = sched.next_plan, sched.on_result

        def next_plan(step):
            plan = plan_fn(step)
            for w in plan.work if plan else []:
                want = self.expect_start.pop(w.seq_id, None)
                if want is not None:
                    self.rolled_back += w.start == want
                    if w.start != want:
                        self.bad.append(f"after a rejection work started at {w.start}, not {want}")
            return plan

        def on_result(step, outputs):
            by_seq = {o.seq_id: o for o in outputs}
            for s, w in sched.sent[step]:
                o = by_seq.get(s.seq_id)
                if o is None or w.draft is None:
                    continue
                if o.accepted:
                    self.accepted_with_bonus += len(o.tokens) == 2
                else:
                    self.rejected += 1
                    self.expect_start[s.seq_id] = w.start + len(w.tokens) - 1
            return result_fn(step, outputs)

        sched.next_plan, sched.on_result = next_plan, on_result


def test_mtp_accepts_and_rejects_with_greedy_output_unchanged(cluster):
    prompt = TOK.encode_bytes(frozen_heldout()[2]["text"].encode()[:200])
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    off = serve(False, SPARSE)
    try:
        (want,) = off.run([prompt], params)
    finally:
        off.close()
    on = serve(True, SPARSE)
    ledger = DraftLedger(on)
    try:
        (got,) = on.run([prompt], params)
        acceptance = on.stats.acceptance
    finally:
        on.close()
    assert got.output == want.output
    assert acceptance is not None and 0 < acceptance < 1, acceptance
    assert ledger.accepted_with_bonus >= 1 and ledger.rejected >= 1, vars(ledger)
    assert ledger.rolled_back >= 1 and not ledger.bad, ledger.bad


def _needle_case():
    """(prompt ids, answer): a needle at 10-30% of held-out code, asked at the key's colon as bench
    quality asks (the answer is the space and the value: a prompt ending in the space would
    split a BPE piece the model only saw whole), the filler long enough for 2,500 ids and 30
    times index_topk in the shipped vocabulary (3,000 bytes; more for BPE pieces)."""
    text = "\n".join(t["text"] for t in frozen_heldout()[3:]).encode()
    for n_bytes in (3000, 4500, 6000, 9000):
        rng = random.Random(7)
        (needle,) = make_needles(rng, 1)
        ask = needle_prompt(rng, text[:n_bytes], [needle], (0.1, 0.3))
        prompt = TOK.encode_bytes(ask + b"\n" + needle.query.removesuffix(b" "))
        if len(prompt) > 2500:
            break
    assert len(prompt) > 2500 and len(prompt) > 30 * ModelConfig.from_hf(TRAINED_DIR).index_topk
    return prompt, " " + needle.value


@pytest.fixture(scope="module")
def needle_answer(cluster):
    """(two-stage sparse DSA answer, expected value, in-process reference-path answer)."""
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.reference_loop import generate

    prompt, value = _needle_case()
    params = SamplingParams(max_tokens=len(value), ignore_eos=True)  # ids enough for its bytes
    c = serve(False, SPARSE)
    try:
        (s,) = c.run([prompt], params)
    finally:
        c.close()
    ref = load_model(TRAINED_DIR, dtype=torch.float32, ops=get_backend("cpu").ops())
    (r,) = generate(ref, [prompt], params)
    return TOK.decode(s.output)[: len(value)], value, TOK.decode(r.token_ids)[: len(value)]


def test_needle_two_stage_sparse_answer_equals_the_reference_path(needle_answer):
    got, _, ref = needle_answer
    assert got == ref


def test_needle_found_through_two_stages_with_sparse_dsa(needle_answer):
    got, value, _ = needle_answer
    assert got == value
