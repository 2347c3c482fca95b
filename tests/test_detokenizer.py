"""The incremental detokenizer: streamed deltas concatenate to tokenizer.decode(all ids), a
multi-byte UTF-8 character split across tokens is emitted whole, and stop strings are found across
delta boundaries (no model: tokenizers only)."""

from __future__ import annotations

import random

import pytest

from dist_glm5.checkpoint.tokenizer import ByteTokenizer
from dist_glm5.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, StopStrings

TEXT = "héllo wörld 😀 €uro — naïve 日本語, ok 🇫🇷!"


class BPE:
    """A byte-level BPE (tokenizers' ByteLevel, as GLM's tokenizer.json) trained on a little text:
    its merges cut some multi-byte characters between tokens."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        self.tok = Tokenizer(models.BPE())
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        self.tok.train_from_iterator(["hello world naive euro ok"] * 20, trainer)

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


@pytest.fixture(params=["bytes", "bpe"])
def tok(request):
    return ByteTokenizer() if request.param == "bytes" else BPE()


def stream(tok, ids, seed):
    """Deltas as the engine makes them: a random number of tokens (1..3) per step."""
    rng, d, seen, out = random.Random(seed), IncrementalDetokenizer(tok), [], []
    while len(seen) < len(ids):
        seen += ids[len(seen) : len(seen) + rng.randint(1, 3)]
        out.append(d.step(seen))
    out.append(d.finish(seen))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_deltas_concatenate_to_the_decoded_text(tok, seed):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    deltas = stream(tok, ids, seed)
    assert "".join(deltas) == TEXT
    assert not any(REPLACEMENT in d for d in deltas)  # split characters come out whole


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    tok, d = ByteTokenizer(), IncrementalDetokenizer(ByteTokenizer())
    ids = tok.encode("a😀b")  # 1 + 4 + 1 bytes
    got = [d.step(ids[: n + 1]) for n in range(len(ids))]
    assert got == ["a", "", "", "", "😀", "b"]


@pytest.mark.parametrize("seed", range(3))
def test_invalid_bytes_and_special_ids_still_concatenate_exactly(seed):
    # what a random model emits: arbitrary bytes (invalid UTF-8 too) and special ids
    rng = random.Random(seed)
    tok = ByteTokenizer()
    ids = [
        rng.choice([rng.randrange(256), rng.randrange(128), 0xE2, 0x82, 257]) for _ in range(300)
    ]
    assert "".join(stream(tok, ids, seed)) == tok.decode(ids)


@pytest.mark.parametrize("stop", ["o wö", "😀 €", "本語,", "k 🇫🇷"])
def test_stop_strings_are_found_across_delta_boundaries_and_never_streamed(tok, stop):
    ids, at = tok.encode(TEXT), TEXT.find(stop)
    assert at > 0
    stops = StopStrings((stop, "never there"))
    d, text, streamed, found = IncrementalDetokenizer(tok), "", "", None
    for n in range(1, len(ids) + 1):  # one token per step: the stop string spans several
        new_from = len(text)
        text += d.step(ids[:n])
        found = stops.find(text, new_from)
        if found is not None:
            break
        streamed = text[: len(text) - stops.hold]  # what the engine lets out so far
        assert len(streamed) <= at  # nothing of the stop string went out
    assert found == at
