"""Expert placement: fitted from recorded routes, never loses or duplicates an expert, changes
nothing the model computes, and narrows the busiest EP rank on the recorded routes."""

from __future__ import annotations

import pytest
import torch
from runtime_util import prompts

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.model.reference_loop import generate
from dist_glm5.planning.expert_placement import (
    RouteRecorder,
    attach,
    check_placement,
    fit_placement,
    imbalance,
)
from dist_glm5.sampling.params import SamplingParams

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


def _busiest_over_mean(routes, placement, ranks):
    """Mean over layers and steps (with any routes) of busiest EP rank / mean rank, recomputed
    here from the placement's definition: position j holds expert perm[j], rank r the positions
    r*E/R .. (r+1)*E/R - 1."""
    vals = []
    for layer, counts in routes.items():
        E = counts.shape[1]
        per = E // ranks
        perm = (placement or {}).get(layer, list(range(E)))
        for step in counts.tolist():
            loads = [
                sum(step[perm[j]] for j in range(r * per, (r + 1) * per)) for r in range(ranks)
            ]
            if sum(loads):
                vals.append(max(loads) / (sum(loads) / ranks))
    return sum(vals) / len(vals)


def _assert_permutations(pl, cfg, layers):
    assert sorted(pl) == sorted(layers)
    for layer, perm in pl.items():
        assert sorted(perm) == list(range(cfg.n_routed_experts)), layer


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_fitted_placement_is_a_permutation_and_lowers_the_busiest_rank(
    default_model, recorded, ranks
):
    routes, _ = recorded
    pl = fit_placement(routes, ranks, default_model.cfg)
    _assert_permutations(pl, default_model.cfg, routes)
    before, after = _busiest_over_mean(routes, None, ranks), _busiest_over_mean(routes, pl, ranks)
    assert before > 1.2, f"recorded routes not skewed ({before:.3f}): the test would prove nothing"
    assert after < before - 0.05, (before, after)  # strictly better, not "no change"
    # the library's own metric agrees with the definition
    assert imbalance(routes, None, ranks) == pytest.approx(before, rel=1e-6)
    assert imbalance(routes, pl, ranks) == pytest.approx(after, rel=1e-6)


def _moe_layers(cfg):
    return [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_perfectly_balanceable_routes_get_perfect_balance(default_model, ranks):
    """Tiers of `ranks` equally loaded experts (weights 2^-tier), heaviest ids first: identity puts
    the heaviest tiers together on rank 0; one expert of each tier per rank balances exactly."""
    cfg = default_model.cfg
    E = cfg.n_routed_experts
    weights = torch.tensor([2 ** (E // ranks - e // ranks) for e in range(E)])
    routes = {layer: weights.repeat(5, 1) for layer in _moe_layers(cfg)}
    pl = fit_placement(routes, ranks, cfg)
    _assert_permutations(pl, cfg, routes)
    assert _busiest_over_mean(routes, None, ranks) > 1.4
    assert _busiest_over_mean(routes, pl, ranks) == 1.0


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_skewed_random_routes_strictly_improve(default_model, ranks):
    """Per-step multinomial routes from a Zipf-like popularity, hot experts at random ids."""
    cfg = default_model.cfg
    E = cfg.n_routed_experts
    g = torch.Generator().manual_seed(ranks)
    routes = {}
    for layer in _moe_layers(cfg):
        popularity = 1.0 / torch.arange(1, E + 1).float() ** 1.1
        popularity = popularity[torch.randperm(E, generator=g)]
        steps = [
            torch.bincount(
                torch.multinomial(popularity, 64, replacement=True, generator=g), minlength=E
            )
            for _ in range(30)
        ]
        routes[layer] = torch.stack(steps)
    pl = fit_placement(routes, ranks, cfg)
    _assert_permutations(pl, cfg, routes)
    before, after = _busiest_over_mean(routes, None, ranks), _busiest_over_mean(routes, pl, ranks)
    assert after < before - 0.05, (before, after)


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
    m = load_model(default_model_dir, placement=pl, ops=get_backend("cpu").ops())
    assert [g.token_ids for g in generate(m, prompts([40, 90, 7, 130], seed=11), P)] == want
    # an expert-parallel slice holds exactly the experts the placement gives its positions
    half = load_model(
        default_model_dir, placement=pl, experts=range(8, 16), ops=get_backend("cpu").ops()
    )
    full = default_model.model.layers["1"].mlp.experts.w13_weight
    assert torch.equal(
        half.model.layers["1"].mlp.experts.w13_weight, full[torch.tensor(pl[1][8:16])]
    )


def test_ep_tp_layouts_cover_the_cards(default_model, recorded):
    from dist_glm5.planning.expert_placement import layouts

    routes, _ = recorded
    rows = layouts(routes, 8, default_model.cfg)
    assert {(r["ep"], r["tp"]) for r in rows} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert [r["busiest_rank_work"] for r in rows] == sorted(r["busiest_rank_work"] for r in rows)
