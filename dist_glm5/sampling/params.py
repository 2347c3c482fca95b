"""Per-request sampling parameters (no torch: the control plane imports this).

Validated on construction: a bad value names the field and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()  # token-id sequences never to produce
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the chosen token's)
    prompt_logprobs: int | None = None  # likewise for every prompt token after the first
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} {why}")

        if not (self.temperature >= 0):
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 turns it off)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens < 0:
            raise bad("max_tokens", "must be >= 0")
        if not 0 <= self.min_tokens:
            raise bad("min_tokens", "must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise bad(name, "must be between 0 and 20")
        if any(len(w) == 0 for w in self.bad_words):
            raise bad("bad_words", "must not contain an empty word")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "bad_words", tuple(tuple(w) for w in self.bad_words))
        object.__setattr__(
            self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_vocab(p: SamplingParams, vocab: int) -> None:
    ids = [*p.stop_token_ids, *p.logit_bias, *(t for w in p.bad_words for t in w)]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(
            f"token ids {bad[:5]} in the sampling parameters are outside the vocabulary "
            f"0..{vocab - 1}"
        )
