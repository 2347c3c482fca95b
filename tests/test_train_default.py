"""The trainer of the default model (bench/train_default.py) on a tiny config: the sparse steps keep
each repeat row's induction key in its selection, and the indexers-only phase trains the indexers
and nothing else."""

from __future__ import annotations

import torch

from dist_glm5.bench import train_default as td

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
    index_topk=16,
    index_head_dim=16,
    index_n_heads=4,
)
S = 96


def _trainer():
    tr = td.Trainer(td.hf_config(TINY), seed=0)
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
    ix = tr._layer(td.INDUCTION_LAYER).self_attn.indexer
    ix.register_forward_hook(lambda m, a, out: sel.__setitem__("sel", out))
    return sel


def test_sparse_steps_keep_the_forced_key_in_its_rows_selection():
    tr = _trainer()
    tr.set_sparse(True)
    ids, force = _ids_and_force()
    sel = _selections(tr)
    with torch.no_grad():
        tr.losses(ids)
        free = sel["sel"].clone()
        tr.losses(ids, force)
        forced = sel["sel"]
    rows = force >= 0
    has = (forced == force[..., None]).any(-1)
    assert has[rows].all(), "a forced key is missing from its row's selection"
    # only the lowest-ranked pick of a row that missed the key changes
    assert torch.equal(forced[..., :-1], free[..., :-1])
    missed = rows & ~(free == force[..., None]).any(-1)
    assert missed.any()
    assert torch.equal(forced[..., -1][~missed], free[..., -1][~missed])


def test_indexers_phase_trains_only_the_indexers():
    tr = _trainer()
    tr.set_sparse(True)
    ids, force = _ids_and_force()
    tr.freeze_model(True)
    ls = tr.losses(ids)
    (ls["kl"] + tr.index_loss(force)).backward()
    ix = {id(p) for i in tr.indexers for p in tr._layer(i).self_attn.indexer.parameters()}
    named = [(n, p) for m in (tr.model, tr.mtp, tr.readout) for n, p in m.named_parameters()]
    assert all(p.grad is None for n, p in named if id(p) not in ix)
    assert all(p.grad is not None for n, p in named if id(p) in ix), "an indexer got no gradient"
    tr.freeze_model(False)
    assert all(p.requires_grad for _, p in named)
