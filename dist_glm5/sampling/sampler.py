"""Per-request sampling parameters and the reference sampler.

Order (as vLLM): logit_bias, then min_tokens (eos and stop ids masked until enough tokens) and
bad_words (a word's last token is banned where the output ends with the rest of it), then the
penalties (repetition over prompt and output, frequency and presence over the output), then the
grammar's mask (`grammar_mask`: it wins where the request's own bans would leave nothing), then
temperature, top-k, top-p, min-p. Greedy (temperature 0) is argmax with ties to the lowest id.
Sampling draws from the request's own generator (seeded per request, so a seeded request is
reproducible whatever else is in the batch). Logprobs are of the model's raw distribution.
Stop strings are matched by the coordinator on detokenised text.
"""

from __future__ import annotations

import torch

from dist_glm5.sampling.params import SamplingParams


def process_logits(
    logits: torch.Tensor,
    p: SamplingParams,
    history: list[int],
    eos: tuple[int, ...],
    seen: set[int] | frozenset[int] = frozenset(),
) -> torch.Tensor:
    """logits [V] fp32 -> logits after logit_bias, min_tokens, bad_words and the penalties (before
    temperature). history: the output so far; seen: the prompt's tokens (repetition penalty)."""
    x = logits.float().clone()
    for tok, b in p.logit_bias.items():
        x[tok] += b
    if len(history) < p.min_tokens:
        ban = [*p.stop_token_ids, *([] if p.ignore_eos else eos)]
        if ban:
            x[list(ban)] = float("-inf")
    for w in p.bad_words:
        if len(w) == 1 or (
            len(history) >= len(w) - 1 and tuple(history[len(history) - len(w) + 1 :]) == w[:-1]
        ):
            x[w[-1]] = float("-inf")
    if p.penalised:
        x = _penalise(x, p, history, seen)
    return x


def changes_logits(p: SamplingParams, n_out: int) -> bool:
    """Whether process_logits changes a row's logits for `p` after n_out output tokens (where it
    does not, a greedy row's token is its raw argmax: the worker batches those). A step added to
    process_logits is added here."""
    return bool(p.logit_bias) or n_out < p.min_tokens or bool(p.bad_words) or p.penalised


def _penalise(x: torch.Tensor, p: SamplingParams, history: list[int], seen) -> torch.Tensor:
    V = x.shape[-1]
    out = torch.tensor(history, dtype=torch.int64)
    if p.repetition_penalty != 1.0 and (history or seen):
        idx = torch.unique(torch.cat([out, torch.tensor(sorted(seen), dtype=torch.int64)]))
        v = x[idx]
        x[idx] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and history:
        counts = torch.bincount(out, minlength=V)[:V].float()
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return x


def grammar_mask(processed: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Only what the grammar allows: processed logits masked by `allowed` [V] bool. Where the
    request's own bans (min_tokens, bad_words, a -100 bias) removed every allowed token, the
    grammar wins: the raw logits under the mask (a forced output must still complete)."""
    x = processed.masked_fill(~allowed, float("-inf"))
    if float(x.max()) == float("-inf"):
        if not bool(allowed.any()):
            raise RuntimeError("the grammar allows no token here")
        x = raw.float().masked_fill(~allowed, float("-inf"))
    return x


def filtered_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: [V] fp32 -> log-probabilities [V] after temperature and the filters (-inf where
    removed)."""
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


def target_probs(processed: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from: [V] probabilities (one-hot at the argmax when
    greedy)."""
    if p.greedy:
        return torch.zeros_like(processed).scatter_(0, processed.argmax().view(1), 1.0)
    return filtered_logprobs(processed, p).exp()


def sample_one(processed: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    if p.greedy:
        return int(torch.argmax(processed))
    return int(torch.multinomial(filtered_logprobs(processed, p).exp(), 1, generator=gen)[0])


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> dict:
    """The raw model log-probability of `token` (any integer: a Python, NumPy or 0-d tensor id of
    any width; indexing is done with an int64), its rank and the top-n alternatives."""
    token = int(token)
    lp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(lp, n) if n else None
    return {
        "token": token,
        "logprob": float(lp[token]),
        "rank": int((lp > lp[token]).sum()) + 1,  # 1: the most likely
        "top": [[int(i), float(v)] for v, i in zip(top.values, top.indices)]
        if top is not None
        else [],
    }


def token_logprobs_rows(logits: torch.Tensor, tokens: list[int], n: int) -> list[dict]:
    """token_logprobs for every row at once: logits [N, V], tokens N ids -> N dicts, equal to
    [token_logprobs(logits[i], tokens[i], n) for i] (a long prompt's logprobs: one
    log_softmax, one topk and one host copy instead of N of each)."""
    lp = torch.log_softmax(logits.float(), -1)  # [N, V]
    ids = torch.tensor(tokens, dtype=torch.int64)
    chosen = lp.gather(1, ids[:, None])  # [N, 1]
    ranks = ((lp > chosen).sum(1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if n:
        top = torch.topk(lp, n)
        tops = [
            list(map(list, zip(i, v))) for i, v in zip(top.indices.tolist(), top.values.tolist())
        ]
    else:
        tops = [[] for _ in tokens]
    return [
        {"token": int(t), "logprob": c, "rank": r, "top": tp}
        for t, c, r, tp in zip(tokens, chosen, ranks, tops)
    ]


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """logits: [B, V] -> token ids [B] int64 (no history-dependent processing)."""
    return torch.tensor(
        [sample_one(logits[i], p, generators[i]) for i, p in enumerate(params)], dtype=torch.int64
    )


def make_generator(p: SamplingParams) -> torch.Generator | None:
    if p.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(p.seed if p.seed is not None else torch.seed())
    return g
