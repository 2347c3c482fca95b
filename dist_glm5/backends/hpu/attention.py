"""MLA attention for Gaudi, each function with its CPU reference's signature and result.

- `mla_expanded` (prefill; ops/attention): FusedSDPA over per-head keys [k_nope | k_rot] and values,
  the selection as an ADDITIVE bias [B, 1, n, L] in q's dtype (-inf where not kept; bool masks are
  unconfirmed on the bridge), is_causal False (the keep-mask already is causal), dropout 0.
  Softmax mode "None" (accurate) by default, "fp32" by choice (DIST_GLM5_HPU_SOFTMAX); "fast" is
  refused: it measured worst-row cosine 0.086 at layer 38 at long context (design.md section 3),
  and vllm-gaudi would pick it for GLM-5 (its VLLM_FP32_SOFTMAX is not read here).
- `mla_absorbed` (decode; ops/attention): batched matmuls over the compressed latent (MME),
  softmax in fp32.
- `attend_gathered` (sparse decode; ops/attention): each row's <= topk selected cache rows by one
  int32 index_select per capped chunk of rows.
- `attend_absorbed_chunked` (sparse prefill; ops/attention): online softmax over key chunks of ONE
  fixed length (the key list is padded to a whole number of chunks with masked keys), so every
  chunk is the same graph; each chunk's gather stays under the cap.
Every row keeps at least one key (a query keeps itself; padded rows repeat a real query), so no row
computes 0/0.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from dist_glm5.ops.gather import attn_key_bytes, capped_chunks, decode_row_bytes

from . import _hf

SOFTMAX_ENV = "DIST_GLM5_HPU_SOFTMAX"
SOFTMAX_MODES = ("None", "fp32")


def softmax_mode(environ=None) -> str:
    """The FusedSDPA softmax mode: DIST_GLM5_HPU_SOFTMAX in {"None", "fp32"}, default "None".

    What each mode changes in the kernel is not public (gaudi.md section 2): only that "fast"
    keeps the inverse row sum in bf16 for bf16 inputs (the bridge's fp8 meta). So the recording
    fake can check which mode is passed, not that "fp32" is more accurate than "None"."""
    mode = (os.environ if environ is None else environ).get(SOFTMAX_ENV, "None")
    if mode not in SOFTMAX_MODES:
        raise ValueError(
            f"{SOFTMAX_ENV}={mode!r}: use 'None' (accurate, default) or 'fp32'. 'fast' is refused: "
            "it measured worst-row cosine 0.086 at layer 38 at long context"
        )
    return mode


def keep_bias(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """keep [B, n, L] bool -> additive bias [B, 1, n, L]: 0 where kept, -inf elsewhere."""
    z = torch.zeros(keep.shape[0], 1, *keep.shape[1:], dtype=dtype, device=keep.device)
    return z.masked_fill_(~keep[:, None], float("-inf"))


def mla_expanded(
    q_nope: Tensor,
    q_rot: Tensor,
    latent: Tensor,
    k_rot: Tensor,
    w_kv_b: Tensor,
    keep: Tensor,
    scale: float,
    nope: int,
    mode: str | None = None,
) -> Tensor:
    # q_nope [B, n, h, nope], q_rot [B, n, h, r], latent [B, L, c], k_rot [B, L, r],
    # w_kv_b [h*(nope+v), c], keep [B, n, L] -> [B, n, h, v]
    mode = softmax_mode() if mode is None else mode
    if mode not in SOFTMAX_MODES:
        raise ValueError(f"FusedSDPA softmax mode {mode!r}: use one of {SOFTMAX_MODES}")
    B, n, h, _ = q_nope.shape
    L, r = latent.shape[1], k_rot.shape[-1]
    kv = F.linear(latent, w_kv_b).view(B, L, h, -1)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    q = torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2)  # [B, h, n, nope + r]
    k = torch.cat([k_nope, k_rot[:, :, None].expand(B, L, h, r)], dim=-1).transpose(1, 2)
    bias = keep_bias(keep, q.dtype)
    # positional, bridge 1.19 order: (q, k, v, attn_mask, dropout_p, is_causal, scale,
    # softmax_mode, recompute_mode, valid_seq_len, seq_padding_type)
    o = _hf.fused_sdpa().apply(
        q, k, v.transpose(1, 2), bias, 0.0, False, scale, mode, None, None, "left"
    )
    return o.transpose(1, 2)  # [B, n, h, v]


def mla_absorbed(
    q_nope: Tensor,
    q_rot: Tensor,
    latent: Tensor,
    k_rot: Tensor,
    w_kv_b: Tensor,
    keep: Tensor,
    scale: float,
    nope: int,
) -> Tensor:
    # same signature and result as mla_expanded
    B, n, h, _ = q_nope.shape
    c = latent.shape[-1]
    w = w_kv_b.view(h, -1, c)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [h, nope, c], [h, v, c]
    q_lat = torch.matmul(q_nope.transpose(1, 2), w_uk[None])  # [B, h, n, c]
    s = torch.matmul(q_lat, latent[:, None].transpose(-1, -2)) + torch.matmul(
        q_rot.transpose(1, 2), k_rot[:, None].transpose(-1, -2)
    )  # [B, h, n, L]
    s = (s * scale).masked_fill(~keep[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(latent.dtype)
    o_lat = torch.matmul(p, latent[:, None])  # [B, h, n, c]
    return torch.matmul(o_lat, w_uv.transpose(-1, -2)[None]).transpose(1, 2)  # [B, n, h, v]


def _rows(store: Tensor, slots: Tensor) -> Tensor:
    # one gather: int32 slot ids (slots < 2^31 by the cache's construction)
    flat = store.index_select(0, slots.reshape(-1).to(torch.int32))
    return flat.view(*slots.shape, store.shape[1])


def attend_gathered(
    q_lat: Tensor,
    q_rot: Tensor,
    kv_store: Tensor,
    sel_slots: Tensor,
    sel_valid: Tensor,
    kv_lora: int,
    scale: float,
    cap: int,
) -> Tensor:
    """q_lat [n, h, c], q_rot [n, h, r], sel_slots/sel_valid [n, k] -> latent out [n, h, c] fp32."""
    n, k = sel_slots.shape
    h = q_lat.shape[1]
    row = decode_row_bytes(k, h, kv_store.shape[1], kv_store.element_size())
    outs = []
    for a, b in capped_chunks(n, row, cap):
        rows = _rows(kv_store, sel_slots[a:b]).float()  # [m, k, c + r]
        lat, kr = rows[..., :kv_lora], rows[..., kv_lora:]
        s = torch.matmul(q_lat[a:b].float(), lat.transpose(-1, -2)) + torch.matmul(
            q_rot[a:b].float(), kr.transpose(-1, -2)
        )  # [m, h, k]
        s = (s * scale).masked_fill(~sel_valid[a:b, None, :], float("-inf"))
        outs.append(torch.matmul(torch.softmax(s, -1), lat))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def key_chunk(n: int, h: int, width: int, itemsize: int, cap: int) -> int:
    """The one key-chunk length for n queries x h heads under the cap."""
    row = attn_key_bytes(n, h, width, itemsize)
    capped_chunks(1, row, cap)  # raises when one key is already over the cap
    return max(1, cap // row)


def attend_absorbed_chunked(
    q_lat: Tensor,
    q_rot: Tensor,
    kv_store: Tensor,
    keys,
    mask: Tensor,
    kv_lora: int,
    scale: float,
    cap: int,
) -> Tensor:
    """q_lat [n, h, c], q_rot [n, h, r]; keys: K candidate slots [K] (or a KeySlots of the whole
    sequence); mask [n, K] bool, >= 1 True per row -> latent out [n, h, c] fp32."""
    if not isinstance(keys, Tensor):
        keys = keys.range(0, len(keys))
    n, h, c = q_lat.shape
    K = keys.shape[0]
    per = min(K, key_chunk(n, h, kv_store.shape[1], kv_store.element_size(), cap))
    pad = (-K) % per
    if pad:  # pad keys repeat the first slot and are masked: every chunk has one shape
        keys = torch.cat([keys, keys[:1].expand(pad)])
        mask = F.pad(mask, (0, pad), value=False)
    m = torch.full((n, h), float("-inf"), device=q_lat.device)
    den = torch.zeros(n, h, device=q_lat.device)
    acc = torch.zeros(n, h, c, device=q_lat.device)
    ql, qr = q_lat.float(), q_rot.float()
    for a in range(0, K + pad, per):
        rows = _rows(kv_store, keys[a : a + per]).float()  # [per, c + r]
        lat, kr = rows[:, :kv_lora], rows[:, kv_lora:]
        s = (torch.matmul(ql, lat.T) + torch.matmul(qr, kr.T)) * scale  # [n, h, per]
        s = s.masked_fill(~mask[:, None, a : a + per], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # nothing yet
        corr = torch.exp(m - safe)
        p = torch.exp(s - safe[..., None])
        den = den * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.matmul(p, lat)
        m = m_new
    return acc / den[..., None]
