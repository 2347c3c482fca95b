"""Single-process generation: prefill every prompt in one forward, then decode over the paged
cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dist_glm5.model.glm5 import Glm5Model
from dist_glm5.model.kv_cache import Chunk, PagedKVCache
from dist_glm5.sampling.params import SamplingParams
from dist_glm5.sampling.sampler import make_generator, sample


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or a stop id) or "length"


def blocks_needed(lengths: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lengths)


def check_prompts(model: Glm5Model, prompts: list[list[int]]) -> None:
    V = model.cfg.vocab_size
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside 0..{V - 1}: {bad[:5]}")


_DEFAULT_PARAMS = SamplingParams()


@torch.no_grad()
def generate(
    model: Glm5Model,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams] = _DEFAULT_PARAMS,
    cache: PagedKVCache | None = None,
    block_size: int = 64,
) -> list[Generation]:
    check_prompts(model, prompts)
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if cache is None:
        cache = model.new_cache(
            blocks_needed([len(p) + q.max_tokens for p, q in zip(prompts, params)], block_size),
            block_size,
        )
    gens = [make_generator(q) for q in params]
    eos = set(model.cfg.eos_token_id)
    outs = [Generation([], "length") for _ in prompts]
    active = [i for i, q in enumerate(params) if q.max_tokens > 0]
    chunks = [Chunk(i, 0, len(prompts[i])) for i in active]
    inputs = [torch.tensor(prompts[i]) for i in active]
    try:
        while active:
            batch = cache.prepare(chunks)
            h, _ = model(torch.cat(inputs), batch, cache)
            last = torch.tensor([b - 1 for _, b in batch.spans])
            logits = model.logits(model.final_norm(h[last]))
            toks = sample(logits, [params[i] for i in active], [gens[i] for i in active]).tolist()
            still, chunks, inputs = [], [], []
            for i, t, c in zip(active, toks, batch.chunks):
                q = params[i]
                outs[i].token_ids.append(t)
                if (t in eos and not q.ignore_eos) or t in q.stop_token_ids:
                    outs[i].finish_reason = "stop"
                elif len(outs[i].token_ids) < q.max_tokens:
                    still.append(i)
                    chunks.append(Chunk(i, c.end, 1))
                    inputs.append(torch.tensor([t]))
            active = still
    finally:
        for i in range(len(prompts)):
            cache.release(i)
    return outs


@torch.no_grad()
def full_logits(model: Glm5Model, tokens: list[int]) -> torch.Tensor:
    """Logits [n, V] of every position by one uncached forward over the whole sequence (an oracle
    for tests)."""
    cache = model.new_cache(blocks_needed([len(tokens)], 64), 64)
    batch = cache.prepare([Chunk(0, 0, len(tokens))])
    h, _ = model(torch.tensor(tokens), batch, cache)
    return model.logits(model.final_norm(h))


@torch.no_grad()
def mtp_one_shot(model: Glm5Model, tokens: list[int]) -> torch.Tensor:
    """The MTP layer's logits over a finished sequence in one pass: the model over tokens[:-1],
    then the MTP layer at the same positions with the tokens that follow them (tokens[1:]):
    row q proposes token q + 2. [len(tokens) - 1, V] fp32."""
    n = len(tokens) - 1
    cache = model.new_cache(n // 16 + 2, 16)
    b = cache.prepare([Chunk(0, 0, n)])
    h, _ = model(torch.tensor(tokens[:n]), b, cache)
    hm = model.mtp_forward(torch.tensor(tokens[1:]), model.final_norm(h), b, cache)
    return model.mtp_logits(hm)
