"""Expert placement: fitted from recorded routes, never loses or duplicates an expert, changes nothing
the model computes, and narrows the busiest EP rank on the recorded routes."""

from __future__ import annotations

import pytest

from dist_glm5.model.reference_loop import generate
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.planning.expert_placement import RouteRecorder, attach, check_placement, fit_placement, imbalance
from dist_glm5.sampling.params import SamplingParams
from runtime_util import prompts

P = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def recorded(default_model):
    rec = RouteRecorder(default_model.cfg.n_routed_experts)
    attach(default_model, rec)
    try:
        out = generate(default_model, prompts([40, 90, 7, 130], seed=11), P)
    finally:
        attach(default_model, None)
    return rec.tensor(), [g.token_ids for g in out]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_fitted_placement_is_a_permutation_and_lowers_the_busiest_rank(default_model, recorded, ranks):
    routes, _ = recorded
    pl = fit_placement(routes, ranks, default_model.cfg)
    for layer, perm in pl.items():
        assert sorted(perm) == list(range(default_model.cfg.n_routed_experts))
    before, after = imbalance(routes, None, ranks), imbalance(routes, pl, ranks)
    assert after <= before, (before, after)


def test_bad_placements_are_refused(default_model):
    cfg = default_model.cfg
    E = cfg.n_routed_experts
    with pytest.raises(ValueError, match="missing \\[3\\], duplicated \\[2\\]"):
        check_placement(cfg, {1: [0, 1, 2, 2] + list(range(4, E))})
    with pytest.raises(ValueError, match="not a MoE layer"):
        check_placement(cfg, {0: list(range(E))})


def test_outputs_identical_with_and_without_placement(default_model_dir, default_model, recorded):
    routes, want = recorded
    pl = fit_placement(routes, 4, default_model.cfg)
    assert any(perm != sorted(perm) or perm != list(range(len(perm))) for perm in pl.values())
    m = load_model(default_model_dir, placement=pl)
    assert [g.token_ids for g in generate(m, prompts([40, 90, 7, 130], seed=11), P)] == want
    # an expert-parallel slice holds exactly the experts the placement gives its positions
    half = load_model(default_model_dir, placement=pl, experts=range(8, 16))
    full = default_model.model.layers["1"].mlp.experts.w13_weight
    import torch

    assert torch.equal(half.model.layers["1"].mlp.experts.w13_weight, full[torch.tensor(pl[1][8:16])])


def test_ep_tp_layouts_cover_the_cards(default_model, recorded):
    from dist_glm5.planning.expert_placement import layouts

    routes, _ = recorded
    rows = layouts(routes, 8, default_model.cfg)
    assert {(r["ep"], r["tp"]) for r in rows} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert [r["busiest_rank_work"] for r in rows] == sorted(r["busiest_rank_work"] for r in rows)
