"""The reference sampler's filters."""

from __future__ import annotations

import pytest
import torch

from dist_glm5.sampling.params import SamplingParams
from dist_glm5.sampling.sampler import filtered_logprobs, sample


def test_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    lp = filtered_logprobs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(lp).tolist() == [True, True, False, False, False]
    p = torch.softmax(logits, -1)
    lp = filtered_logprobs(logits, SamplingParams(temperature=1.0, top_p=float(p[0] + 0.01)))
    assert torch.isfinite(lp).tolist() == [True, True, False, False, False]
    lp = filtered_logprobs(logits, SamplingParams(temperature=1.0, min_p=float(p[2] / p[0]) - 1e-6))
    assert torch.isfinite(lp).tolist() == [True, True, True, False, False]


def test_greedy_and_seeded():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [SamplingParams()] * 4, [None] * 4).tolist() == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert sample(logits, [p] * 4, [g1] * 4).tolist() == sample(logits, [p] * 4, [g2] * 4).tolist()


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=-0.1), dict(top_p=0), dict(top_k=-1), dict(min_p=2), dict(max_tokens=-1)],
)
def test_invalid(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.mark.parametrize("n", [0, 1, 20])
def test_batched_token_logprobs_equal_the_per_row_function(n):
    """A long prompt's logprobs are computed in one call; each row equals token_logprobs, the
    written-out formula (log_softmax, rank by count of greater entries, topk), ties included."""
    from dist_glm5.sampling.sampler import token_logprobs, token_logprobs_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 259, generator=g)
    logits[3] = 0.0  # every entry tied
    logits[7, :10] = 5.0  # a tie at the top
    tokens = torch.randint(0, 259, (64,), generator=g).tolist()
    rows = token_logprobs_rows(logits, tokens, n)
    assert rows == [token_logprobs(logits[i], tokens[i], n) for i in range(64)]
