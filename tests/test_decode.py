"""Decode over the paged cache equals full recomputation; batching and block sizes change
nothing."""

from __future__ import annotations

import torch

from dist_glm5.model.kv_cache import Chunk
from dist_glm5.model.reference_loop import full_logits, generate
from dist_glm5.sampling.params import SamplingParams


def _prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_decode_equals_full_recompute_64_steps(default_model):
    m = default_model
    prompt = _prompt(80, 1)  # longer than index_topk=64: the DSA selection is sparse throughout
    out = generate(m, [prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0].token_ids
    assert len(out) == 64
    seq = prompt + out
    logits = full_logits(m, seq)
    # every generated token is the argmax of the full recomputation at its position
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out


def test_decode_logits_match_recompute(default_model):
    m = default_model
    seq = _prompt(90, 2)
    full = full_logits(m, seq)
    cache = m.new_cache(8, 16)  # small blocks: many block boundaries
    got = []
    with torch.no_grad():
        b = cache.prepare([Chunk(0, 0, 70)])
        h, _ = m(torch.tensor(seq[:70]), b, cache)
        got.append(m.logits(m.final_norm(h)))
        for p in range(70, 90):  # absorbed MLA form, one token at a time
            b = cache.prepare([Chunk(0, p, 1)])
            h, _ = m(torch.tensor(seq[p : p + 1]), b, cache)
            got.append(m.logits(m.final_norm(h)))
    torch.testing.assert_close(torch.cat(got), full, rtol=0, atol=1e-4)


def test_chunked_prefill_matches_one_shot(default_model):
    m = default_model
    seq = _prompt(100, 3)
    full = full_logits(m, seq)
    cache = m.new_cache(16, 16)
    got = []
    with torch.no_grad():
        for a, b_ in [(0, 37), (37, 41), (41, 100)]:
            b = cache.prepare([Chunk(0, a, b_ - a)])
            h, _ = m(torch.tensor(seq[a:b_]), b, cache)
            got.append(m.logits(m.final_norm(h)))
    torch.testing.assert_close(torch.cat(got), full, rtol=0, atol=1e-4)


def test_batch_of_mixed_lengths_equals_one_by_one(default_model):
    m = default_model
    prompts = [_prompt(n, 10 + n) for n in (5, 70, 33)]
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    together = [g.token_ids for g in generate(m, prompts, p)]
    alone = [generate(m, [q], p)[0].token_ids for q in prompts]
    assert together == alone


def test_seeded_sampling_is_reproducible_and_batch_independent(default_model):
    m = default_model
    a, b = _prompt(20, 4), _prompt(9, 5)
    p = SamplingParams(temperature=1.0, max_tokens=10, seed=123, ignore_eos=True)
    one = generate(m, [a], p)[0].token_ids
    assert generate(m, [a], p)[0].token_ids == one
    assert (
        generate(m, [b, a], [SamplingParams(temperature=0.7, max_tokens=5, seed=9), p])[1].token_ids
        == one
    )


def test_eos_stops(default_model):
    m = default_model
    prompt = _prompt(10, 6)
    first = generate(m, [prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    g = generate(m, [prompt], SamplingParams(max_tokens=5, stop_token_ids=(first,)))[0]
    assert g.token_ids == [first] and g.finish_reason == "stop"
