"""backends/cpu_plan.py (`Ops.decode_plan`: a decode step's layers as the kernels in sequence,
arguments prepared once) against the layers' modules, its reference: the same logits bit for bit
and the same cache rows, over decode steps of several sequences of different lengths (selection
on: contexts past index_topk), MTP-verify chunks of 2 rows, bf16 and MXFP4 experts, and a second
pipeline stage whose first layer is 'shared' (the selection comes from the stage before), int8
index keys; and
every step it must decline (the modules then run it)."""

from __future__ import annotations

import pytest
import torch

from dist_glm5.backends import cpu_plan, get_backend
from dist_glm5.checkpoint.default_model import ensure_default_model
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.convert.glm53 import convert_glm53
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.model.kv_cache import Chunk
from dist_glm5.model.reference_loop import blocks_needed

SPARSE = DSAConfig(mode="sparse")
PROMPTS = (150, 97, 211)  # index_topk is 64: every row selects


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    dst = tmp_path_factory.mktemp("plan") / "mx"
    convert_glm53(ensure_default_model(), dst)
    return dst


def _model(path, dsa=SPARSE, **stage):
    m = load_model(path, torch.bfloat16, ops=get_backend("cpu").ops(), dsa=dsa, **stage)
    assert m.ops.decode_plan is cpu_plan.plan
    return m


class Counting:
    """The model's plan, counting the steps it took."""

    def __init__(self, plan):
        self.plan, self.taken, self.drafts = plan, 0, 0

    def __call__(self, *a):
        out = self.plan(*a)
        self.taken += out is not None
        return out

    def mtp(self, *a):
        out = self.plan.mtp(*a)
        self.drafts += out is not None
        return out

    def head(self, *a):
        return self.plan.head(*a)


def _decode(
    stages, planned: bool, rows: int = 1, steps: int = 5, seed: int = 0, mtp=False, prompts=PROMPTS
):
    """Prefill prompts through `stages` (models run one after the other, selection passed on),
    then `steps` greedy steps of `rows` rows per sequence (rows 2: an MTP verify's shape) ->
    (logits per step, cache stores, steps the plans took)."""
    g = torch.Generator().manual_seed(seed)
    caches = [
        m.new_cache(blocks_needed([n + rows * steps + 4 for n in prompts], 64), 64) for m in stages
    ]
    for c in caches:  # unwritten rows compared too
        for store in (*c.kv.values(), *c.index_k.values()):
            store.zero_()
    counters = []
    for m in stages:
        m._plan = None
        plan = cpu_plan.plan(m) if planned else None
        assert (plan is not None) == planned
        m._plan = Counting(plan) if planned else False
        counters.append(m._plan)

    def run(chunks, ids, draft=False):
        x, keep = ids, None
        for m, c in zip(stages, caches):
            b = c.prepare(chunks)
            x, keep = m(x, b, c, keep)
        last = stages[-1]
        h = last.final_norm(x)
        lo = last.logits(h)
        if draft:  # the MTP layer on the same rows, fed the greedy next tokens (as a drafter)
            d = last.mtp_forward(lo.argmax(-1), h, b, caches[-1])
            lo = torch.cat([lo, last.mtp_logits(d)])
        return lo

    toks = []
    with torch.no_grad():
        for i, n in enumerate(prompts):
            lo = run([Chunk(i, 0, n)], torch.randint(1, 250, (n,), generator=g))
            toks.append(int(lo[-1].argmax()))
        pos = list(prompts)
        out = []
        for _ in range(steps):
            chunks = [Chunk(i, pos[i], rows) for i in range(len(prompts))]
            ids = torch.tensor([t for t in toks for _ in range(rows)])
            lo = run(chunks, ids, mtp)
            out.append(lo)
            toks = lo[: len(ids)].view(len(prompts), rows, -1)[:, -1].argmax(-1).tolist()
            pos = [p + rows for p in pos]
    stores = [(c.kv, c.index_k) for c in caches]
    return (
        out,
        stores,
        [(c.taken, c.drafts) if mtp else c.taken for c in counters] if planned else None,
    )


