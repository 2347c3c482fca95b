"""DSA lightning indexer math: key scores (the reference of `Ops.index_scores`) and the plain
sort-based top-k every selection path is checked against.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) * index_head_dim**-0.5,
    w = weights_proj(x) * H**-0.5
computed in fp32; keys after the query (causal) never count. Each query keeps its
top-min(index_topk, valid keys) keys; the rest are masked out of the MLA softmax.

Tie rule (documented, used by every selection path): higher score first; among equal scores
the EARLIER key position wins. The reference implements it with a stable descending sort.
The projections that make q, k and w are model/indexer.py's.
"""

from __future__ import annotations

import torch

from dist_glm5.quant import index_q8


def index_scores(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, head_dim: int
) -> torch.Tensor:
    # q: [..., n, Hi, D], w: [..., n, Hi] fp32, keys: [..., L, D] -> scores [..., n, L] fp32
    # relu(x * s) == s * relu(x) for s > 0: the scale rides on the head weights (one pass fewer over
    # the [n, Hi, L] buffer). Every selection path computes scores with this one function, so they
    # agree bit for bit.
    # The heads are folded into the rows of ONE GEMM ([n*Hi, D] x [D, L]), not n batched small
    # ones: 5x faster on CPU at 16K keys, same products.
    if index_q8.is_store(keys):
        return index_scores_q8(q, w, keys, head_dim)
    *lead, n, Hi, D = q.shape
    s = torch.matmul(q.float().reshape(*lead, n * Hi, D), keys.float().transpose(-1, -2))
    s = s.relu_().view(*lead, n, Hi, -1)  # [..., n, Hi, L]
    return torch.matmul((w * head_dim**-0.5).unsqueeze(-2), s).squeeze(-2)


def index_scores_q8(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, head_dim: int):
    # q: [n, Hi, D], w: [n, Hi] fp32, rows: [L, D + 4] int8 key rows (quant/index_q8.py) ->
    # scores [n, L] fp32. The queries are quantised per (row, head); the integer dots are exact
    # in fp32 (|idot| <= D * 127^2 < 2^24 for D <= 1024). Both scales are positive, so they leave
    # the relu: the query's rides on the head weight, the key's on the sum (as the kernel does).
    n, Hi, D = q.shape
    k8, ks = index_q8.unpack(rows)
    q8, qs = index_q8.quantise(q)
    idot = torch.matmul(q8.float().reshape(n * Hi, D), k8.float().T).view(n, Hi, -1).relu_()
    c = (w.float() * head_dim**-0.5) * qs  # [n, Hi]
    return torch.matmul(c.unsqueeze(-2), idot).squeeze(-2) * ks


def select_topk_reference(scores: torch.Tensor, q_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Boolean keep-mask [..., L]: each query's top-min(topk, valid) causal keys.

    scores: [..., L] fp32 over key positions 0..L-1; q_pos: [...] absolute query positions.
    """
    L = scores.shape[-1]
    causal = torch.arange(L, device=scores.device) <= q_pos[..., None]  # [..., L]
    if topk >= L:
        return causal
    s = scores.masked_fill(~causal, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[
        ..., :topk
    ]  # ties -> earlier key
    keep = torch.zeros_like(causal).scatter_(-1, order, True)
    return keep & causal
