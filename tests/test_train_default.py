"""The trainer of the default model (dist_glm5/train/trainer.py) on a tiny config: sparse joint
steps keep the keys the supervision names (neighbours, induction key) in their rows' selection,
the indexers' supervision trains only the indexers, and the indexers-only phase trains nothing
else."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from dist_glm5.checkpoint.tokenizer import ByteTokenizer
from dist_glm5.train import trainer as td
from dist_glm5.train import unloop
from dist_glm5.train.chat_corpus import Words

TINY = dict(
    td.TRAIN_CONFIG,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    index_topk=24,  # room for the forced window (td.FORCED_BACK) and free picks
    index_head_dim=16,
    index_n_heads=4,
)
S = 96


def _trainer(line_heads: bool = False):
    tr = td.Trainer(td.hf_config(TINY), seed=0, line_heads=line_heads)
    tr.rows_gen.manual_seed(0)
    return tr


def _ids_and_force():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, S), generator=g)
    force = torch.full((2, S), -1)
    rows = torch.arange(40, S, 3)
    force[:, rows] = (rows * 7) % 37  # earlier keys the indexer has no reason to pick
    return ids, force


def _selections(tr):
    sel = {}
    for i in tr.indexers:
        ix = tr._layer(i).self_attn.indexer
        ix.register_forward_hook(lambda m, a, out, i=i: sel.__setitem__(i, out.clone()))
    return sel


def test_sparse_joint_steps_keep_the_forced_keys_in_their_rows_selection():
    tr = _trainer()
    tr.set_sparse(True)
    ids, induction = _ids_and_force()
    sel = _selections(tr)
    with torch.no_grad():
        tr.losses(ids)
        free = dict(sel)
        tr.losses(ids, induction)
        forced = dict(sel)
        scores = {i: tr._layer(i).self_attn.indexer.scores_of(None) for i in tr.indexers}
    k, changed = TINY["index_topk"], 0
    for i in (td.OFFSET_LAYER, td.INDUCTION_LAYER):
        for b in range(2):
            for t in range(k, S):  # rows with more causal keys than picks
                want = {t - o for o in td.FORCED_BACK}
                if i == td.INDUCTION_LAYER and induction[b, t] >= 0:
                    want.add(int(induction[b, t]))
                got = set(forced[i][b, t].tolist())
                assert want <= got, (i, b, t)
                # written out: the other picks are the best-scored keys that remain (scores
                # compared, not indices: relu scores tie)
                sc = scores[i][b, t]
                others = sorted(sc[x].item() for x in got - want)
                rest = sc.clone()
                rest[list(want)] = float("-inf")
                assert others == sorted(rest.topk(k - len(want)).values.tolist()), (i, b, t)
                changed += got != set(free[i][b, t].tolist())
    assert changed, "no row had missed a forced key: the test forces nothing"
    # without induction targets (dense steps, indexers-only phase, inference) nothing is forced
    with torch.no_grad():
        tr.losses(ids)
    assert all(torch.equal(sel[i], free[i]) for i in tr.indexers)


def test_index_supervision_reaches_only_the_indexers():
    """The joint loss adds the indexers' supervision: their detached inputs keep it off the
    model."""
    assert "index" in td.SUPERVISION
    tr = _trainer()
    tr.set_sparse(True)
    ids, induction = _ids_and_force()
    tr.losses(ids, induction)
    tr.attention_supervision(ids, induction)["index"].backward()
    ix = {id(p) for p in tr.indexer_parameters()}
    named = [(n, p) for m in tr.modules() for n, p in m.named_parameters()]
    assert all(p.grad is None or not p.grad.any() for n, p in named if id(p) not in ix)
    assert any(p.grad is not None and p.grad.any() for n, p in named if id(p) in ix)


def test_indexers_phase_trains_only_the_indexers():
    tr = _trainer()
    tr.set_sparse(True)
    ids, force = _ids_and_force()
    tr.freeze_model("indexers")
    ls = tr.losses(ids)
    (ls["kl"] + tr.index_loss(force)).backward()
    ix = {id(p) for p in tr.indexer_parameters()}
    named = [(n, p) for m in tr.modules() for n, p in m.named_parameters()]
    assert all(p.grad is None for n, p in named if id(p) not in ix)
    assert all(p.grad is not None for n, p in named if id(p) in ix), "an indexer got no gradient"
    tr.freeze_model("all")
    assert all(p.requires_grad for _, p in named)


def test_draft_phase_trains_only_the_mtp_layer():
    """The "draft" phase: the draft's losses reach the MTP layer's weights (its projection, norms,
    attention, experts), nothing of the model and not the MTP layer's indexer."""
    tr = _trainer()
    tr.set_sparse(True)
    ids, force = _ids_and_force()
    tr.freeze_model("draft")
    ls = tr.losses(ids, force)
    (ls["mtp"] + ls["mtp_kl"]).backward()
    ix = {id(p) for p in tr.indexer_parameters()}
    draft = {id(p) for p in tr.mtp.parameters()} - ix
    named = [(n, p) for m in tr.modules() for n, p in m.named_parameters()]
    assert all(p.grad is None for n, p in named if id(p) not in draft)
    got = [n for n, p in named if id(p) in draft and p.grad is not None and p.grad.any()]
    assert any("eh_proj" in n for n in got) and any("self_attn" in n for n in got), got
    with pytest.raises(ValueError, match="'all', 'indexers' or 'draft'"):
        tr.freeze_model("mtp")


def test_the_induction_head_and_half_its_indexer_stay_position_free():
    """Their queries' rope rows are zero at the start and after an optimiser step that moves
    every other row: their scores do not depend on the distance to a key."""
    tr = _trainer()
    att = tr._layer(td.INDUCTION_LAYER).self_attn
    c, ix = tr.cfg, att.indexer
    head = c.qk_nope_head_dim + c.qk_rope_head_dim
    q_rope = att.q_b_proj.weight[c.qk_nope_head_dim : head]
    ix_rope = ix.wq_b.weight.view(ix.n_heads, ix.head_dim, -1)[
        : ix.n_heads // 2, : c.qk_rope_head_dim
    ]
    before = att.q_b_proj.weight.detach().clone()
    ids, induction = _ids_and_force()
    opt = torch.optim.AdamW(tr.param_groups(), lr=1e-2)
    ls = tr.losses(ids)
    ls.update(tr.attention_supervision(ids, induction))
    sum(ls.values()).backward()
    opt.step()
    assert not att.q_b_proj.weight[head:].detach().equal(before[head:])  # the others moved
    assert q_rope.abs().max() == 0 and ix_rope.abs().max() == 0


def _columns_by_hand(text: bytes, clip: int) -> tuple[list[int], list[int]]:
    """The column targets written out line by line (trainer.column_targets computes them with
    cumulative maxima over the batch)."""
    run, indent = [], [-100] * len(text)
    for t in range(len(text)):
        k = 0
        while t - k >= 0 and text[t - k] == 32:
            k += 1
        run.append(min(k, clip))
    for nl in [i for i, c in enumerate(text) if c == 10]:
        j = nl + 1
        while j < len(text) and text[j] == 32:
            j += 1
        if j < len(text):  # the line's spaces end inside the row
            for t in range(nl, j):
                indent[t] = min(j - nl - 1, clip)
    return run, indent


def test_column_targets_match_a_line_by_line_count():
    rng = random.Random(0)
    for _ in range(50):
        text = bytes(rng.choice(b"  \n\nab:") for _ in range(rng.randint(1, 60)))
        run, indent = td.column_targets(torch.tensor([list(text)]), 5)
        assert (run[0].tolist(), indent[0].tolist()) == _columns_by_hand(text, 5), text