def _same(a, b):
    (la, sa, _), (lb, sb, taken) = a, b
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    for (kva, ixa), (kvb, ixb) in zip(sa, sb):
        assert all(torch.equal(kva[k], kvb[k]) for k in kva)
        assert all(torch.equal(ixa[k], ixb[k]) for k in ixa)
    return taken


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 2, 6])  # 6: 18 rows, past the router kernel's 16
def test_planned_steps_give_the_modules_bits(fmt, rows, mxfp4_dir):
    path = ensure_default_model() if fmt == "bf16" else mxfp4_dir
    m = _model(path)
    taken = _same(_decode([m], False, rows), _decode([m], True, rows))
    assert taken == [5]  # every decode step planned (the prefills declined)


@pytest.mark.parametrize("rows", [1, 2])
def test_int8_index_keys_planned_give_the_modules_bits(rows):
    """DSAConfig.index_keys="int8": the plan's selection quantises the queries as the modules'
    does, so the logits and both caches (the int8 key rows too) are the same bits."""
    m = _model(ensure_default_model(), DSAConfig(mode="sparse", index_keys="int8"))
    (la, sa, _), b = _decode([m], False, rows), _decode([m], True, rows)
    assert all(s.dtype == torch.uint8 for s in sa[0][1].values())
    assert _same((la, sa, None), b) == [5]


@pytest.mark.parametrize("rows", [1, 2])
def test_the_w4a8_experts_planned_give_the_modules_bits(rows, mxfp4_dir, monkeypatch):
    """DIST_GLM5_EXPERTS=w4a8 (the int8-activation kernel): the plan calls it as the modules do."""
    from dist_glm5.backends.cpu import cpu_ops
    from dist_glm5.kernels import mxfp4_w4a8

    monkeypatch.setenv("DIST_GLM5_EXPERTS", "w4a8")
    cpu_ops.cache_clear()  # the backend's ops are made once per process
    try:
        m = _model(mxfp4_dir)
        assert m.ops.experts.mxfp4 is mxfp4_w4a8.moe_mxfp4_w4a8
        taken = _same(_decode([m], False, rows), _decode([m], True, rows))
        assert taken == [5]
        monkeypatch.delenv("DIST_GLM5_EXPERTS")
        cpu_ops.cache_clear()
        exact = _model(mxfp4_dir)
        assert exact.ops.experts.mxfp4 is not mxfp4_w4a8.moe_mxfp4_w4a8
        # and it is not the exact kernel's step
        assert not torch.equal(_decode([exact], True, rows)[0][-1], _decode([m], True, rows)[0][-1])
    finally:
        cpu_ops.cache_clear()


def test_the_mtp_layer_planned_gives_the_modules_bits(mxfp4_dir):
    m = _model(mxfp4_dir)
    taken = _same(_decode([m], False, 2, mtp=True), _decode([m], True, 2, mtp=True))
    assert taken == [(5, 5)]  # the verify-shaped steps and their drafts


@pytest.mark.parametrize("layers", [None, (range(0, 1), range(1, 4))])
def test_contexts_within_index_topk_give_the_modules_bits(layers, mxfp4_dir):
    """Every sequence within index_topk (64) keys: each full layer selects all of them, and the
    plan selects once a step for all its layers (a second stage reuses the first's)."""
    stages = (
        [_model(mxfp4_dir)] if layers is None else [_model(mxfp4_dir, layers=r) for r in layers]
    )
    short = (30, 12, 50)  # + 5 steps of 2 rows: at most 60 keys
    taken = _same(_decode(stages, False, 2, prompts=short), _decode(stages, True, 2, prompts=short))
    assert taken == [5] * len(stages)


def test_a_second_stage_starting_with_a_shared_layer(mxfp4_dir):
    # layers 0 | 1-3: stage 2's first layer is 'shared' and reads stage 1's listed selection
    stages = [_model(mxfp4_dir, layers=range(0, 1)), _model(mxfp4_dir, layers=range(1, 4))]
    assert stages[1].model.layers["1"].self_attn.indexer is None
    taken = _same(_decode(stages, False), _decode(stages, True))
    assert taken == [5, 5]


