"""Int8 indexer keys (quant/index_q8.py, `DSAConfig.index_keys="int8"`): the codec against its rule
written out in numpy; the fused projection (kernels/mla_project.c) writing the codec's bytes; the
cache and the planner counting D + 4 bytes a key; the option refused where it has no meaning;
and, on the shipped model's own keys, selections that keep nearly every key the exact ones keep
and greedy tokens equal to the exact keys' on a held-out text. The kernel's scores against their
torch form are in test_dsa_select.py, the planned step against the modules in
test_decode_plan.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.default_model import ensure_default_model
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.kernels import dsa_select, mla_project
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa_config import DSAConfig
from dist_glm5.model.kv_cache import Chunk, PagedKVCache
from dist_glm5.model.mla import MLA
from dist_glm5.model.reference_loop import blocks_needed
from dist_glm5.planning.worker_memory import worker_memory
from dist_glm5.quant import index_q8

INT8 = DSAConfig(mode="sparse", index_keys="int8")


def test_the_codec_is_its_written_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None]
    x[3] = 0.0  # an all-zero key: scale 1, values 0
    x[4, :] = 0.0
    x[4, 7] = -2.5  # one value: it becomes -127
    x[5] = torch.arange(64) - 31.75  # halves after scaling: round half to even
    rows = index_q8.pack(x)
    assert rows.dtype == torch.uint8 and rows.shape == (50, index_q8.row_bytes(64)) == (50, 68)

    xn = x.numpy().astype(np.float32)
    amax = np.abs(xn).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    vals = np.clip(np.round(xn / scale[:, None]), -127, 127).astype(np.int8)  # half to even
    want = np.concatenate([vals.view(np.uint8), scale[:, None].view(np.uint8)], axis=1)
    assert np.array_equal(rows.numpy(), want)

    k8, ks = index_q8.unpack(rows)
    assert torch.equal(k8, torch.from_numpy(vals)) and torch.equal(ks, torch.from_numpy(scale))
    assert ks[3] == 1 and not k8[3].any() and k8[4, 7] == -127
    err = (k8.float() * ks[:, None] - x).abs().amax(1)
    assert (err <= ks / 2 * (1 + 1e-6)).all()  # within half a step of each key's scale


def test_the_fused_projection_writes_the_codec_bytes():
    """mla_project.c quantises the key it computed; the same call into a bf16 store gives that
    key, and packing it must give the int8 store's bytes."""
    m = load_model(ensure_default_model(), torch.bfloat16, ops=get_backend("cpu").ops(), dsa=INT8)
    att = next(a for a in m.modules() if isinstance(a, MLA) and a.indexer is not None)
    assert mla_project.available()
    g = torch.Generator().manual_seed(1)
    T, D = 3, att.indexer.head_dim
    x = torch.randn(T, att.q_a_proj.in_features, generator=g).bfloat16()
    cs = torch.rand(T, att.rope // 2, generator=g)
    slots = torch.tensor([5, 0, 17])
    stores = []
    for ix in (torch.zeros(20, D, dtype=torch.bfloat16), index_q8.empty_store(20, D).zero_()):
        kv = torch.zeros(20, att.kv_lora + att.rope, dtype=torch.bfloat16)
        got = mla_project.project(x, att.project_weights(), cs, cs, slots, kv, ix)
        assert got is not None, "the kernel declined an int8 index store"
        stores.append(ix)
    bf16, q8 = stores
    assert bf16[slots].abs().sum() > 0
    assert torch.equal(q8[slots], index_q8.pack(bf16[slots]))
    assert not q8[[i for i in range(20) if i not in slots.tolist()]].any()  # nothing else written


def test_the_cache_and_the_planner_count_d_plus_4_bytes():
    cfg = ModelConfig.from_hf(ensure_default_model())
    layers = list(range(cfg.num_hidden_layers))
    n_idx = sum(cfg.has_indexer(i) for i in layers)
    D = cfg.index_head_dim
    exact = PagedKVCache(cfg, layers, 4, 16, dtype=torch.bfloat16)
    q8 = PagedKVCache(cfg, layers, 4, 16, dtype=torch.bfloat16, index_keys="int8")
    assert len(q8.index_k) == len(exact.index_k) == n_idx
    for s in q8.index_k.values():
        assert s.dtype == torch.uint8 and s.shape == (64, D + 4)

    def idx_bytes(dsa):
        return worker_memory(
            cfg, range(cfg.num_hidden_layers), True, True, False, 1000, 64, 1000, dsa=dsa
        ).indexer_cache

    assert idx_bytes(DSAConfig(mode="sparse")) == 1000 * D * 2 * n_idx
    assert idx_bytes(INT8) == 1000 * (D + 4) * n_idx


def test_the_option_is_refused_where_it_has_no_meaning():
    with pytest.raises(ValueError, match="sparse DSA path"):
        DSAConfig(mode="reference", index_keys="int8")
    with pytest.raises(ValueError, match="use 'exact' or 'int8'"):
        DSAConfig(mode="sparse", index_keys="fp8")


HELD_OUT = (
    b"import json\nimport os\n\n\ndef load_config(path):\n"
    b'    """Read a JSON config file and return it as a dict."""\n'
    b"    with open(path) as f:\n        return json.load(f)\n\n\n"
    b"def walk(root):\n    result = []\n    for dirpath, _, files in os.walk(root):\n"
    b"        for name in files:\n            result.append(os.path.join(dirpath, name))\n"
    b"    return result\n\n\nclass Store:\n    def __init__(self, root):\n"
    b"        self.root = root\n        self.items = {}\n\n    def get(self, key):\n"
    b"        return self.items.get(key)\n\n    def put(self, key, value):\n"
    b"        self.items[key] = value\n\n"
)


def _greedy(dsa, prompt: bytes, steps: int):
    """The shipped model in bf16: prefill, then `steps` greedy tokens -> (tokens, the cache)."""
    m = load_model(ensure_default_model(), torch.bfloat16, ops=get_backend("cpu").ops(), dsa=dsa)
    ids = list(prompt)
    cache = m.new_cache(blocks_needed([len(ids) + steps], 16), 16)
    toks = []
    with torch.no_grad():
        h, _ = m(torch.tensor(ids), cache.prepare([Chunk(0, 0, len(ids))]), cache)
        for i in range(steps):
            t = int(m.logits(m.final_norm(h[-1:])).argmax())
            toks.append(t)
            h, _ = m(torch.tensor([t]), cache.prepare([Chunk(0, len(ids) + i, 1)]), cache)
    return m, toks, cache


def test_on_the_shipped_models_keys_selections_and_tokens_stay():
    """Past index_topk keys, int8 keys keep >= 95% of what the exact keys keep (the model's own
    keys and queries, every indexer layer), and greedy decoding gives the exact keys' tokens."""
    m, exact_toks, cache = _greedy(DSAConfig(mode="sparse"), HELD_OUT, 24)
    _, q8_toks, _ = _greedy(INT8, HELD_OUT, 24)
    assert q8_toks == exact_toks

    topk = m.cfg.index_topk
    L = len(HELD_OUT) + 24
    assert L > 2 * topk, "the text must be past top-k for the selection to choose"
    table = cache.tables[0]
    from dist_glm5.ops.key_slots import KeySlots

    keys = KeySlots(table.view(), cache.block_size, L)
    g = torch.Generator().manual_seed(3)
    kept = total = 0
    for layer, store in cache.index_k.items():
        if layer >= m.cfg.num_hidden_layers:
            continue  # the MTP layer's cache: this run writes none of it
        att = m.model.layers[str(layer)].self_attn
        H, D = att.indexer.n_heads, att.indexer.head_dim
        # queries shaped like the model's: its own keys, one per head, at the last rows' positions
        q = store[keys.range(L - 8, L)].float()[:, None, :].expand(8, H, D).contiguous()
        q = q + 0.1 * torch.randn(q.shape, generator=g)
        w = torch.rand(8, H, generator=g)
        q_pos = torch.arange(L - 8, L)
        ex, _, _ = dsa_select.select_rows(q, w, store, keys, q_pos, topk, D)
        q8_store = index_q8.pack(store.float())
        got, _, _ = dsa_select.select_rows(q, w, q8_store, keys, q_pos, topk, D)
        kept += (ex & got).sum().item()
        total += ex.sum().item()
    assert kept / total >= 0.95, f"int8 keys kept {kept} of the exact keys' {total}"


def test_bench_longctx_decodes_with_int8_keys():
    """`bench longctx`'s decode measurement runs on an int8 cache (synthetic rows in its layout)."""
    from dist_glm5.bench.longctx import _DECODE, sub

    r = sub(_DECODE, 300, 2, 2, 1, 1, "int8", "")
    assert r is not None and r["ms_per_step"] > 0
    # what its floor divides by the read rate: per position, every full indexer's cache row
    # (the embedded model: 2 full indexers of D = 32; D + 4 bytes in int8, 2 D in bf16)
    cfg = ModelConfig.from_hf(ensure_default_model())
    full = sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    assert full == 2 and cfg.index_head_dim == 32
    assert r["index_key_bytes_per_position"] == full * index_q8.row_bytes(cfg.index_head_dim)
    # the same keys with the kernel's AMX path off (the A/B where the CPU has AMX)
    r = sub(_DECODE, 300, 2, 2, 1, 1, "int8-vnni", "")
    assert r is not None and r["index_key_bytes_per_position"] == full * (cfg.index_head_dim + 4)
    r = sub(_DECODE, 300, 2, 2, 1, 1, "exact", "")
    assert r["index_key_bytes_per_position"] == full * cfg.index_head_dim * 2
