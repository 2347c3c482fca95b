"""Memory planner: what one worker (a stage's rank) needs, by kind.

weights      the stage's tensors at their stored/compute size (MXFP4 experts: 0.5 B per element +
             one scale byte per 32), routed experts divided over EP ranks or TP-split, attention
             and dense MLP over TP ranks, embedding / lm_head / MTP where the stage holds them
mla_cache    (kv_lora_rank + qk_rope_head_dim) values per token per layer (replicated on TP ranks)
indexer      index_head_dim values per token per layer that runs an indexer (int8 keys:
             index_head_dim + 4 bytes)
workspace    a prefill chunk's activations, the indexer's score rows and DSA keep-masks, the
             capped gathers with their attention temporaries (a few multiples of the gather cap),
             and the host RoPE tables (grown by doubling: 64 MiB for the embedded model at 637K)
runtime      the process itself (Python, torch, Ray worker): a measured constant per backend
Figures for real hardware are computed, never measured here.

Checked against runs here (CPU, the embedded model, bench long-job; tests/test_worker_memory.py):
the runtime and the indexer's score temporaries were the terms off, and are measured below.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa import DSAConfig, score_rows
from dist_glm5.model.rope import table_bytes as rope_table_bytes

GIB = 1 << 30
MIB = 1 << 20
# cpu: a stage worker's resident memory before its cache and workspaces fill (Python, torch 2.13,
# the Ray worker runtime, the dist_glm5 modules): 254-272 MiB measured here (VmHWM of Ray workers
# at 4K, and at 87K minus the other terms); it was 1 GiB, which put the plan 3x over a run at 4K.
# About 147 MiB of that is file-backed (libtorch's code pages), which varies by machine: the same
# worker peaked at 345 MiB here with the oracles installed and at 432 MiB on CI.
# hpu: an allowance for the bridge and graph caches (not measured: no card here).
RUNTIME_BYTES = {"cpu": 272 * MIB, "hpu": int(3.0 * GIB)}
# Bytes held per (query row, key) while a full layer selects its keys, per selection path:
# cpu (kernels/dsa_select, one rank): the fp32 scores, in a scratch buffer kept between calls
# with 1/8 headroom (the context grows a chunk per call);
# cpu-torch (select_topk_sorted: ranks that split rows, or no C compiler): the fp32 scores, their
# causal-masked fp32 copy, the causal mask and its inverse, the keep mask and its causal AND:
# 11.1-12.3 B measured (one select() of 256 rows over 200K-640K keys, VmHWM growth less the keep
# mask); hpu (bisection): fp32 scores, int32 order keys, a mask, the budget dsa.score_rows sizes
# its row blocks by (not measured).
SCORE_BYTES = {"cpu": 4.5, "cpu-torch": 12, "hpu": 9}


@dataclass(frozen=True)
class WorkerMemory:
    weights: int
    mla_cache: int
    indexer_cache: int
    workspace: int
    runtime: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def stage_expert_bytes(
    cfg: ModelConfig,
    layers: range,
    mtp: bool,
    tp: int = 1,
    ep: int = 1,
    dtype_bytes: int = 2,
    experts_format: str | None = None,
) -> int:
    """The routed experts' share of stage_weight_bytes (MXFP4: packed elements + E8M0 scales)."""
    fmt = experts_format or cfg.experts_format
    e = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    per = e // 2 + e // 32 if fmt == "mxfp4" else e * dtype_bytes
    local = cfg.n_routed_experts // ep if ep > 1 else cfg.n_routed_experts
    own = list(layers) + (
        [cfg.num_hidden_layers + j for j in range(cfg.num_nextn_predict_layers)] if mtp else []
    )
    return sum(cfg.is_moe_layer(i) for i in own) * local * per // (tp if ep == 1 else 1)


