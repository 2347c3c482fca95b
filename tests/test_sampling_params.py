"""Each per-request sampling parameter changes the output as specified (in-process runtime)."""

from __future__ import annotations

import pytest
import torch
from runtime_util import coordinator, prompts

from dist_glm5.model.reference_loop import full_logits
from dist_glm5.sampling.params import SamplingParams

P = prompts([12, 40], seed=7)


@pytest.fixture(scope="module")
def coord(default_model_dir):
    return coordinator(default_model_dir)


def run(c, **kw):
    return c.run(P, SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **kw}))


@pytest.fixture(scope="module")
def greedy(coord):
    return [s.output for s in run(coord)]


def test_max_tokens(coord):
    assert [len(s.output) for s in run(coord, max_tokens=3)] == [3, 3]
    assert all(s.finish_reason == "length" for s in run(coord, max_tokens=3))


def test_temperature_and_seed(coord, greedy):
    a = [s.output for s in run(coord, temperature=1.5, seed=11)]
    assert a != greedy
    assert [s.output for s in run(coord, temperature=1.5, seed=11)] == a
    assert [s.output for s in run(coord, temperature=1.5, seed=12)] != a


def test_top_k_1_top_p_tiny_min_p_1_are_greedy(coord, greedy):
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert [s.output for s in run(coord, temperature=2.0, seed=5, **kw)] == greedy, kw


def test_top_k_limits_the_choice(coord, default_model):
    out = run(coord, temperature=5.0, seed=1, top_k=3, max_tokens=1)
    for s in out:
        top3 = full_logits(default_model, s.prompt)[-1].topk(3).indices.tolist()
        assert s.output[0] in top3


def test_logit_bias(coord):
    assert all(s.output == [65] * 12 for s in run(coord, logit_bias={65: 100.0}))


def test_stop_token_ids(coord, greedy):
    t = greedy[0][4]
    s = run(coord, stop_token_ids=[t])[0]
    assert s.output == greedy[0][: greedy[0].index(t) + 1] and s.finish_reason == "stop"


def test_eos_and_min_tokens(coord, default_model):
    eos = default_model.cfg.eos_token_id[0]
    out = coord.run(P, SamplingParams(max_tokens=12, logit_bias={eos: 100.0}))
    assert all(s.output == [eos] and s.finish_reason == "stop" for s in out)
    out = coord.run(P, SamplingParams(max_tokens=12, min_tokens=5, logit_bias={eos: 100.0}))
    assert all(len(s.output) == 6 and s.output[-1] == eos and eos not in s.output[:5] for s in out)


def test_bad_words(coord, greedy):
    one = greedy[0][0]
    assert one not in run(coord, bad_words=[[one]])[0].output
    pair = greedy[0][2:4]  # a two-token word: its second token is banned right after its first
    out = run(coord, bad_words=[pair])[0].output
    assert all(out[i : i + 2] != pair for i in range(len(out) - 1))
    assert out[:3] == greedy[0][:3]  # unchanged until the word would appear


def test_stop_strings(coord, greedy, default_model_dir):
    from dist_glm5.checkpoint.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    text = tok.decode(greedy[1])
    stop = text[5:7]
    s = run(coord, stop=[stop])[1]
    assert s.finish_reason == "stop" and stop not in tok.decode(s.output)
    assert s.output == greedy[1][: len(s.output)] and len(s.output) < len(
        greedy[1]
    )  # cut where the stop string began


def test_logprobs_and_prompt_logprobs(coord, default_model):
    s = run(coord, logprobs=3, prompt_logprobs=2, max_tokens=4)[0]
    full = torch.log_softmax(full_logits(default_model, s.prompt + s.output), -1)
    n = len(s.prompt)
    for i, lp in enumerate(s.logprobs):
        assert lp["token"] == s.output[i]
        assert abs(lp["logprob"] - full[n - 1 + i, s.output[i]].item()) < 1e-4
        assert [t for t, _ in lp["top"]] == full[n - 1 + i].topk(3).indices.tolist()
    assert len(s.prompt_logprobs) == n - 1
    for i, lp in enumerate(s.prompt_logprobs):
        assert (
            lp["token"] == s.prompt[i + 1]
            and abs(lp["logprob"] - full[i, s.prompt[i + 1]].item()) < 1e-4
        )
        assert len(lp["top"]) == 2


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"temperature": -1}, "temperature"),
        ({"logprobs": 99}, "logprobs"),
        ({"bad_words": [[]]}, "bad_words"),
        ({"logit_bias": {999: 1.0}}, "outside"),
        # the malformed bodies: each refused before the engine sees it
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"bad_words": [["a"]]}, "bad_words"),
        ({"bad_words": [[1.5]]}, "bad_words"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2.5}, "top_k"),
        ({"logprobs": 2.5}, "logprobs"),
        ({"stop": [1, 2]}, "stop"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"temperature": float("inf")}, "temperature"),
    ],
)
def test_bad_parameters(coord, kw, needle):
    with pytest.raises(ValueError, match=needle):
        coord.add([1, 2, 3], SamplingParams(**kw))