def _indent_by_hand(text: bytes) -> list[bool]:
    """The bytes that decide a line's indentation, line by line: after each newline, its
    spaces and the byte that ends them (a blank line's newline too)."""
    want = [False] * len(text)
    for nl in [i for i, c in enumerate(text) if c == 10]:
        j = nl + 1
        while j < len(text) and text[j] == 32:
            want[j] = True
            j += 1
        if j < len(text):
            want[j] = True
    return want


def test_indent_targets_match_a_line_by_line_walk():
    rng = random.Random(1)
    for _ in range(50):
        text = bytes(rng.choice(b"  \n\nab:") for _ in range(rng.randint(1, 60)))
        got = td.indent_targets(torch.tensor([list(text)]))[0].tolist()
        assert got == _indent_by_hand(text), text


def _line_keys_by_hand(text: bytes) -> tuple[list[int], list[int]]:
    """line_keys walked line by line: the rows are a line's opening newline and its leading
    spaces; the keys come from the last non-blank line before it whose start the row holds."""
    ik, ek = [-1] * len(text), [-1] * len(text)
    nls = [i for i, c in enumerate(text) if c == 10]
    for n, nl in enumerate(nls):
        rows = [nl]
        j = nl + 1
        while j < len(text) and text[j] == 32:
            rows.append(j)
            j += 1
        # the non-blank lines that end at or before nl and start after a newline in the row
        for m in range(n - 1, -1, -1):
            a, b = nls[m] + 1, nl if m == n - 1 else nls[m + 1]
            line = text[a:b]
            if line.strip(b" "):
                first = a + (len(line) - len(line.lstrip(b" ")))
                code = [i for i in range(a, nl) if text[i] not in b" \n"]
                for r in rows:
                    ik[r], ek[r] = first - 1, code[-1]
                break
    return ik, ek


def test_line_keys_match_a_line_by_line_walk():
    rng = random.Random(2)
    for _ in range(100):
        text = bytes(rng.choice(b"   \n\nab:") for _ in range(rng.randint(1, 60)))
        ik, ek = td.line_keys(torch.tensor([list(text)]))
        assert (ik[0].tolist(), ek[0].tolist()) == _line_keys_by_hand(text), text


def test_line_heads_are_told_to_read_their_keys_and_the_indexer_to_rank_them():
    """With line heads on, one step has both line losses (finite, graph kept to the heads'
    query and key) and the indexer's loss grows by the line keys' ranking."""
    tr = _trainer(line_heads=True)
    ids = torch.tensor([list(b"def f(x):\n    if x:\n        return 1\n    return 2\n" * 2)])
    tr.losses(ids)
    sup = tr.attention_supervision(ids, torch.full_like(ids, -1))
    assert set(td.LINE_LOSSES) <= sup.keys()
    (sup["line_indent"] + sup["line_end"]).backward()
    att = tr.model.model.layers[td.INDENT_LAYER].self_attn
    assert att.q_b_proj.weight.grad.any() and att.kv_a_proj_with_mqa.weight.grad.any()
    off = _trainer()
    off.losses(ids)
    assert not set(td.LINE_LOSSES) & off.attention_supervision(ids, torch.full_like(ids, -1)).keys()


def test_column_supervision_trains_the_window_head_and_its_read_outs():
    """The window loss falls when the column head's query and key move (one step on it alone),
    and both read-outs get gradients."""
    tr = _trainer()
    ids = torch.tensor([list(b"def f(x):\n    if x:\n        return 1\n    return 2\n" * 2)])
    tr.losses(ids)
    sup = tr.attention_supervision(ids, torch.full_like(ids, -1))
    assert {"window", "run", "indent"} <= sup.keys()
    (sup["window"] + sup["run"] + sup["indent"]).backward()
    assert tr.columns["run"].weight.grad.any() and tr.columns["indent"].weight.grad.any()


