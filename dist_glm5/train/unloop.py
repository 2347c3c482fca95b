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

With the grammar (--unloop-grammar) a chat prompt's continuation is held to what the server would
hold that reply to (tool_choice "required" over the chat's tools, or json_object), as the gates
ask for it, and two more failures count: an empty value and a key its JSON object already has
(value_marks). A grammar-held model that writes `""` for every value and then the last key again
never closes its object; the chat corpus writes neither.
"""

from __future__ import annotations

import random

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from dist_glm5.sampling.grammar import GrammarSpec

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
    return chat_prompt_grammar(rng, w, n)[0]


def _pack_chat(rng: random.Random, w: Words, doc: ChatDoc) -> list[dict] | None:
    """One more chat into doc, as the training rows pack them: a tool chat (its tools returned)
    or a JSON one (None)."""
    tools = tool_chat(rng, w, doc) if rng.random() < 0.6 else json_chat(rng, w, doc)
    doc.add("\n")
    return tools


def chat_prompt_grammar(
    rng: random.Random, w: Words, n: int = PROMPT
) -> tuple[list[int], GrammarSpec | None]:
    """chat_prompt's ids (the same draws) and the grammar the server would hold that turn to: a
    call of the chat's tools where the data's turn calls one (tool_choice "required"),
    json_object where it answers a request for JSON, none for a free reply."""
    doc, s, _, spec = chat_turn(rng, w, n)
    return doc.ids[s - n : s], spec


def chat_turn(rng: random.Random, w: Words, n: int) -> tuple[ChatDoc, int, int, GrammarSpec | None]:
    """(packed chats, where the first assistant's turn at or after id n starts, where it ends,
    its grammar: chat_prompt_grammar's)."""
    doc, chats = ChatDoc(), []  # chats: (where each starts, its tools or None for JSON)
    while True:
        chats.append((len(doc.ids), _pack_chat(rng, w, doc)))
        r = doc.reply
        starts = [i for i in range(n, len(r)) if r[i] and not r[i - 1]]
        if starts:
            s = starts[0]
            tools = next(t for a, t in reversed(chats) if a <= s)
            end = next((i for i in range(s, len(r)) if not r[i]), len(r))
            if tools is None:
                spec = GrammarSpec("json_object")
            elif b"<tool_call>" in bytes(i for i in doc.ids[s:end] if i < 256):
                spec = GrammarSpec.tool_calls([t["function"] for t in tools])
            else:
                spec = None
            return doc, s, end, spec


def json_prompt_grammar(
    rng: random.Random, w: Words, n: int = PROMPT
) -> tuple[list[int], GrammarSpec]:
    """n ids of packed chats ending where the assistant answers a request for JSON, and
    json_object: chat_prompt_grammar's turns are calls 95% of the time (a tool chat's listing
    is long, so its call is the first turn past n ids), and the JSON replies are where m5's
    grammar-held gate failed."""
    doc = ChatDoc()
    while len(doc.ids) < n:
        _pack_chat(rng, w, doc)
    json_chat(rng, w, doc)
    s = len(doc.reply) - doc.reply[::-1].index(False)  # the reply's first id
    return doc.ids[s - n : s], GrammarSpec("json_object")


def json_prompt_fresh(rng: random.Random, w: Words) -> tuple[list[int], GrammarSpec]:
    """A request for JSON as a chat's first message, nothing before it (as a client sends one),
    up to where the assistant answers, and json_object. json_prompt_grammar's come after packed
    chats; v7's served replies to the gate's fresh chats looped in 10 of 10, after 256 bytes of
    packed chats in 6 of 10."""
    doc = ChatDoc()
    json_chat(rng, w, doc)
    return doc.ids[: doc.reply.index(True)], GrammarSpec("json_object")


class GrammarMask(LogitsProcessor):
    """transformers' greedy decoding held to a grammar as the server holds it (a mask of the
    tokens it allows next): matcher, a sampling.grammar.GrammarMatcher; start, the prompt's
    length (what follows it is the matcher's to consume)."""

    def __init__(self, matcher, start: int) -> None:
        self.matcher, self.start = matcher, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.start and not self.matcher.accept(int(input_ids[0, -1])):
            raise RuntimeError("the grammar refused the token its own mask allowed")
        allowed = self.matcher.allowed()[: scores.shape[-1]]
        return scores.masked_fill(~allowed, float("-inf"))


def value_marks(tok, ids: list[int], start: int, json_keys: bool) -> list[bool]:
    """Per id of tok's (a ByteTokenizer), from start on: does it write what the chat corpus never
    does, an empty value (`""` as a JSON key's value, `</arg_value>` right after `<arg_value>`) or,
    with json_keys, a key its JSON object already has (all of the key's ids). What the
    grammar-held gates failed on: m5's `{"seam":"","color":"","color":...` ran to max_tokens."""
    pieces = tok.token_bytes()
    out, own, buf = [False] * len(ids), [], bytearray()
    for k in range(start, len(ids)):
        piece = b"" if ids[k] in tok.SPECIAL else pieces[ids[k]]
        buf += piece
        own += [k] * len(piece)
    empty_arg = b"<arg_value></arg_value>"
    at = buf.find(empty_arg)
    while at >= 0:
        out[own[at + len(b"<arg_value>")]] = True
        at = buf.find(empty_arg, at + 1)
    if json_keys:
        _json_marks(buf, own, out)
    return out


def _json_marks(buf: bytearray, own: list[int], out: list[bool]) -> None:
    """value_marks' JSON part: out[id] set for a repeated key's ids and an empty value's closing
    quote; own: the id each byte of buf belongs to."""
    stack: list[set[bytes]] = []  # the keys of each open object
    i, n = 0, len(buf)
    while i < n:
        c = buf[i]
        if c == ord("{"):
            stack.append(set())
        elif c == ord("}") and stack:
            stack.pop()
        elif c == ord('"'):
            j = i + 1
            while j < n and buf[j] != ord('"'):
                j += 2 if buf[j] == ord("\\") else 1
            if j >= n:  # a string still open at the end
                break
            if stack and buf[j + 1 : j + 2] == b":":
                key = bytes(buf[i + 1 : j])
                if key in stack[-1]:
                    for b in range(i + 1, j + 1):  # its bytes and closing quote
                        out[own[b]] = True
                stack[-1].add(key)
                if buf[j + 2 : j + 4] == b'""':
                    out[own[j + 3]] = True
            i = j
        i += 1


@torch.no_grad()
def greedy(model, prompt: list[int], n: int = CONTINUE, matcher=None) -> list[int]:
    """The model's greedy continuation of prompt (at most n ids, cut after its first <eos>), with
    transformers' own cached decoding and DSA selection (the trainer's indexers swapped out:
    Trainer.generating); with matcher (a GrammarMatcher), held to its grammar (GrammarMask). One
    row a call: batched, transformers' generate took 23x one row's time for 6 rows here."""
    ids = torch.tensor([prompt])
    masks = LogitsProcessorList([GrammarMask(matcher, len(prompt))] if matcher else [])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        use_cache=True,
        eos_token_id=EOS,
        pad_token_id=EOS,
        logits_processor=masks,
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