def test_the_plan_declines_what_it_does_not_take():
    from dist_glm5.obs import profiler

    m = _model(ensure_default_model())
    plan = cpu_plan.plan(m)
    c = m.new_cache(blocks_needed([300, 300], 64), 64)
    x = torch.tensor([5, 6])
    with torch.no_grad():
        m._plan = False
        for i in range(2):
            m(torch.randint(1, 250, (100,)), c.prepare([Chunk(i, 0, 100)]), c)
        assert plan(torch.randint(1, 250, (20,)), c.prepare([Chunk(0, 100, 20)]), c) is None
        # a decode row beside a verify chunk: padded rows
        assert (
            plan(torch.tensor([5, 6, 7]), c.prepare([Chunk(0, 120, 1), Chunk(1, 100, 2)]), c)
            is None
        )
        assert plan(x, c.prepare([Chunk(0, 121, 1), Chunk(1, 102, 1)]), c) is not None
        m.model.layers["2"].mlp.recorder = (object(), 2)  # routes being recorded
        assert plan(x, c.prepare([Chunk(0, 122, 1), Chunk(1, 103, 1)]), c) is None
        m.model.layers["2"].mlp.recorder = None
        h = m.model.layers["1"].mlp.register_forward_hook(lambda *a: None)  # someone watches
        assert plan(x, c.prepare([Chunk(0, 123, 1), Chunk(1, 104, 1)]), c) is None
        h.remove()
        # the profiler's hooks do not stop it: the plan opens the same spans itself
        prof = profiler.Profiler()
        profiler.install(m, prof)
        prof.enabled = True
        assert plan(x, c.prepare([Chunk(0, 124, 1), Chunk(1, 105, 1)]), c) is not None
        names = [e[0] for e in prof.take()]
        assert names.count("attention") == 4 and names.count("experts") == 3
        assert {"router", "shared", "moe", "mlp"} <= set(names)
    # no plan for the dense reference attention, nor for fp32 weights
    assert cpu_plan.plan(load_model(ensure_default_model(), torch.bfloat16, ops=m.ops)) is None
    assert (
        cpu_plan.plan(load_model(ensure_default_model(), torch.float32, ops=m.ops, dsa=SPARSE))
        is None
    )


def test_a_step_over_the_gather_cap_goes_to_the_modules():
    """mla_decode's scratch grows with a call's rows: under a gather cap of two rows' scratch,
    the plan takes steps of 2 rows and leaves 3 to the modules, whose wrapper splits them into
    capped calls; the bits are the uncapped model's."""
    from dist_glm5.kernels import mla_decode

    m = _model(ensure_default_model())
    L = cpu_plan.plan(m).layers[0]
    row = mla_decode._kernel.get().mla_decode_row_bytes(L.heads, L.c, L.rope, L.topk, 1)
    capped = _model(ensure_default_model(), DSAConfig(mode="sparse", gather_cap_bytes=2 * row))
    assert cpu_plan.plan(capped).max_rows == 2
    two, three = PROMPTS[:2], PROMPTS  # sequences, one row each a step
    assert _same(_decode([m], False, prompts=two), _decode([capped], True, prompts=two)) == [5]
    assert _same(_decode([m], False, prompts=three), _decode([capped], True, prompts=three)) == [0]


def test_moving_the_weights_drops_the_plan():
    m = _model(ensure_default_model())
    c = m.new_cache(blocks_needed([100], 64), 64)
    with torch.no_grad():
        m(torch.randint(1, 250, (60,)), c.prepare([Chunk(0, 0, 60)]), c)
    assert m._plan
    m.to(torch.bfloat16)
    assert m._plan is None


def test_the_planned_heads_give_the_modules_bits(mxfp4_dir):
    """lm_head and the draft's head through the plan: the module's logits bit for bit, for 1 to
    ROWS rows; more rows, fp32 rows or a hook on the head: the module runs."""
    m = _model(mxfp4_dir)
    assert m._planned()
    plan, g = m._plan, torch.Generator().manual_seed(0)
    for T in (1, 2, cpu_plan.ROWS):
        h = torch.randn(T, m.cfg.hidden_size, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            want = m.lm_head(h).float()
            assert torch.equal(plan.head(m.lm_head, h), want)
            assert torch.equal(m.logits(h), want) and torch.equal(m.mtp_logits(h), want)
    h = torch.randn(cpu_plan.ROWS + 1, m.cfg.hidden_size).to(torch.bfloat16)
    assert plan.head(m.lm_head, h) is None and plan.head(m.lm_head, h[:2].float()) is None
    hook = m.lm_head.register_forward_hook(lambda *a: None)
    assert plan.head(m.lm_head, h[:2]) is None
    hook.remove()