def test_mtp_distillation_is_the_kl_to_the_next_rows_detached_logits():
    """mtp_distill against the KL written out per row in float64; the teacher gets no gradient."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    draft = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    got = td.mtp_distill(draft, logits)
    want = 0.0
    for b in range(2):
        for i in range(5):
            p = torch.softmax(logits[b, i + 1].double(), -1)
            q = torch.softmax(draft[b, i].double(), -1)
            want += float((p * (p.log() - q.log())).sum().detach())
    assert abs(got.item() - want / 10) < 1e-5
    got.backward()
    assert logits.grad is None and draft.grad.abs().sum() > 0
    ls = _trainer().losses(torch.randint(0, 256, (1, 40), generator=g))
    assert ls["mtp_kl"].detach().item() >= 0


def test_export_only_writes_the_weights_the_run_exported(tmp_path):
    # `train-default --export-only` gates a run as it goes: the weights it writes from the run's
    # state.pt are the ones the run itself exported at that step, byte for byte
    from safetensors.torch import load_file

    td.train(tmp_path / "run", steps=1, seed=3, export_to=tmp_path / "by-run")
    assert td.export_state(tmp_path / "run", tmp_path / "by-state", seed=3) == 1
    a = load_file(tmp_path / "by-run" / "model.safetensors")
    b = load_file(tmp_path / "by-state" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(FileNotFoundError, match="train first"):
        td.export_state(tmp_path / "nothing", tmp_path / "x", seed=3)


def test_position_skips_jump_once_and_attention_still_crosses_the_jump():
    """skip_positions (PoSE): each row jumps at most once, by at most SKIP_MAX overall, the same
    for the same seed and step; contiguous ids give the recipe's losses to every digit; after a
    jump the rows still attend to the keys before it (transformers reads a jump without a mask
    as a new packed sequence); the offset supervision leaves out rows whose key is across it."""
    a, b = td.skip_positions(3, 7, 4, S, 1.0), td.skip_positions(3, 7, 4, S, 1.0)
    assert torch.equal(a, b)
    assert not torch.equal(a, td.skip_positions(3, 8, 4, S, 1.0))
    steps = a.diff(dim=1)
    assert ((steps != 1).sum(1) <= 1).all() and (steps >= 1).all()
    assert (a[:, 0] == 0).all() and (a[:, -1] < td.SKIP_MAX).all()
    assert torch.equal(td.skip_positions(3, 7, 4, S, 0.0), torch.arange(S).repeat(4, 1))

    tr = _trainer()
    ids, _ = _ids_and_force()
    none = torch.full_like(ids, -1)
    with torch.no_grad():
        tr.rows_gen.manual_seed(0)
        base = tr.losses(ids) | tr.attention_supervision(ids, none)
        tr.rows_gen.manual_seed(0)
        same = tr.losses(ids, None, torch.arange(S).repeat(2, 1))
        same |= tr.attention_supervision(ids, none)
        assert {k: v.item() for k, v in base.items()} == {k: v.item() for k, v in same.items()}

        pos = torch.arange(S).repeat(2, 1)
        pos[:, 50:] += 10_000
        tr.losses(ids, None, pos)
        w = tr.heads[td.OFFSET_LAYER]  # [B, H, S, S]
        assert (w[:, :, 60, :50].sum(-1) > 0.01).all()  # not a packed-sequence boundary
        near = tr._near(1)  # rows t >= 1: row 50's previous byte is 10,001 positions back
        assert not near[:, 49].any() and near[:, 48].all() and near[:, 50].all()


def test_base_extra_lengthens_the_base_phase_and_moves_the_later_ones():
    assert td.phases(0) == td.PHASES
    plan = td.phases(100)
    drill, base = td.PHASES[0], td.PHASES[1]
    assert plan[0] == drill  # the drill ends where it did
    assert [(p.end - q.end, p.mix, p.train) for p, q in zip(plan[1:], td.PHASES[1:])] == [
        (100, q.mix, q.train) for q in td.PHASES[1:]
    ]
    # a step of the old base phase's tail is still base; the draft phase ends 100 later
    assert td.phase_of(base.end + 50, plan).mix == "base"
    assert td.phase_of(plan[-1].end - 1, plan).train == "draft"


def test_code_share_scales_the_copying_documents_and_keeps_the_chats():
    assert td.code_mixes(0.0) is td.MIXES
    mixes = td.code_mixes(0.45)
    assert mixes["drill"] == td.MIXES["drill"]
    for name in ("base", "long"):
        old, new = td.MIXES[name], mixes[name]
        assert new["chat"] == old["chat"]
        assert 1.0 - sum(new.values()) == pytest.approx(0.45)  # the rest of a mix is code
        ratios = [new[k] / old[k] for k in ("needle", "copy", "repeat")]
        assert ratios == pytest.approx([ratios[0]] * 3) and ratios[0] < 1.0
    with pytest.raises(ValueError, match="between its own 0.25 and 0.65"):
        td.Data(0, code_share=0.7)  # before the corpus loads


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--code-share", "0.9"], "--code-share: code share 0.9 for the base mix"),
        (["--simple-code", "-0.1"], "--simple-code is a share of the plain code rows"),
        (["--copy-pieces"], "--copy-pieces draws from a BPE vocabulary's pieces: give --bpe N"),
        (["--needle-decoys", "-1"], "--needle-decoys and --unloop-json are counts"),
        (["--unloop-json", "2"], "--unloop-json adds prompts to the unloop phase: give --unloop N"),
        (["--unloop", "9", "--unloop-json-fresh"], "--unloop-json-fresh says how --unloop-json's"),
    ],
)
def test_train_default_refuses_bad_data_flags(tmp_path, argv, message):
    import argparse

    from dist_glm5.bench import train_default

    p = argparse.ArgumentParser()
    train_default.register(p)
    args = p.parse_args(["--out", str(tmp_path / "run"), *argv])
    with pytest.raises(SystemExit, match=message):
        train_default.run(args)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def _loop_marks_by_regex(text: bytes, start: int) -> list[bool]:
    """Oracle: every tandem repeat found by a backreference regex (a phrase of 1..PERIOD_MAX
    bytes that follows itself back to back), its bytes past the first max(p, LOOP_MIN) after
    the first copy marked."""
    import re

    out = [False] * len(text)
    for p in range(1, unloop.PERIOD_MAX + 1):
        for m in re.finditer(rb"(?=((.{%d})\2+))" % p, text, re.S):
            span = m.start(1), m.end(1)
            first = span[0] + p + max(p, unloop.LOOP_MIN) - 1  # the first byte a run counts
            for t in range(max(first, start), span[1]):
                out[t] = True
    return out


def test_loop_marks_are_the_tandem_repeats_a_regex_finds():
    """unloop.loop_marks against a backreference regex, on the loops the gates met (p4's greedy
    code and free strings, p1e's spaces) and on code that repeats phrases, but not back to back."""
    texts = [
        b'        """Return the path the path the path the path the path',
        b'<arg_value>["slect","slect","slect","slect","slect","slect","slect"',
        b"    for x in y:\n" + b" " * 96,
        b"x = 10000000000000000000000000000000000000",
        b"def f(self):\n        self.a = a\n        self.b = b\n        return self.a + self.b\n",
        b"    # " + b"-" * 40 + b"\n",
    ]
    for text in texts:
        for start in (0, 20):
            assert unloop.loop_marks(list(text), start) == _loop_marks_by_regex(text, start), text
    # what Python repeats (indentation up to LOOP_MIN, names on following lines) is not a loop
    assert not any(unloop.loop_marks(list(texts[4])))
    loop = list(texts[0])
    assert sum(unloop.loop_marks(loop)) > 20 and not any(unloop.loop_marks(loop, len(loop)))


def test_unlikelihood_is_minus_log_one_minus_p_of_the_marked_ids():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g) * 3
    ids = torch.randint(0, 11, (2, 7), generator=g)
    marks = torch.zeros(2, 7, dtype=torch.bool)
    marks[0, 3] = marks[1, 6] = marks[1, 1] = True
    p = torch.softmax(logits.double(), -1)
    want = [-math.log(1 - p[b, t - 1, ids[b, t]].item()) for b, t in ((0, 3), (1, 1), (1, 6))]
    got = unloop.unlikelihood(logits, ids, marks)
    assert got.item() == pytest.approx(sum(want) / 3, rel=1e-5)
    assert unloop.unlikelihood(logits, ids, torch.zeros_like(marks)).item() == 0.0
    # the first id has no row before it: a mark there pushes nothing
    first = torch.zeros_like(marks)
    first[0, 0] = True
    assert unloop.unlikelihood(logits, ids, first).item() == 0.0


def test_unloop_phase_goes_before_the_indexers_and_the_draft():
    assert td.phases(0, 0) == td.PHASES
    plan = td.phases(0, 40)
    ul = [ph for ph in plan if ph.unlikelihood]
    assert len(ul) == 1 and ul[0].train == "all" and ul[0].sparse
    i = plan.index(ul[0])
    assert plan[i + 1].train == "indexers" and plan[-1].train == "draft"
    assert ul[0].end - plan[i - 1].end == 40
    assert [ph.end - 40 for ph in plan[i + 1 :]] == [ph.end for ph in td.PHASES[i:]]


def test_unloop_loss_pushes_down_the_models_own_loop():
    """A tiny model's greedy continuation (transformers' generate, its own indexers) of a prompt
    that ends in a loop continues it; the unloop loss marks those bytes, reaches the model's
    weights, and one step against it lowers the loop byte's probability. The trainer's own
    indexers are back afterwards."""
    tr = _trainer()
    tr.set_sparse(True)
    prompt = list(b"ab" * 40)
    with tr.generating() as m:
        cont = unloop.greedy(m, prompt)
    assert all(
        tr._layer(i).self_attn.indexer.forward.__func__ is td._indexer_forward for i in tr.indexers
    )
    row = torch.tensor([prompt + cont])
    marks = unloop.loop_marks(row[0].tolist(), start=len(prompt))
    loss, n = tr.unloop_loss([prompt])
    assert n == sum(marks)
    if not n:  # the random model left the loop at once: nothing to push
        assert loss.item() == 0.0
        return
    opt = torch.optim.SGD(tr.parameters(), lr=0.5)
    loss.backward()
    assert any(p.grad is not None and p.grad.any() for p in tr.model.parameters())
    before = loss.item()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        logits = tr.model(input_ids=row).logits
    after = unloop.unlikelihood(logits, row, torch.tensor([marks])).item()
    assert after < before


def test_draft_greedy_rows_are_the_prompts_and_the_models_argmax_continuations():
    """Trainer.greedy_rows (the draft phase's rows with --draft-greedy): each prompt, then what a
    plain argmax loop over the model's full forward writes (no cache; its own indexers, as
    generate uses them), cut to the shortest row; the trainer's indexers are back afterwards."""
    tr = _trainer()
    tr.set_sparse(True)
    prompts = [list(b"def f(x):\n    return x"), list(b"ab" * 12)]
    rows = tr.greedy_rows(prompts)
    assert all(
        tr._layer(i).self_attn.indexer.forward.__func__ is td._indexer_forward for i in tr.indexers
    )
    want = []
    with tr.generating() as m, torch.no_grad():
        for p in prompts:
            row = list(p)
            for _ in range(unloop.CONTINUE):
                nxt = int(m(input_ids=torch.tensor([row])).logits[0, -1].argmax())
                row.append(nxt)
                if nxt == unloop.EOS:
                    break
            want.append(row)
    S = min(map(len, want))
    assert rows.shape == (2, S) and rows.tolist() == [w[:S] for w in want]


