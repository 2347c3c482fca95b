"""The fused decode selection (kernels/dsa_select.c) against the torch path it replaces: index
scores in capped chunks, the exact top-k with the reference tie rule, the slot list. Keys in
blocks scattered through the store, a partial last block, rows with fewer causal keys than top-k,
bf16 and fp32 stores, and integer-valued data where scores tie exactly (sums of small integers
times a power of two are exact in any order, so the tie rule itself is compared)."""

from __future__ import annotations

import pytest
import torch

from dist_glm5.kernels import dsa_select as K
from dist_glm5.model import dsa
from dist_glm5.model.kv_cache import KeySlots
from dist_glm5.ops.topk import select_topk_sorted


def torch_path(q, w, store, keys, q_pos, topk, D):
    s = dsa.index_scores_capped(q, w, store, keys, D, 512 << 20)
    keep = select_topk_sorted(s, q_pos, topk)
    return (keep, *dsa.selected_slots(keep, keys, topk))


@pytest.mark.parametrize("L", [1, 50, 64, 1000, 5000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("integers", [False, True])
def test_fused_selection_equals_the_torch_path(L, dtype, integers):
    assert K.available(), "gcc is on every machine we run on: the kernel must build"
    g = torch.Generator().manual_seed(L)
    # integers: D = 64 makes the score scale 1/8, so every score is exact in any summation order
    bs, D, H, topk = 16, (64 if integers else 32), 8, 64
    nblk = -(-L // bs)
    store_blocks = nblk + 7
    if integers:  # many exact ties
        store = torch.randint(-2, 3, (store_blocks * bs, D), generator=g).to(dtype)
        q = torch.randint(-1, 2, (3, H, D), generator=g).bfloat16()
        w = torch.randint(0, 3, (3, H), generator=g).float()
    else:
        store = torch.randn(store_blocks * bs, D, generator=g).to(dtype)
        q = torch.randn(3, H, D, generator=g).bfloat16()
        w = torch.randn(3, H, generator=g)
    keys = KeySlots(torch.randperm(store_blocks, generator=g)[:nblk], bs, L)
    q_pos = torch.tensor([L - 1, min(L - 1, 10), max(0, L - 2)])
    want = torch_path(q, w, store, keys, q_pos, topk, D)
    got = K.select_rows(q, w, store, keys, q_pos, topk, D)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_model_uses_it_for_decode_and_tokens_are_unchanged(default_model_dir):
    from dataclasses import replace

    from runtime_util import prompts

    from dist_glm5.backends import get_backend
    from dist_glm5.checkpoint.loader import load_model
    from dist_glm5.model.dsa_config import DSAConfig
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    ops = get_backend("cpu").ops()
    assert ops.select_rows is K.select_rows
    calls = []

    def spy(*a):
        calls.append(a[0].shape[0])
        return K.select_rows(*a)

    sparse = DSAConfig(mode="sparse")
    fused = load_model(default_model_dir, ops=replace(ops, select_rows=spy), dsa=sparse)
    plain = load_model(default_model_dir, ops=replace(ops, select_rows=None), dsa=sparse)
    ps, P = prompts([150, 90], seed=2), SamplingParams(max_tokens=8, ignore_eos=True)
    assert [x.token_ids for x in generate(fused, ps, P)] == [
        x.token_ids for x in generate(plain, ps, P)
    ]
    assert calls and set(calls) == {1}  # one decode row per sequence per full layer
