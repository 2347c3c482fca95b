"""`bench model-gates`' code check on written-out continuations: what a user would call Python
after the snippet (names, keywords, indentation) passes; a run of spaces, or a word looping back
to back (`return the the the`, p2's and p3's greedy text: indented right, not Python), or a line
looping, fails."""

from __future__ import annotations

import pytest

from dist_glm5.bench.model_gates import code_check

PYTHON = (
    "        for name in filenames:\n"
    "            result.append(os.path.join(dirpath, name))\n"
    "    return result\n"
)


@pytest.mark.parametrize(
    "text, ok",
    [
        (PYTHON, True),
        (PYTHON + "        ", True),  # an indentation the token budget cut short
        (" " * 96, False),  # the shipped model's greedy text in session 9
        ("        return the the the the the the the the", False),
        # p4's greedy text: a two-word loop, inside a docstring
        ('        """Return the path the path the path the path the pa', False),
        ("        path = os.path.join(dirpath, name)   # x", True),  # one run of 3 spaces
        ("        path = os.path.join(dirpath,     name)", False),  # a run of 5 past indentation
        ("        value = self.self.self.name + other", True),  # a chain is not a repeat
        ("        def list_files list_files list_files", False),
        ("        # 1 2 3", False),  # too few names to read as code
        # p4u's greedy text: a line looping (each line alone reads as Python)
        ("        return the path.\n" * 3 + "        return the pa", False),
        ("        total = 0\n" * 2 + "        count = len(names)\n", True),  # twice: no loop
    ],
)
def test_code_check(text, ok):
    assert code_check(text)["pass"] is ok, code_check(text)


def test_code_check_counts_the_repeat():
    r = code_check("        return the the the the")
    assert r["longest_repeat"] == 4 and r["distinct_names"] == 2


def test_line_repeat_counts_blocks_of_lines_and_a_cut_last_repeat():
    from dist_glm5.bench.model_gates import longest_line_repeat

    body = "        if self._alk(self):\n            self._alk(self)\n"
    assert longest_line_repeat(body * 2 + "        if self._alk(self):\n            self") == 3
    assert longest_line_repeat(body * 2 + "        if self._a") == 3  # cut in its first line
    assert longest_line_repeat("    x = 1\n" * 3 + "    x") == 4  # one line, as before
    assert longest_line_repeat("    x = 1\n    y = 2\n    x = 1\n    z = 3\n") == 1
    assert longest_line_repeat("\n\n\n\n    x = 1") == 1  # blank lines are no loop
    text = "def f(a):\n    return a\n\n\ndef g(b):\n    return b\n"
    assert longest_line_repeat(text) == 1 and code_check(text)["longest_repeat"] == 1


def test_heldout_prompts_take_every_texts_opening_then_later_windows():
    from dist_glm5.bench.quality import heldout_prompts

    texts = [bytes([i]) * 2500 for i in range(3)]  # windows at 0, 1024 and 2048 fit 384 bytes
    got = heldout_prompts(texts, 7)
    assert got[:3] == [list(t[:384]) for t in texts]  # the openings, as 6 prompts took before
    assert got[3:6] == [list(t[1024:1408]) for t in texts] and got[6] == list(texts[0][2048:2432])
    with pytest.raises(ValueError, match="10 prompts of 384 bytes asked; the texts hold 9"):
        heldout_prompts(texts, 10)


def test_other_needle_counts_misses_that_begin_as_another_needles_value():
    from dist_glm5.bench.quality import other_needle

    answers = ["nifxrt", "dutu9e", "a284fv"]
    # w2u's 4K code answers (session 21): the first needle given the second's value
    assert other_needle(["dutu9e", "dutu9e", "a284fv"], answers) == 1
    assert other_needle(["nifxr]", "dutu9e", "a2"], answers) == 0  # copied wrong, not swapped
    assert other_needle(answers, answers) == 0


def test_draft_tally_pairs_each_output_token_with_the_row_that_drafted_it():
    from dist_glm5.bench.quality import draft_tally, token_kind

    token_bytes = [bytes([i]) for i in range(256)] + [b"    "]  # id 256: a run of 4 spaces
    assert [token_kind(token_bytes[t]) for t in (32, 256, 10, 65)] == [
        "space", "space", "newline", "other"
    ]  # fmt: skip
    # prompt 5 6 7, output 32 10 65 256: the first output token comes from the prefill (no
    # draft); token q (q >= 4) is drafted by row q - 2
    tokens = [5, 6, 7, 32, 10, 65, 256]
    draft = [0, 0, 10, 99, 256, 0]  # row 2 says 10 (right), row 3 99 (not 65), row 4 256 (right)
    assert draft_tally(3, tokens, draft, token_bytes) == {
        "newline": [1, 1], "other": [1, 0], "space": [1, 1]
    }  # fmt: skip
