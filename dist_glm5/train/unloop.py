"""Unlikelihood on the model's own loops (Welleck et al. 2019, "Neural text generation with
unlikelihood training", its sequence-level loss), for the recipe's "unloop" phase.

Why: every greedy failure of the trained default model is one failure, a phrase that follows
itself (a docstring of `Return the path the path ...`, a free string `"slect","slect",...`, 96
spaces). More bytes of the base mix lowered the held-out loss and moved none of them (p4). The
sequence-level loss trains on what the model itself writes: the model continues prompts of the
training distribution greedily, the bytes that continue a loop are marked, and -log(1 - p(byte))
pushes each of them down, beside the recipe's usual losses on the base mix (which keep what real
text repeats).

A loop here is a tandem repeat: a byte that equals the byte `period` back, LOOP_MIN or more (and at
least a whole period) in a row. Python repeats phrases, but rarely back to back; its longest
tandem repeats are indentation (at most 12-16 spaces in the stdlib's common lines) and ruler
comments.
"""

from __future__ import annotations

import random

import torch

from .chat_corpus import EOS, ChatDoc, Words, json_chat, tool_chat

PERIOD_MAX = 32  # the longest phrase a loop repeats (bytes)
LOOP_MIN = 16  # bytes in a row that repeat the bytes `period` back before a byte counts
CONTINUE = 64  # greedy bytes a prompt is continued by (the gates allow 64-96)
CODE_PROMPT = 384  # a code prompt: the last lines of a window this long, ending at a newline


def loop_marks(ids: list[int], start: int = 0) -> list[bool]:
    """Per id, does it continue a loop: for some period p <= PERIOD_MAX, it and the ids before it
    equal the ids p back for max(p, LOOP_MIN) ids in a row. Only ids from `start` on are marked
    (a prompt's own repeats are the text's, not the model's), but the run may begin before it."""
    n, out = len(ids), [False] * len(ids)
    for p in range(1, PERIOD_MAX + 1):
        run, need = 0, max(p, LOOP_MIN)
        for t in range(p, n):
            run = run + 1 if ids[t] == ids[t - p] else 0
            if run >= need and t >= start:
                out[t] = True
    return out


def code_prompt(rng: random.Random, text: bytes) -> list[int]:
    """A window of training code that ends with a whole line (its newline last), as the gate's
    snippet does."""
    start = rng.randrange(0, len(text) - CODE_PROMPT)
    w = text[start : start + CODE_PROMPT]
    cut = w.rfind(b"\n", 0, len(w) - 1)
    return list(w[: cut + 1] if cut > 0 else w)


def chat_prompt(rng: random.Random, w: Words) -> list[int]:
    """A tool or JSON chat up to the assistant's first turn (after its role tag)."""
    doc = ChatDoc()
    (tool_chat if rng.random() < 0.6 else json_chat)(rng, w, doc)
    return doc.ids[: doc.reply.index(True)]


@torch.no_grad()
def greedy(model, prompt: list[int], n: int = CONTINUE) -> list[int]:
    """The model's greedy continuation of prompt (at most n ids, stopping after <eos>), with
    transformers' own cached decoding and DSA selection (the trainer's indexers swapped out)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        use_cache=True,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return out[0, len(prompt) :].tolist()


def unlikelihood(logits: torch.Tensor, ids: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """logits [B, S, V] of rows ids [B, S]; marks [B, S] bool: the ids to push down (each
    predicted from the row before it). Mean of -log(1 - p(id)) over the marked ids (0 with
    none)."""
    want = marks[:, 1:]
    if not want.any():
        return logits.sum() * 0.0
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    # log(1 - p) from log p, stable near p = 1
    one_minus = torch.log(-torch.expm1(logp.clamp_max(-1e-6)))
    return -(one_minus[want]).mean()