def _marked_bytes(tok: ByteTokenizer, text: bytes, start_text: bytes = b"") -> bytes:
    """value_marks over tok's ids of start_text + text, from text on: the marked ids' bytes,
    joined with "|" between runs of marked ids."""
    ids = tok.encode_bytes(start_text + text)
    start = len(tok.encode_bytes(start_text))
    pieces = tok.token_bytes()  # the texts hold no special ids
    marks = unloop.value_marks(tok, ids, start, json_keys=True)
    out, prev = [], False
    for i, m in zip(ids, marks):
        if m:
            out.append((b"" if prev or not out else b"|") + pieces[i])
        prev = m
    return b"".join(out)


def test_value_marks_are_empty_values_and_repeated_keys_written_out():
    """unloop.value_marks on written-out replies, the marked bytes named by hand: m5's grammar-held
    json_object reply, nesting (a key again in an inner object is not a repeat), escaped quotes,
    an empty argument in GLM's call format (as bytes and as one tag id), and nothing before
    start."""
    tok = ByteTokenizer()
    m5 = b'{"seam":"","color":"","color":"","x":1}'
    # the closing quote of each empty value; the repeated key's bytes and closing quote
    assert _marked_bytes(tok, m5) == b'"|"|color"|"'
    assert _marked_bytes(tok, b'{"a":{"a":1,"b":[1]},"b":"x"}') == b""
    assert _marked_bytes(tok, b'{"a\\"b":"q\\",\\"","a\\"b":2}') == b'a\\"b"'
    call = b"<tool_call>f<arg_key>k</arg_key><arg_value></arg_value></tool_call>"
    assert _marked_bytes(tok, call) == b"<"
    assert _marked_bytes(ByteTokenizer(16, chat_tags=True), call) == b"</arg_value>"
    # a key the prompt's object holds is not the continuation's repeat; start counts ids
    assert _marked_bytes(tok, b'"a":1}', start_text=b'{"a":2,') == b""
    # ids of several bytes (a run of spaces) map back to their bytes
    assert _marked_bytes(ByteTokenizer(16), b'{"a":"x   y","a":""}') == b'a"|"'


def test_chat_turn_grammar_accepts_the_data_reply_and_matches_chat_prompt():
    """unloop.chat_prompt_grammar's prompt is chat_prompt's (the same draws), and its grammar,
    compiled by llguidance as the server compiles it, accepts the data's own reply: a call of the
    chat's tools, or the JSON object a request asked for (llguidance is the oracle of both)."""
    from dist_glm5.sampling.grammar import GrammarMatcher

    w = Words.from_text(
        b"".join(b"def f%d(x):\n    return x + %d\n\n" % (i, i) for i in range(400))
    )
    tok = ByteTokenizer()
    kinds = set()
    for seed in range(40):
        a = unloop.chat_prompt(random.Random(seed), w)
        b, spec = unloop.chat_prompt_grammar(random.Random(seed), w)
        assert a == b and len(a) == unloop.PROMPT
        doc, s, end, spec2 = unloop.chat_turn(random.Random(seed), w, unloop.PROMPT)
        assert spec2 == spec and doc.ids[s - unloop.PROMPT : s] == a
        reply = bytes(i for i in doc.ids[s:end] if i < 256)
        kinds.add(spec and spec.kind)
        if spec is None:  # a free reply: the one quoting a tool's result
            assert b"<tool_call>" not in reply
            continue
        if spec.kind == "tool_calls":  # from the call on (a few words may come first)
            reply = reply[reply.index(b"<tool_call>") : reply.rindex(b"</tool_call>") + 12]
        else:
            assert isinstance(json.loads(reply), dict)
        m = GrammarMatcher(spec, tok, tok.vocab_size, (tok.eos_id,))
        assert all(m.accept(t) for t in tok.encode_bytes(reply)), reply
        assert m.accept(tok.eos_id), reply  # and the grammar may end there
    assert kinds == {"tool_calls", "json_object"}


def test_greedy_under_a_grammar_is_the_masked_argmax():
    """unloop.greedy with a matcher (transformers' cached generate + GrammarMask) against a plain
    loop over the model's full forward: the argmax of the tokens llguidance allows, fed back
    token by token; the text is what the grammar accepts."""
    from dist_glm5.sampling.grammar import GrammarMatcher, GrammarSpec

    tr = _trainer()
    tr.set_sparse(True)
    tok = ByteTokenizer()
    prompt = list(b"<|user|>\nReply in JSON.\n<|assistant|>\n")
    spec = GrammarSpec("json_object")
    got = tr.greedy_continuations([prompt], [spec])[0]
    m = GrammarMatcher(spec, tok, tr.model.config.vocab_size, (unloop.EOS,))
    row = list(prompt)
    with tr.generating() as model, torch.no_grad():
        for _ in range(unloop.CONTINUE):
            logits = model(input_ids=torch.tensor([row])).logits[0, -1]
            nxt = int(logits.masked_fill(~m.allowed(), float("-inf")).argmax())
            row.append(nxt)
            if nxt == unloop.EOS:
                break
            assert m.accept(nxt)
    assert got == row[len(prompt) :]
    assert bytes(got[:1]) == b"{"  # the grammar's first byte, whatever the random model says


def _unloop_data(space_runs: int) -> td.Data:
    data = td.Data.__new__(td.Data)  # the corpus' text and words without loading the stdlib
    data.seed, data.tok, data.text = (
        3,
        ByteTokenizer(space_runs),
        b"".join(b"def f%d(x):\n    return x + %d\n\n" % (i, i) for i in range(400)),
    )
    data.words = Words.from_text(data.text)
    data.unloop_json, data.unloop_json_fresh = 0, False
    return data


def test_unloop_prompts_are_one_length_and_end_where_the_model_should_write():
    data = _unloop_data(0)
    prompts = data.unloop_prompts(5)
    assert prompts == data.unloop_prompts(5)  # a function of seed and step
    n_code, n_chat = td.UNLOOP_ROWS
    assert len(prompts) == n_code + n_chat and {len(p) for p in prompts} == {unloop.PROMPT}
    assert all(bytes(p).endswith(b"\n") for p in prompts[:n_code])
    assert all(bytes(p).endswith(b"<|assistant|>\n") for p in prompts[n_code:])


