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

PERIOD_MAX = 64  # the longest phrase a loop repeats (bytes): a line of code
LOOP_MIN = 16  # bytes in a row that repeat the bytes `period` back before a byte counts
CONTINUE = 64  # greedy bytes a prompt is continued by (the gates allow 64-96)
PROMPT = 256  # every prompt's length: the loss's rows are one batch


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


def code_prompt(rng: random.Random, text: bytes, n: int = PROMPT) -> list[int]:
    """n bytes of training code ending with a whole line (its newline last), as the gate's
    snippet does."""
    end = text.find(b"\n", rng.randrange(n, len(text) - 1)) + 1
    if end <= n:  # no newline after the draw: the text's last n bytes
        end = len(text)
    return list(text[end - n : end])


def chat_prompt(rng: random.Random, w: Words, n: int = PROMPT) -> list[int]:
    """n ids of packed tool and JSON chats (as the training rows pack them) ending where an
    assistant's turn starts (after its role tag)."""
    doc = ChatDoc()
    while True:
        (tool_chat if rng.random() < 0.6 else json_chat)(rng, w, doc)
        doc.add("\n")
        r = doc.reply
        starts = [i for i in range(n, len(r)) if r[i] and not r[i - 1]]
        if starts:
            return doc.ids[starts[0] - n : starts[0]]


@torch.no_grad()
def greedy(model, prompt: list[int], n: int = CONTINUE) -> list[int]:
    """The model's greedy continuation of prompt (at most n ids, cut after its first <eos>), with
    transformers' own cached decoding and DSA selection (the trainer's indexers swapped out:
    Trainer.generating). One row a call: batched, transformers' generate took 23x one row's time
    for 6 rows here."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        use_cache=True,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )[0, ids.shape[1] :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


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
