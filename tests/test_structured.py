"""Structured output and the request-level sampling fixes in the engine (in-process, the random
model): rows under a grammar mixed with rows using min_p, logit_bias, min_tokens, bad_words and
penalties, each row as if it ran alone; MTP verifying drafts under the grammar's mask (a draft the
grammar forbids is rejected, never emitted); a preemption rebuilding the matcher from the output;
the penalties as vLLM's formulas; logprobs with int32 ids; stop strings kept on request; special
tokens in the text on request."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
import torch
from runtime_util import coordinator, prompts

from dist_glm5.engine.config import CacheConfig
from dist_glm5.sampling.grammar import GrammarSpec
from dist_glm5.sampling.params import SamplingParams as SP
from dist_glm5.sampling.sampler import process_logits, token_logprobs
from dist_glm5.stages.worker import StageWorker

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "string", "maxLength": 3},
        "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
G = GrammarSpec.json_schema(SCHEMA)
EOS = 257
P = prompts([9, 30, 5, 14, 20, 7, 11], seed=3)
ROWS = [
    SP(max_tokens=60, grammar=G),  # greedy under the grammar (complete outputs are <= 47 bytes)
    SP(max_tokens=60, grammar=G, temperature=1.0, seed=3, min_tokens=60),  # the grammar's EOS wins
    SP(max_tokens=6, temperature=1.0, min_p=0.3, seed=1, ignore_eos=True),
    SP(max_tokens=6, logit_bias={65: 8.0}, ignore_eos=True),
    SP(max_tokens=6, min_tokens=4, logit_bias={EOS: 6.0}),
    SP(max_tokens=6, bad_words=((32,), (10, 10)), ignore_eos=True),
    SP(
        max_tokens=6,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        ignore_eos=True,
    ),
]
GRAMMAR_ROWS = (0, 1)


def check_json(seq):
    assert seq.finish_reason == "stop" and seq.output[-1] == EOS, (seq.finish_reason, seq.text)
    jsonschema.validate(json.loads(seq.text), SCHEMA)


@pytest.fixture(scope="module")
def alone(default_model_dir):
    c = coordinator(default_model_dir)
    return [c.run([p], [r])[0] for p, r in zip(P, ROWS)]


def test_rows_of_a_mixed_batch_are_as_if_alone(default_model_dir, alone):
    out = coordinator(default_model_dir).run(P, ROWS)
    assert [s.output for s in out] == [s.output for s in alone]
    for i in GRAMMAR_ROWS:
        check_json(out[i])
    assert len(out[1].output) < 60  # min_tokens cannot hold the grammar's EOS back
    assert out[3].output == [65] * 6  # logit_bias on its row only
    assert 65 not in out[2].output + out[5].output + out[6].output
    assert len(out[4].output) == 5 and out[4].output[-1] == EOS  # min_tokens on its row only
    assert 32 not in out[5].output
    assert all(out[5].output[i : i + 2] != [10, 10] for i in range(5))


class ForbiddenDrafts(StageWorker):
    """Proposes, for every row under a grammar, a draft the grammar forbids there."""

    def propose(self, seq_id, st, mtp_logits):
        draft, q = super().propose(seq_id, st, mtp_logits)
        if st.matcher is None:
            return draft, q
        bad = int((~st.matcher.allowed()).nonzero()[0])
        if q is not None:
            q = torch.zeros_like(q).index_fill_(0, torch.tensor([bad]), 1.0)
        return bad, q


@pytest.mark.parametrize("worker", [None, ForbiddenDrafts], ids=["mtp", "forbidden-drafts"])
def test_mtp_drafts_are_verified_under_the_mask(default_model_dir, alone, worker):
    c = coordinator(default_model_dir, mtp=True, worker_cls=worker)
    out = c.run(P[:2], ROWS[:2])
    for s in out:
        check_json(s)
        assert s.drafts_proposed > 0
    assert out[0].output == alone[0].output  # greedy: exactly the output without MTP
    if worker is None:  # forced characters ({"a": ...) are proposed and accepted
        assert out[0].drafts_accepted > 0
    else:
        assert out[0].drafts_accepted == out[1].drafts_accepted == 0


def test_preemption_rebuilds_the_matcher_from_the_output(default_model_dir, alone, monkeypatch):
    from dist_glm5.stages import worker as worker_mod

    built = []
    real = worker_mod.GrammarMatcher
    monkeypatch.setattr(worker_mod, "GrammarMatcher", lambda *a: built.append(1) or real(*a))
    # 12 blocks of 8 tokens for ~16 blocks of sequences: the newest (under a grammar) yields
    c = coordinator(default_model_dir, cache=CacheConfig(12, 8), chunk_tokens=8)
    rows = [3, 0, 1]
    out = c.run([P[i] for i in rows], [ROWS[i] for i in rows])
    assert [s.output for s in out] == [alone[i].output for i in rows]
    check_json(out[1]), check_json(out[2])
    assert sum(s.preemptions for s in out[1:]) > 0
    assert len(built) > 2  # rebuilt from the output, then it went on to the same end


def test_penalties_are_vllms_formulas():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    history, prompt = [3, 3, 7, 9], {1, 7, 20}
    p = SP(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.5)
    got = process_logits(logits, p, history, (49,), set(prompt))
    want = logits.clone()
    for t in set(history) | prompt:  # repetition: prompt and output, divide if > 0 else multiply
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    for t in set(history):  # frequency (per occurrence) and presence: the output only
        want[t] -= 0.7 * history.count(t) + 0.4
    torch.testing.assert_close(got, want)
    assert torch.equal(process_logits(logits, SP(), history, (49,), set(prompt)), logits)


def test_logprobs_take_int32_ids():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    want = token_logprobs(logits, 259, 3)
    for tok in (torch.tensor(259, dtype=torch.int32), np.int32(259), torch.tensor([259])[0]):
        assert token_logprobs(logits, tok, 3) == want
    assert want["token"] == 259 and isinstance(want["token"], int)


def test_stop_strings_kept_on_request_and_special_tokens_shown(default_model_dir, alone):
    c = coordinator(default_model_dir)
    free = SP(max_tokens=6, ignore_eos=True)
    text = c.run([P[3]], [free])[0].text
    stop = text[2:4]
    cut, kept = c.run(
        [P[3], P[3]],
        [
            SP(max_tokens=6, ignore_eos=True, stop=[stop], include_stop_str_in_output=x)
            for x in (False, True)
        ],
    )
    assert cut.text == text[:2] and kept.text == text[:4]
    # the stop token's text is not in the output (as vLLM), unless asked for
    bos = SP(max_tokens=3, logit_bias={256: 100.0}, ignore_eos=True)
    shown, hidden = c.run([P[0], P[0]], [replace(bos, skip_special_tokens=False), bos])
    assert shown.text == "<bos>" * 3 and hidden.text == ""
    eos = SP(max_tokens=3, logit_bias={EOS: 100.0}, skip_special_tokens=False)
    s, s2 = c.run([P[0], P[0]], [eos, replace(eos, include_stop_str_in_output=True)])
    assert s.output == [EOS] and s.text == "" and s2.text == "<eos>"


def test_logprobs_under_mtp_and_a_grammar_are_those_without(default_model_dir, alone):
    """The verify rows (draft + bonus) give each emitted token the logprobs of its own row."""
    p = replace(ROWS[0], logprobs=3)
    a = coordinator(default_model_dir).run([P[0]], [p])[0]
    b = coordinator(default_model_dir, mtp=True).run([P[0]], [p])[0]
    assert a.output == b.output == alone[0].output and b.drafts_accepted > 0
    assert len(a.logprobs) == len(b.logprobs) == len(a.output)
    for x, y in zip(a.logprobs, b.logprobs):
        assert x["token"] == y["token"] and abs(x["logprob"] - y["logprob"]) < 1e-4
        assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]