def test_unloop_batch_with_grammars_asks_for_json_every_other_chat():
    """Without the grammar flag unloop_batch's prompts are unloop_prompts' (the recipe's data
    unchanged); with it the chat prompts alternate between a chat's next turn (its grammar) and
    a JSON reply under json_object, each ending where the assistant writes."""
    data = _unloop_data(0)
    n_code, n_chat = td.UNLOOP_ROWS
    plain, grammars = data.unloop_batch(5)
    assert plain == data.unloop_prompts(5) and grammars == [None] * (n_code + n_chat)
    prompts, grammars = data.unloop_batch(5, grammar=True)
    assert prompts[:n_code] == plain[:n_code] and grammars[:n_code] == [None] * n_code
    assert [g.kind for g in grammars[n_code + 1 :: 2]] == ["json_object"] * (n_chat // 2)
    tag = list(b"<|assistant|>\n")
    assert all(p[-len(tag) :] == tag for p in prompts[n_code:])  # packed chats hold <eos> ids
    assert {len(p) for p in prompts} == {unloop.PROMPT}


def test_unloop_prompts_with_space_runs_are_the_byte_prompts_as_the_tokenizer_reads_them():
    as_bytes, as_runs = _unloop_data(0).unloop_prompts(5), _unloop_data(16).unloop_prompts(5)
    tok = ByteTokenizer(16)
    for b, r in zip(as_bytes, as_runs, strict=True):
        # the same text, and exactly the ids the tokenizer gives it (its regex, not the merge)
        assert tok.decode(r, skip_special_tokens=False) == bytes(b).decode()
        assert r == tok.encode_bytes(bytes(b))
    assert all(tok.run_id(4) in p and len(p) < unloop.PROMPT for p in as_runs[: td.UNLOOP_ROWS[0]])


def test_unloop_at_long_goes_before_the_long_phases():
    plan = td.phases(0, 300, "long")
    base_end = td.PHASES[1].end
    ul = td.phase_of(base_end, plan)
    assert ul.unlikelihood and ul.end == base_end + 300
    assert td.phase_of(base_end + 300, plan).mix == "long"
    # every phase after it moves by 300; the ones before do not
    assert [p.end for p in plan if not p.unlikelihood] == [
        q.end + (300 if q.end > base_end else 0) for q in td.PHASES
    ]
    with pytest.raises(ValueError, match="unloop_at"):
        td.phases(0, 10, "middle")


def test_unloop_at_end_long_trains_long_rows_beside_the_unlikelihood():
    end, end_long = td.phases(0, 300, "end"), td.phases(0, 300, "end-long")
    assert [p.end for p in end] == [p.end for p in end_long]  # the same place as "end"
    ul = next(p for p in end_long if p.unlikelihood)
    assert (ul.seq, ul.batch, ul.mix, ul.sparse) == (2048, 1, "long", True)
    assert next(p for p in end if p.unlikelihood).mix == "base"


def test_squeeze_inner_spaces_cuts_runs_inside_lines_and_leaves_indentation():
    import re

    from dist_glm5.train.corpus import load_split, reindent, squeeze_inner_spaces

    src = b"    x = 1      # note\n        y  = [a,   b]   \n" + b" " * 12 + b"z\n"
    want = b"    x = 1  # note\n        y  = [a,  b]  \n" + b" " * 12 + b"z\n"
    assert squeeze_inner_spaces(src) == want
    assert squeeze_inner_spaces(b"a    b", cap=1) == b"a b"
    # a stdlib file re-indented, then squeezed: no run of 17 spaces, no run of 3 inside a line,
    # and every line's non-space bytes in order as before
    data = next(b for r, b in load_split("train") if r.endswith("pydoc_data/topics.py"))
    got = squeeze_inner_spaces(reindent(data))
    assert max(len(m) for m in re.findall(rb" +", got)) <= 16
    assert not re.search(rb"[^ \n]   ", got)
    for g, b in zip(got.split(b"\n"), data.split(b"\n"), strict=True):
        assert g.split() == b.split()


def test_reindent_gives_four_space_steps_at_most_one_deeper_and_at_most_the_cap():
    from dist_glm5.train.corpus import load_split, reindent

    src = (
        b"def f(x,\n      y):\n    if x:\n            return [1,\n"
        + b" " * 20
        + b"2]\n   \n  z = 1\n"
    )
    want = b"def f(x,\n    y):\n    if x:\n        return [1,\n            2]\n\nz = 1\n"
    assert reindent(src) == want
    assert reindent(b" " * 40 + b"x\n") == b"    x\n"  # one step deeper than column 0
    deep = b"a\n" + b"".join(b" " * (4 * i) + b"b\n" for i in range(1, 8))
    assert max(len(x) - len(x.lstrip(b" ")) for x in reindent(deep).split(b"\n")) == 16
    # a stdlib file, line by line: the bodies kept, the indents as the rule says
    rel, data = next((r, b) for r, b in load_split("train") if r.endswith("argparse.py"))
    got, before = reindent(data).split(b"\n"), data.split(b"\n")
    assert len(got) == len(before)
    prev = 0
    for g, b in zip(got, before, strict=True):
        assert g.lstrip(b" ") == b.lstrip(b" ")
        if not g:
            continue
        k, raw = len(g) - len(g.lstrip(b" ")), len(b) - len(b.lstrip(b" "))
        assert k % 4 == 0 and k <= 16 and k <= prev + 4 and k <= raw, (rel, g, b)
        prev = k


def test_space_run_rows_point_the_source_map_at_the_merged_ids():
    doc = list(b"a   b\n  a   b")
    src = [-1] * 8 + [0, 1, 2, 3, 4]
    ids, src_t, reply = td.merged_row(doc, src, [False] * 8 + [True] * 5, ByteTokenizer(16))
    r2, r3 = 257 + 2, 257 + 3
    assert ids == [97, r3, 98, 10, r2, 97, r3, 98]
    assert src_t == [-1, -1, -1, -1, -1, 0, 1, 2]
    assert reply == [False] * 5 + [True] * 3
    assert td.induction_targets(ids, src_t) == [-1] * 5 + [1, 2, -1]


@pytest.mark.parametrize("mix", ["base", "long"])
def test_space_run_batches_hold_runs_and_their_induction_keys_hold_the_next_id(mix):
    data = td.Data(seed=5, tok=ByteTokenizer(16))
    ids, induction, reply = data.batch(step=7, seq=512, batch=8, mix=mix)
    assert ids.shape == induction.shape == reply.shape == (8, 512)
    assert (ids > 258).any() and (ids < 274).all()  # runs of spaces, and nothing past them
    b, t = torch.nonzero(induction >= 0, as_tuple=True)
    assert len(t) > 0
    k = induction[b, t]
    # the key the induction head reads holds the id to predict, after the id of the current one
    assert torch.equal(ids[b, k], ids[b, t + 1]) and torch.equal(ids[b, k - 1], ids[b, t])
    # no two runs in a row: the longest run is taken first (a run of 17+ is 16 and one space)
    runs = ids > 258
    assert not (runs[:, 1:] & runs[:, :-1] & (ids[:, :-1] != 257 + 16)).any()


def test_a_space_run_run_exports_its_tokenizer_and_resumes_only_as_itself(tmp_path):
    from transformers import AutoTokenizer

    from dist_glm5.checkpoint.tokenizer import load_tokenizer

    td.train(tmp_path / "run", steps=1, seed=3, space_runs=16, export_to=tmp_path / "exp")
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    tok = load_tokenizer(tmp_path / "exp")
    assert cfg["vocab_size"] == tok.vocab_size == 274 and tok.space_runs == 16
    text = "def f():\n        return 1\n"
    assert AutoTokenizer.from_pretrained(tmp_path / "exp").encode(text) == tok.encode(text)
    rep = json.loads((tmp_path / "exp" / "train_report.json").read_text())
    assert 3.0 < rep["heldout_loss_test_slice"] < 8.0  # nats per byte of a 1-step model
    assert td.export_state(tmp_path / "run", tmp_path / "again", seed=3) == 1
    with pytest.raises(ValueError, match="--space-runs 16"):
        td.train(tmp_path / "run", steps=2, seed=3)


def test_a_space_unit_run_exports_its_tokenizer_and_resumes_only_as_itself(tmp_path):
    from transformers import AutoTokenizer

    from dist_glm5.checkpoint.tokenizer import load_tokenizer

    td.train(
        tmp_path / "run", steps=1, seed=3, reindent=True, space_unit=4, export_to=tmp_path / "exp"
    )
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    tok = load_tokenizer(tmp_path / "exp")
    assert cfg["vocab_size"] == tok.vocab_size == 260 and tok.space_unit == 4
    text = "def f():\n        return 1\n"
    assert AutoTokenizer.from_pretrained(tmp_path / "exp").encode(text) == tok.encode(text)
    assert tok.encode(text).count(259) == 2
    with pytest.raises(ValueError, match="--space-unit 4"):
        td.train(tmp_path / "run", steps=2, seed=3)


def test_space_unit_batches_hold_the_unit_and_no_space_after_four_of_them():
    data = td.Data(seed=5, reindent=True, tok=ByteTokenizer(space_unit=4), inner_spaces=2)
    ids = data.batch(step=7, seq=512, batch=8, mix="base")[0]
    flat = ids.reshape(-1).tolist()
    assert 259 in flat and max(flat) < 260
    # re-indented code is at most 16 spaces deep and inner runs are cut to 2: four units end a run
    after4 = [flat[i + 4] for i in range(len(flat) - 4) if flat[i : i + 4] == [259] * 4]
    assert 259 not in after4 and 32 not in after4


# ---- chat tags (--chat-tags) ---------------------------------------------------------------------
TAGGED = ByteTokenizer(16, chat_tags=True)


def test_chat_tag_batches_hold_tag_ids_and_their_induction_keys_hold_the_next_id():
    data = td.Data(seed=5, tok=TAGGED)
    ids, induction, reply = data.batch(step=7, seq=512, batch=8, mix="base")
    assert ids.shape == (8, 512) and (ids < TAGGED.vocab_size).all()
    tags = ids >= TAGGED.first_tag_id
    assert tags.any() and (ids[tags] != TAGGED.tag_id("</arg_value>")).any()
    tb = TAGGED.token_bytes()
    for row in ids.tolist():  # every tag and run in a row is its id: merging again changes nothing
        flat = [b for i in row for b in ([i] if i in (256, 257) else tb[i])]
        assert TAGGED.merge(flat)[0] == row
    b, t = torch.nonzero(induction >= 0, as_tuple=True)
    k = induction[b, t]
    assert torch.equal(ids[b, k], ids[b, t + 1]) and torch.equal(ids[b, k - 1], ids[b, t])
    # an assistant's reply starts after its tag: the tag itself is the prompt's
    assert not reply[ids == TAGGED.tag_id("<|assistant|>")].any()


def test_structure_targets_of_tag_ids_are_those_of_their_last_byte():
    """The open tag and JSON context after each merged id equal the byte scan's after the last
    byte it holds (the ids' ends from merge's starts, not from the targets' own expansion)."""
    from dist_glm5.train.chat_corpus import ChatDoc, Words, tool_chat
    from dist_glm5.train.structure import structure_targets

    w = Words.from_text(b"".join(b"def f%d(x):\n    return x\n" % i for i in range(300)))
    doc = ChatDoc()
    for seed in range(6):
        tool_chat(random.Random(seed), w, doc)
    merged, starts = TAGGED.merge(doc.ids)
    ends = [s - 1 for s in starts[1:]] + [len(doc.ids) - 1]
    tag, js = structure_targets(doc.ids)
    assert td.structure_row(merged, TAGGED) == ([tag[e] for e in ends], [js[e] for e in ends])
    assert max(tag) > 0 and any(i >= TAGGED.first_tag_id for i in merged)


def test_a_chat_tags_run_exports_its_tokenizer_and_resumes_only_as_itself(tmp_path):
    from transformers import AutoTokenizer

    from dist_glm5.checkpoint.tokenizer import load_tokenizer

    td.train(
        tmp_path / "run", steps=1, seed=3, space_runs=16, chat_tags=True, export_to=tmp_path / "exp"
    )
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    tok = load_tokenizer(tmp_path / "exp")
    assert cfg["vocab_size"] == tok.vocab_size == 286 and tok.chat_tags
    text = "<|user|>\nhi<|assistant|>\n<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>"
    assert AutoTokenizer.from_pretrained(tmp_path / "exp").encode(text) == tok.encode(text)
    assert td.export_state(tmp_path / "run", tmp_path / "again", seed=3) == 1
    with pytest.raises(ValueError, match="--chat-tags"):
        td.train(tmp_path / "run", steps=2, seed=3, space_runs=16)


# ---- a fourth offset head (--offset-heads 4) ---------------------------------------------------
def test_four_offset_heads_read_one_to_four_back_and_need_space_runs():
    """The offset loss is -log of head h's weight on the id h + 1 back, averaged (a written-out
    gather), head 3 (the column head otherwise) included; without space runs it is refused."""
    runs = ByteTokenizer(16)
    cfg = td.hf_config(dict(TINY, vocab_size=runs.vocab_size))
    tr = td.Trainer(cfg, seed=0, tok=runs, offsets=td.OFFSETS_FAR)
    ids = torch.tensor([runs.encode("def f(x):\n        return x  # one\n" * 2)])
    tr.losses(ids)
    sup = tr.attention_supervision(ids, torch.full_like(ids, -1))
    w, S = tr.heads[td.OFFSET_LAYER][0], ids.shape[1]  # [H, S, S]
    per_head = [
        torch.stack([-torch.log(w[h, t, t - h - 1]) for t in range(h + 1, S)]).mean()
        for h in range(4)
    ]
    assert torch.allclose(sup["offset"], torch.stack(per_head).mean())
    assert tr.readout.out_features == 4 * runs.vocab_size
    sup["offset"].backward()
    assert tr.model.model.layers[0].self_attn.q_b_proj.weight.grad.any()
    with pytest.raises(ValueError, match="--space-runs"):
        td.Trainer(td.hf_config(TINY), seed=0, offsets=td.OFFSETS_FAR)


def test_a_four_offset_run_exports_and_resumes_only_as_itself(tmp_path):
    td.train(tmp_path / "run", steps=1, seed=3, space_runs=16, offset_heads=4)
    assert td.export_state(tmp_path / "run", tmp_path / "exp", seed=3) == 1
    with pytest.raises(ValueError, match="--offset-heads 4"):
        td.train(tmp_path / "run", steps=2, seed=3, space_runs=16)


# ---- a wider MLA latent (--kv-lora-rank) --------------------------------------------------------
def test_a_wider_latent_exports_its_width_and_resumes_only_as_itself(tmp_path):
    """The exported config.json carries the width the weights have (transformers loads them by
    it), and a run resumes only with the width it was trained with."""
    td.train(tmp_path / "run", steps=1, seed=3, space_runs=16, kv_lora_rank=96)
    assert td.export_state(tmp_path / "run", tmp_path / "exp", seed=3) == 1
    raw = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert raw["kv_lora_rank"] == 96
    from safetensors.torch import load_file

    sd = load_file(tmp_path / "exp" / "model.safetensors")
    assert sd["model.layers.0.self_attn.kv_a_layernorm.weight"].shape == (96,)
    with pytest.raises(ValueError, match="--kv-lora-rank 96"):
        td.train(tmp_path / "run", steps=2, seed=3, space_runs=16)


# ---- the match head (--match-head) --------------------------------------------------------------
def test_match_head_loss_is_its_weight_on_the_id_before_and_resumes_only_as_itself(tmp_path):
    """-log of MATCH_HEAD's weight on the id before, averaged over the rows past the first (a
    written-out gather); off, the loss is zero and layer 1's weights are not kept."""
    cfg = td.hf_config(TINY)
    tr = td.Trainer(cfg, seed=0, match_head=True)
    ids = torch.tensor([list(b"def f(x):\n    return x  # one\n" * 2)])
    tr.losses(ids)
    sup = tr.attention_supervision(ids, torch.full_like(ids, -1))
    w, S = tr.heads[td.MATCH_LAYER][0, td.MATCH_HEAD], ids.shape[1]  # [S, S]
    want = torch.stack([-torch.log(w[t, t - 1]) for t in range(1, S)]).mean()
    assert torch.allclose(sup["match"], want)
    sup["match"].backward()
    assert tr.model.model.layers[td.MATCH_LAYER].self_attn.q_b_proj.weight.grad.any()
    off = td.Trainer(cfg, seed=0)
    off.losses(ids)
    assert off.attention_supervision(ids, torch.full_like(ids, -1))["match"] == 0
    assert td.MATCH_LAYER not in off.heads
    td.train(tmp_path / "run", steps=1, seed=3, match_head=True)
    with pytest.raises(ValueError, match="--match-head"):
        td.train(tmp_path / "run", steps=2, seed=3)


# ---- the copy loss at the residual's scale (--copy-direct) ----------------------------------
def test_direct_copy_loss_is_the_induction_heads_share_of_the_models_logits():
    """With copy_direct the copy loss is the cross-entropy of what head 0 of INDUCTION_LAYER adds
    to the model's own logits: transformers' logits less those of the residual without that
    head's part, at the residual's norm scale (the final norm is linear at a fixed scale). Off,
    it is the head's output normalised alone, which does not see the head's size."""
    g = torch.Generator().manual_seed(2)
    half = torch.randint(0, 256, (40,), generator=g)
    ids = torch.cat([half, half])[None]  # [1, 80]: the second half repeats the first
    induction = torch.full_like(ids, -1)
    induction[0, 40:79] = torch.arange(1, 40)  # row 40 + i: the byte to predict sits at i + 1
    cfg = td.hf_config(TINY)
    tr = td.Trainer(cfg, seed=0, copy_direct=True)
    m = tr.model.model
    seen = {}
    m.norm.register_forward_pre_hook(lambda mod, a: seen.__setitem__("r", a[0].detach()))
    o_proj = tr._layer(td.INDUCTION_LAYER).self_attn.o_proj
    o_proj.register_forward_pre_hook(lambda mod, a: seen.__setitem__("v", a[0].detach()))
    tr.losses(ids)
    resid = seen["r"][0]  # the model's forward (the loss's normalised form calls the norm again)
    sup = tr.attention_supervision(ids, induction)
    want = induction[0] >= 0
    r, v = resid[want], seen["v"][0][want][:, : cfg.v_head_dim]
    part = v @ o_proj.weight[:, : cfg.v_head_dim].T  # head 0's share of the residual
    rest = (
        m.norm.weight * (r - part) * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    )
    head_logits = tr.logits[0][want].detach() - tr.model.lm_head(rest)
    oracle = torch.nn.functional.cross_entropy(head_logits, ids[0, 1:][want[:-1]])
    assert torch.allclose(sup["copy"], oracle, atol=1e-5)
    sup["copy"].backward()
    assert o_proj.weight.grad[:, : cfg.v_head_dim].any()
    assert not o_proj.weight.grad[:, cfg.v_head_dim :].any()  # the other heads' columns: not
    off = td.Trainer(cfg, seed=0)
    off.losses(ids)
    normalised = off.attention_supervision(ids, induction)["copy"]
    assert not torch.allclose(normalised, sup["copy"])
    # a share: that much of the loss direct, the rest normalised (same seed, same weights)
    part = td.Trainer(cfg, seed=0, copy_direct=0.3)
    part.losses(ids)
    mixed = part.attention_supervision(ids, induction)["copy"]
    assert torch.allclose(mixed, 0.3 * oracle + 0.7 * normalised, atol=1e-5)
    with pytest.raises(ValueError, match="share of the copy loss"):
        td.Trainer(cfg, seed=0, copy_direct=1.5)
    # on some rows only: those rows direct (the share), the others normalised, one mean
    two = torch.cat([ids, ids])
    both = torch.cat([induction, induction])
    part.losses(two)
    rows = part.attention_supervision(two, both, torch.tensor([True, False]))["copy"]
    assert torch.allclose(rows, (0.3 * oracle + 0.7 * normalised + normalised) / 2, atol=1e-5)


# ---- the copy's value path on every key (--key-copy) ---------------------------------------------
def test_key_copy_loss_names_each_keys_own_id_through_the_induction_heads_value():
    """key_copy_loss is the cross-entropy, at every position, of head 0 of INDUCTION_LAYER's
    value for that key, mapped through the head's o_proj columns, the final norm and lm_head,
    against the key's id. The value is checked against the head itself: transformers' head-0
    output (o_proj's input) is its attention weights times those values."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (2, 48), generator=g)
    cfg = td.hf_config(TINY)
    tr = td.Trainer(cfg, seed=0)
    att = tr._layer(td.INDUCTION_LAYER).self_attn
    seen = {}
    att.o_proj.register_forward_pre_hook(lambda mod, a: seen.__setitem__("o_in", a[0].detach()))
    att.kv_b_proj.register_forward_pre_hook(lambda mod, a: seen.__setitem__("lat", a[0].detach()))
    tr.losses(ids)
    vd, nope = cfg.v_head_dim, cfg.qk_nope_head_dim
    # head 0's value, from the latent by kv_b_proj's rows for head 0 (a head's rows: [nope | v])
    lat = seen["lat"].reshape(*ids.shape, -1)  # [B, S, kv_lora_rank] (transformers: [B, 1, S, r])
    v0 = lat @ att.kv_b_proj.weight[nope : nope + vd].T  # [B, S, vd]
    probs = tr.heads[td.INDUCTION_LAYER][:, 0].detach()  # [B, S, S]
    assert torch.allclose(probs @ v0, seen["o_in"][..., :vd], atol=1e-5)
    w = tr.model.model.norm.weight
    x = v0 @ att.o_proj.weight[:, :vd].T
    normed = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    lo = normed @ tr.model.lm_head.weight.T
    oracle = torch.nn.functional.cross_entropy(lo.reshape(-1, lo.shape[-1]), ids.reshape(-1))
    loss = tr.key_copy_loss(ids)
    assert torch.allclose(loss, oracle, atol=1e-5)
    loss.backward()
    assert att.kv_b_proj.weight.grad[nope : nope + vd].any()  # head 0's value rows
    assert not att.kv_b_proj.weight.grad[nope + vd :].any()  # the other heads' rows: not
    assert not att.o_proj.weight.grad[:, vd:].any()
    assert "key_copy" not in tr.attention_supervision(ids, torch.full_like(ids, -1))
    tr.key_copy = True  # train(..., key_copy=True): attention_supervision adds it
    both = tr.attention_supervision(ids, torch.full_like(ids, -1))
    assert torch.allclose(both["key_copy"], oracle, atol=1e-5)


def test_key_copy_trains_and_logs_its_loss(tmp_path):
    td.train(tmp_path / "on", steps=2, seed=3, key_copy=True)
    td.train(tmp_path / "off", steps=2, seed=3)
    on, off = ([json.loads(x) for x in (tmp_path / r / "train.log").open()] for r in ("on", "off"))
    assert all(r["key_copy"] > 0 for r in on) and all("key_copy" not in r for r in off)
    assert on[0]["lm"] == off[0]["lm"]  # the same first batch and weights: a loss, not data


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--key-copy"], {"key_copy": True}),
        (["--needle-decoys", "2", "--unloop", "300", "--unloop-json", "2"], {"needle_decoys": 2}),
        (["--unloop", "300", "--unloop-json", "2"], {"unloop_json": 2, "needle_decoys": 0}),
        (
            ["--unloop", "300", "--unloop-json", "2", "--unloop-json-fresh"],
            {"unloop_json": 2, "unloop_json_fresh": True},
        ),
        (["--unloop", "300", "--unloop-json", "2"], {"unloop_json_fresh": False}),
    ],
)
def test_data_and_loss_flags_reach_train(argv, want, monkeypatch, tmp_path):
    import argparse

    from bench import train_default as cli

    got = {}
    monkeypatch.setattr(td, "train", lambda *a, **k: got.update(k))
    p = argparse.ArgumentParser()
    cli.register(p)
    args = p.parse_args(["--out", str(tmp_path), *argv])
    args.func(args)
    assert {k: got[k] for k in want} == want


# ---- a BPE vocabulary (--bpe N) ------------------------------------------------------------------
def test_a_bpe_run_exports_its_tokenizer_and_resumes_only_as_itself(tmp_path):
    from transformers import AutoTokenizer

    from dist_glm5.checkpoint.bpe import BpeTokenizer
    from dist_glm5.checkpoint.tokenizer import load_tokenizer

    td.train(tmp_path / "run", steps=1, seed=3, reindent=True, bpe=400, export_to=tmp_path / "exp")
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    tok = load_tokenizer(tmp_path / "exp")
    assert type(tok) is BpeTokenizer and cfg["vocab_size"] == tok.vocab_size == 400
    text = "def f():\n        return self.value  # <|user|>\n"
    assert AutoTokenizer.from_pretrained(tmp_path / "exp").encode(text) == tok.encode(text)
    assert len(tok.encode(text)) < len(text) / 2
    rep = json.loads((tmp_path / "exp" / "train_report.json").read_text())
    assert 1.0 < rep["heldout_loss_test_slice"] < 8.0  # nats per byte of a 1-step model
    with pytest.raises(ValueError, match="--bpe 400"):
        td.train(tmp_path / "run", steps=2, seed=3)


@pytest.mark.parametrize("mix", ["base", "long"])
def test_bpe_batches_are_full_rows_whose_induction_keys_hold_the_next_id(mix):
    from dist_glm5.train.corpus import bpe

    tok = bpe(400)
    data = td.Data(seed=5, reindent=True, tok=tok, inner_spaces=2)
    ids, induction, _ = data.batch(step=7, seq=512, batch=8, mix=mix)
    assert ids.shape == induction.shape == (8, 512) and int(ids.max()) < 400
    tb = tok.token_bytes()
    for row in ids.tolist():  # a row is what the tokenizer makes of its bytes (but at its end:
        # cut there, or padded with newline ids)
        while row[-1] == 10:
            row.pop()
        flat = [x for i in row for x in ([i] if 256 <= i <= 258 else list(tb[i]))]
        assert tok.merge(flat)[0][: len(row) - 8] == row[:-8]
    assert (ids >= tok.first_merged_id).any()
    b, t = torch.nonzero(induction >= 0, as_tuple=True)
    assert len(t) > 0
    k = induction[b, t]
    same = (ids[b, k] == ids[b, t + 1]) & (ids[b, k - 1] == ids[b, t])
    # a repeat may be cut into other pieces than its source at its edges: most keys still match
    assert same.float().mean() > 0.8


def test_copy_pieces_put_merged_pieces_into_the_repeats():
    """Random characters rarely merge, so the repeats copied almost only single-character ids
    (the control); with a BPE's word pieces among the units most of their ids are merged pieces,
    and every repeat still holds its first saying's bytes where the source map points."""

    from dist_glm5.checkpoint.bpe import BpeTokenizer, train_merges
    from dist_glm5.train import corpus

    code = b"\n".join(b for _, b in corpus.load_split("train"))[:400_000]
    tok = BpeTokenizer(train_merges(code, 300))
    pieces = corpus.copy_pieces(tok.merged)
    assert pieces and all(p.isalnum() or b"_" in p for p in pieces)
    assert not set(pieces) & {b"    ", b" if", b"):"}  # no blanks or punctuation
    share = {}
    for use in ((), pieces):
        doc, src = corpus.repeat_training_doc(random.Random(5), b"", 6000, use)
        for t, s in enumerate(src):
            assert s < 0 or (s < t and doc[s] == doc[t])
        ids = tok.encode_bytes(bytes(doc))
        share[bool(use)] = sum(i >= tok.first_merged_id for i in ids) / len(ids)
    assert share[False] < 0.1 and share[True] > 0.3, share


def test_unloop_json_adds_json_prompts_after_the_recipes_own():
    """unloop_json=N: the committed recipe's prompts first, unchanged, then N more ending where
    the assistant answers a JSON request, under json_object with the grammar."""
    data = _unloop_data(0)
    base, base_g = data.unloop_batch(5, grammar=True)
    data.unloop_json = 2
    more, more_g = data.unloop_batch(5, grammar=True)
    assert more[: len(base)] == base and more_g[: len(base)] == base_g
    assert len(more) == len(base) + 2 and {len(p) for p in more} == {unloop.PROMPT}
    assert [g.kind for g in more_g[len(base) :]] == ["json_object"] * 2
    assert more[-1] != more[-2]
    assert data.unloop_batch(5)[1] == [None] * len(more)  # no grammar without the flag


def test_unloop_json_fresh_prompts_are_what_the_server_renders_for_the_request():
    """unloop_json_fresh: the extra prompts are a JSON request as a chat's first message, byte for
    byte what the server renders for that one user message (byte_chat.simple_chat, as the gate
    sends it), under json_object; the recipe's own prompts stay as they were."""
    from dist_glm5.checkpoint.byte_chat import simple_chat

    data = _unloop_data(0)
    data.unloop_json = 2
    packed, _ = data.unloop_batch(5, grammar=True)
    data.unloop_json_fresh = True
    fresh, fresh_g = data.unloop_batch(5, grammar=True)
    assert fresh[:-2] == packed[:-2] and fresh[-2:] != packed[-2:]
    assert [g.kind for g in fresh_g[-2:]] == ["json_object"] * 2
    for ids in fresh[-2:]:
        text = bytes(ids).decode()
        request = text.removeprefix("<|user|>\n").removesuffix("\n<|assistant|>\n")
        assert request != text and "<|" not in request
        assert text == simple_chat([{"role": "user", "content": request}])


FILLER = b"".join(b"def f%d(x):\n    return x + %d\n" % (i, i) for i in range(300))


def test_needle_docs_without_decoys_are_the_committed_recipes():
    """Recorded from corpus.needle_training_doc before decoys existed (15 documents): a run
    without --needle-decoys draws the same documents."""
    import hashlib

    from dist_glm5.train import corpus

    h = hashlib.sha256()
    for seed in range(5):
        for k in (2, 3, 8):
            doc, src = corpus.needle_training_doc(random.Random(seed), FILLER, k)
            h.update(doc)
            h.update(str(src).encode())
    assert h.hexdigest() == "3f066f39694afdc667b6eb5d668ab265da1b7a4d5fa6f439d9121c93d7b26d5a"


def test_needle_decoys_share_a_first_part_and_are_never_asked():
    """Every decoy line's value begins as an asked needle's (1..4 characters) and differs at the
    next; only the asked needles are asked, every answer byte repeats a byte of its own needle's
    line, and the document keeps the filler's length."""
    import os
    import re

    from dist_glm5.train import corpus

    line = re.compile(rb"\[key (\d+): (\w+)\]")
    for seed in range(20):
        doc, src = corpus.needle_training_doc(random.Random(seed), FILLER, 3, decoys=2)
        assert len(doc) <= len(FILLER) and doc.endswith(b"\n")
        lines = doc.split(b"\n")[:-1]
        asked = dict(line.fullmatch(x).groups() for x in lines[-3:])  # the questions, answered
        placed = dict(m.groups() for x in lines[:-3] if (m := line.fullmatch(x)))
        real = {k: v for k, v in placed.items() if k in asked}
        fake = {k: v for k, v in placed.items() if k not in asked}
        assert real == asked and len(fake) == 2
        for v in fake.values():
            assert any(
                1 <= len(os.path.commonprefix([v, r])) <= 4 and len(v) == len(r)
                for r in real.values()
            ), (v, real)
        start = len(doc) - sum(len(x) + 1 for x in lines[-3:])
        for t in range(start, len(doc)):
            if src[t] >= 0:  # from the value on, the answer's source is its own needle's line
                source_key = line.match(doc, doc.rfind(b"[key ", 0, src[t] + 1)).group(1)
                asked_key = line.match(doc, doc.rfind(b"[key ", 0, t)).group(1)
                assert doc[src[t]] == doc[t] and source_key == asked_key


def test_copy_pieces_need_a_bpe_vocabulary():
    with pytest.raises(ValueError, match="BPE vocabulary"):
        td.Data(0, copy_pieces=True)
