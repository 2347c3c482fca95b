"""MLA attention math, the references of the four attention fields of `Ops`.

Dense over a group's keys with a keep mask, two forms of the same math:
- `mla_expanded` (prefill): expand the cached latent into per-head keys and values with kv_b_proj.
- `mla_absorbed` (decode): fold kv_b_proj's key half into the query and its value half into the
  output, so attention runs directly over the compressed latent cache (what serving kernels do).
Sparse (DSA), over the latent cache rows [kv_a_layernorm(latent) | roped k_rot], absorbed form:
- `attend_gathered` (decode): each query row over its own <= topk gathered rows;
  `absorbed_gathered` is the whole decode around it (W_uk before, W_uv after).
- `attend_absorbed_chunked` (prefill): candidate keys in capped chunks with an online softmax
  (fp32 statistics), so no gather exceeds the cap and no [queries, context] score matrix is
  materialised at once.
A fully masked row cannot occur (a query always keeps at least itself), and padded rows of a batch
repeat a real query, so no row computes 0/0. The module that runs them is model/mla.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_glm5.ops.gather import (
    attn_key_bytes,
    attn_key_chunks,
    capped_chunks,
    decode_row_bytes,
    gather_keys,
    gather_rows,
    key_ranges,
)
from dist_glm5.ops.key_slots import KeySlots


def mla_expanded(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    w_kv_b: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
    nope: int,
) -> torch.Tensor:
    # q_nope: [B, n, h, nope], q_rot: [B, n, h, r], latent: [B, L, c], k_rot: [B, L, r],
    # w_kv_b: [h*(nope+v), c], keep: [B, n, L] bool -> out [B, n, h, v]
    B, n, h, _ = q_nope.shape
    kv = F.linear(latent, w_kv_b).view(B, latent.shape[1], h, -1)  # [B, L, h, nope+v]
    k_nope, v = kv[..., :nope], kv[..., nope:]
    s = torch.einsum("bnhd,blhd->bhnl", q_nope, k_nope) + torch.einsum(
        "bnhr,blr->bhnl", q_rot, k_rot
    )
    s = (s * scale).masked_fill(~keep[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.einsum("bhnl,blhv->bnhv", p, v)


def mla_absorbed(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    w_kv_b: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
    nope: int,
) -> torch.Tensor:
    # Same signature and result as mla_expanded; cost O(L * c) per head instead of
    # O(L * h * (nope+v)).
    B, n, h, _ = q_nope.shape
    c = latent.shape[-1]
    w = w_kv_b.view(h, -1, c)  # [h, nope+v, c]
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [h, nope, c], [h, v, c]
    q_lat = torch.einsum("bnhd,hdc->bnhc", q_nope, w_uk)
    s = torch.einsum("bnhc,blc->bhnl", q_lat, latent) + torch.einsum("bnhr,blr->bhnl", q_rot, k_rot)
    s = (s * scale).masked_fill(~keep[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(latent.dtype)
    o_lat = torch.einsum("bhnl,blc->bnhc", p, latent)
    return torch.einsum("bnhc,hvc->bnhv", o_lat, w_uv)


def attend_absorbed_chunked(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    kv_store: torch.Tensor,
    keys: KeySlots | torch.Tensor,
    mask: torch.Tensor,
    kv_lora: int,
    scale: float,
    cap: int,
) -> torch.Tensor:
    """Absorbed MLA over candidate keys, online softmax across capped key chunks.

    q_lat [n, h, c] (q_nope folded through W_uk), q_rot [n, h, r]; keys: every key of the
    sequence (KeySlots, gathered by blocks) or K candidate slots [K]; mask [n, K] bool (at least
    one True per row) -> latent output [n, h, c] fp32."""
    n, h, c = q_lat.shape
    m = torch.full((n, h), float("-inf"), device=q_lat.device)
    den = torch.zeros(n, h, device=q_lat.device)
    acc = torch.zeros(n, h, c, device=q_lat.device)
    if isinstance(keys, KeySlots):  # every key of the sequence: read by blocks
        row_bytes = attn_key_bytes(n, h, kv_store.shape[1], kv_store.element_size())
        capped_chunks(1, row_bytes, cap)  # raises when one key is over the cap
        ranges = key_ranges(len(keys), max(1, cap // row_bytes), keys.block_size)
    else:
        ranges = [
            (a, b, False)
            for a, b in attn_key_chunks(
                n, h, len(keys), kv_store.shape[1], kv_store.element_size(), cap
            )
        ]
    for a, b, by_blocks in ranges:
        if isinstance(keys, KeySlots):
            rows = gather_keys(kv_store, keys, a, b, by_blocks)
        else:
            rows = gather_rows(kv_store, keys[a:b])
        rows = rows.float()  # [k, c + r]
        lat, kr = rows[:, :kv_lora], rows[:, kv_lora:]
        s = (
            torch.einsum("nhc,kc->nhk", q_lat.float(), lat)
            + torch.einsum("nhr,kr->nhk", q_rot.float(), kr)
        ) * scale
        s = s.masked_fill(~mask[:, None, a:b], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(
            torch.isinf(m_new), torch.zeros_like(m_new), m_new
        )  # rows with nothing yet
        corr = torch.exp(m - safe)
        p = torch.exp(s - safe[..., None])
        den = den * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.einsum("nhk,kc->nhc", p, lat)
        m = m_new
    return acc / den[..., None]


def attend_gathered(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    kv_store: torch.Tensor,
    sel_slots: torch.Tensor,
    sel_valid: torch.Tensor,
    kv_lora: int,
    scale: float,
    cap: int,
) -> torch.Tensor:
    """Decode form: each query row attends over its own <= topk gathered rows.

    sel_slots [n, k] (padding repeats a valid slot), sel_valid [n, k] -> latent output [n, h, c]
    fp32."""
    n, k = sel_slots.shape
    out = torch.empty(n, q_lat.shape[1], q_lat.shape[2], device=q_lat.device)
    for a, b in capped_chunks(
        n, decode_row_bytes(k, q_lat.shape[1], kv_store.shape[1], kv_store.element_size()), cap
    ):
        rows = gather_rows(kv_store, sel_slots[a:b]).float()  # [m, k, c + r]
        lat, kr = rows[..., :kv_lora], rows[..., kv_lora:]
        s = (
            torch.einsum("nhc,nkc->nhk", q_lat[a:b].float(), lat)
            + torch.einsum("nhr,nkr->nhk", q_rot[a:b].float(), kr)
        ) * scale
        s = s.masked_fill(~sel_valid[a:b, None, :], float("-inf"))
        p = torch.softmax(s, -1)
        out[a:b] = torch.einsum("nhk,nkc->nhc", p, lat)
    return out


def absorbed_gathered(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    w_kv_b: torch.Tensor,
    kv_store: torch.Tensor,
    sel_slots: torch.Tensor,
    sel_valid: torch.Tensor,
    nope: int,
    scale: float,
    cap: int,
    einsum=torch.einsum,
    attend=attend_gathered,
) -> torch.Tensor:
    """Sparse decode, whole: q_nope [n, h, nope] folded through W_uk, `attend` (attend_gathered)
    over each row's selected rows, the latent output through W_uv -> out [n, h, v] in q_nope's
    dtype. w_kv_b: kv_b_proj's weight [h * (nope + v), c]; einsum, attend: the backend's."""
    h, c = q_nope.shape[1], kv_store.shape[1] - q_rot.shape[-1]
    w = w_kv_b.view(h, -1, c)
    q_lat = einsum("nhd,hdc->nhc", q_nope, w[:, :nope])
    o_lat = attend(q_lat, q_rot, kv_store, sel_slots, sel_valid, c, scale, cap)
    return einsum("nhc,hvc->nhv", o_lat.to(q_nope.dtype), w[:, nope:])
