"""Per-request sampling parameters and the reference sampler.

Greedy (temperature 0) is argmax with ties to the lowest id. Otherwise: logits / temperature,
then top-k, top-p and min-p filters, then one multinomial draw from the request's own generator
(seeded per request, so a seeded request is reproducible whatever else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 turns it off)")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: [V] fp32 -> log-probabilities [V] after temperature and the filters (-inf where removed)."""
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        probs, order = torch.sort(torch.softmax(x, -1), descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return torch.log_softmax(x, -1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] -> token ids [B] int64."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    for i, p in enumerate(params):
        if p.greedy:
            out[i] = torch.argmax(logits[i])
        else:
            probs = filtered_logprobs(logits[i], p).exp()
            out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out


def make_generator(p: SamplingParams) -> torch.Generator | None:
    if p.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(p.seed if p.seed is not None else torch.seed())
    return g