def stage_weight_bytes(
    cfg: ModelConfig,
    layers: range,
    first: bool,
    last: bool,
    mtp: bool,
    tp: int = 1,
    ep: int = 1,
    dtype_bytes: int = 2,
    experts_format: str | None = None,
) -> int:
    """Bytes of the weights one rank of a stage holds."""
    fmt = experts_format or cfg.experts_format
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    h = cfg.num_attention_heads
    attn = (
        H * cfg.q_lora_rank
        + cfg.q_lora_rank
        + cfg.q_lora_rank * h * cfg.qk_head_dim // tp
        + H * cfg.kv_cache_dim
        + cfg.kv_lora_rank
        + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) // tp
        + h * cfg.v_head_dim * H // tp
        + 2 * H
    )
    indexer = (
        cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
        + H * cfg.index_head_dim
        + 2 * cfg.index_head_dim
        + H * cfg.index_n_heads
    )
    expert_elems = 3 * H * I
    expert_bytes = (
        expert_elems // 2 + expert_elems // 32 if fmt == "mxfp4" else expert_elems * dtype_bytes
    )
    local_experts = E // ep if ep > 1 else E
    moe = (
        local_experts * expert_bytes // (tp if ep == 1 else 1)
        + (3 * H * I * cfg.n_shared_experts // tp + E * H + E) * dtype_bytes
    )
    dense = 3 * H * cfg.intermediate_size // tp * dtype_bytes
    total = 0
    all_layers = list(layers) + (
        [cfg.num_hidden_layers + j for j in range(cfg.num_nextn_predict_layers)] if mtp else []
    )
    for i in all_layers:
        total += (attn + (indexer if cfg.has_indexer(i) else 0)) * dtype_bytes
        total += moe if cfg.is_moe_layer(i) else dense
        if i >= cfg.num_hidden_layers:
            total += (2 * H * H + 3 * H) * dtype_bytes  # eh_proj and the MTP norms
    # embedding and lm_head are vocab-parallel over the TP ranks (as vLLM's VocabParallelEmbedding /
    # ParallelLMHead); q_a/kv_a projections, the indexer and the router are replicated on every rank
    if first or mtp:
        total += cfg.vocab_size * H * dtype_bytes // tp
    if last:
        total += cfg.vocab_size * H * dtype_bytes // tp + H * dtype_bytes
    return total


def model_weight_bytes(
    cfg: ModelConfig, experts_format: str = "mxfp4", mtp: bool = False, dtype_bytes: int = 2
) -> int:
    """The whole model's weights, unsharded (the figure a release's size is quoted in)."""
    return stage_weight_bytes(
        cfg, range(cfg.num_hidden_layers), True, True, mtp, 1, 1, dtype_bytes, experts_format
    )


_DEFAULT_DSA = DSAConfig()


def score_bytes(dsa: DSAConfig, chunk_tokens: int, context: int, backend: str = "cpu") -> int:
    """What a full layer's key selection holds at once for one prefill chunk, its keep mask
    aside: the row block dsa.select / select_fused score at once (sized so that 9 B per element
    stay under the gather cap) at what the selection path holds per element (SCORE_BYTES)."""
    rows = min(score_rows(dsa, max(1, context)), chunk_tokens)
    return int(rows * context * SCORE_BYTES[backend])


def worker_memory(
    cfg: ModelConfig,
    layers: range,
    first: bool,
    last: bool,
    mtp: bool,
    cache_tokens: int,
    chunk_tokens: int,
    context: int,
    tp: int = 1,
    ep: int = 1,
    dtype_bytes: int = 2,
    cache_bytes: int | None = None,
    dsa: DSAConfig = _DEFAULT_DSA,
    backend: str = "cpu",
    experts_format: str | None = None,
) -> WorkerMemory:
    cb = cache_bytes or dtype_bytes
    own = list(layers) + (
        [cfg.num_hidden_layers + j for j in range(cfg.num_nextn_predict_layers)] if mtp else []
    )
    mla = cache_tokens * cfg.kv_cache_dim * cb * len(own)
    # an index key: its values in the cache's dtype, or int8 values and an fp32 scale
    key = cfg.index_head_dim + 4 if dsa.index_keys == "int8" else cfg.index_head_dim * cb
    idx = cache_tokens * key * sum(cfg.has_indexer(i) for i in own)
    wide = max(
        cfg.hidden_size,
        cfg.q_lora_rank,
        cfg.num_attention_heads * cfg.qk_head_dim // tp,
        cfg.intermediate_size // tp,
        cfg.index_n_heads * cfg.index_head_dim,
    )
    activations = (
        chunk_tokens * wide * 4 * 16
    )  # a dozen or so [chunk, wide] fp32 buffers live at once
    # Each capped temporary costs what this context needs of it, at most its cap (a small context
    # never fills a 512 MB cap).
    cap = dsa.gather_cap_bytes
    # ranks that split a layer's rows select in torch (kernels/dsa_select takes whole layers)
    path = "cpu-torch" if backend == "cpu" and tp > 1 else backend
    scores = score_bytes(dsa, chunk_tokens, context, path)
    # a full layer's keep-mask, held for the shared layer after it; none where the CPU's fused
    # selection lists the slots and "rows" attends by them (layers share the slot lists)
    masks = 0 if path == "cpu" and dsa.prefill_attention == "rows" else 2 * chunk_tokens * context
    width = cfg.kv_cache_dim * 4  # a gathered cache row in fp32
    if dsa.prefill_attention == "rows":  # each query's own top-k rows
        need = chunk_tokens * min(context, cfg.index_topk) * width
    else:  # a window's union or every key, and the window's scores over them
        need = max(context * width, dsa.window * cfg.num_attention_heads * context * 4)
    # the gather, its fp32 copy, scores and probabilities (on CPU by rows: mla_decode's scratch,
    # also under the cap)
    gathers = 4 * min(cap, need)
    rope = rope_table_bytes(context, cfg.qk_rope_head_dim)  # host cos/sin tables (model/rope.py)
    return WorkerMemory(
        stage_weight_bytes(cfg, layers, first, last, mtp, tp, ep, dtype_bytes, experts_format),
        mla,
        idx,
        activations + scores + masks + gathers + rope,
        RUNTIME_BYTES[backend],
    )
