"""Multi-head latent attention with DSA sparse selection, over the paged cache.

The module: projections, the cache write, the indexer and the choice of attention form per group;
the attention math is the backend's (`Ops`; references in ops/attention.py: `mla_expanded` for
prefill, `mla_absorbed` for decode, the sparse forms for the scaled path).
The cache row per token is [kv_a_layernorm(latent) | roped k_rot].
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dist_glm5.model import dsa
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa import DSAConfig
from dist_glm5.model.indexer import Indexer
from dist_glm5.model.kv_cache import SMALL_CHUNK, ForwardBatch, PagedKVCache
from dist_glm5.model.norm import RMSNorm
from dist_glm5.ops import Ops, reference_ops


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops | None = None):
        super().__init__()
        self.layer = layer
        # the backend's hot ops (selection, index scores, attention forms, norm, rope)
        self.ops = ops or reference_ops()
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_lora = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.interleave = cfg.rope_interleave
        self.topk = cfg.index_topk
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, self.ops)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            cfg.hidden_size, cfg.kv_cache_dim, bias=cfg.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, self.ops)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.indexer = Indexer(cfg, self.ops) if cfg.has_indexer(layer) else None
        self.dsa = (
            DSAConfig()
        )  # set by Glm5Model.set_dsa; "reference" masks densely, "sparse" gathers
        # (rank, ranks, exchange): indexer rows split over a stage's ranks (set by stages/tp.py)
        self.row_split: tuple[int, int, Callable] | None = None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prev_keep: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x: [T, H] -> out [T, H], and the key selection per attention group [B, n, L] for shared
        layers."""
        T = x.shape[0]
        h = self.q_b_proj.out_features // (self.nope + self.rope)  # local heads (fewer under TP)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(T, h, self.nope + self.rope)
        q_nope, q_rot = (
            q[..., : self.nope],
            self.ops.apply_rope(q[..., self.nope :], cos, sin, self.interleave),
        )
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[:, : self.kv_lora])
        k_rot = self.ops.apply_rope(ckv[:, None, self.kv_lora :], cos, sin, self.interleave)[:, 0]
        kv_store = cache.kv[self.layer]
        kv_store[batch.write_slots] = torch.cat([latent, k_rot], dim=-1).to(kv_store.dtype)

        if self.indexer is not None:
            iq, ik, iw = self.indexer(x, q_resid, cos, sin)
            idx_store = cache.index_k[self.layer]
            idx_store[batch.write_slots] = ik.to(idx_store.dtype)
        elif prev_keep is None:
            raise ValueError(
                f"layer {self.layer} is a 'shared' DSA layer but no previous full layer's "
                "selection was passed"
            )

        if self.dsa.mode == "sparse":
            return self._sparse(
                x,
                batch,
                q_nope,
                q_rot,
                kv_store,
                iq if self.indexer else None,
                iw if self.indexer else None,
                idx_store if self.indexer else None,
                prev_keep,
                h,
            )
        out = torch.empty(T, h, self.v_dim, dtype=x.dtype, device=x.device)
        keeps = []
        for gi, g in enumerate(batch.groups):
            rows = kv_store[g.slots].to(x.dtype)  # [B, L, c + r]
            if self.indexer is not None:
                keep = self.select_dense(iq[g.tok], iw[g.tok], idx_store[g.slots], g.q_pos)
            else:
                keep = prev_keep[gi]
            keeps.append(keep)
            # decode-sized groups attend over the compressed latent; prefill expands it per head
            small = g.tok.shape[1] <= SMALL_CHUNK
            attn = self.ops.mla_absorbed if small else self.ops.mla_expanded
            o = attn(
                q_nope[g.tok],
                q_rot[g.tok],
                rows[..., : self.kv_lora],
                rows[..., self.kv_lora :],
                self.kv_b_proj.weight,
                keep,
                self.scale,
                self.nope,
            )
            # the valid rows by their indices (made on the host), not by a boolean mask
            out[g.tok.view(-1)[g.real]] = o.flatten(0, 1)[g.real]
        return self.o_proj(out.reshape(T, h * self.v_dim)), keeps

    def select_dense(self, iq, iw, keys, q_pos):
        # iq [B, n, hi, d], iw [B, n, hi], keys [B, L, d], q_pos [B, n] -> keep [B, n, L] bool
        scores = self.ops.index_scores(iq, iw, keys, self.indexer.head_dim)
        return self.ops.select_topk(scores, q_pos, self.topk)

    def select_sparse(self, iq, iw, idx_store, keys, q_pos):
        # one sequence's rows: iq [n, hi, d], iw [n, hi], its L keys (KeySlots) -> keep [n, L] bool
        return dsa.select(
            iq,
            iw,
            idx_store,
            keys,
            q_pos,
            self.topk,
            self.indexer.head_dim,
            self.dsa,
            self.row_split,
            self.ops,
        )

    def _sparse(self, x, batch, q_nope, q_rot, kv_store, iq, iw, idx_store, prev_keep, h):
        """The scaled path (dist_glm5/dsa.py): per-row bisection top-k, capped gathers, union
        windows."""
        T = x.shape[0]
        c = self.kv_lora
        w = self.kv_b_proj.weight.view(h, -1, c)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        out = torch.empty(T, h, self.v_dim, dtype=x.dtype, device=x.device)
        keeps = []
        for gi, g in enumerate(batch.groups):
            small = g.tok.shape[1] <= SMALL_CHUNK
            gkeep, sel, sel_ok, toks_all = [], [], [], []
            for bi in range(g.tok.shape[0]):
                # the real rows are a prefix of the padded ones: a slice, not a boolean mask
                n_real = batch.chunks[g.chunk_ids[bi]].length
                toks, qpos = g.tok[bi, :n_real], g.q_pos[bi, :n_real]
                keys = g.keys[bi]  # positions 0..end-1 of this chunk's sequence
                fused = (
                    small
                    and self.indexer is not None
                    and self.row_split is None
                    and self.ops.select_rows is not None
                    and 0 < toks.numel() <= self.ops.select_rows_max
                )
                if fused:  # decode: one scan of the index keys, selection and slots at once
                    keep, s_, ok = self.ops.select_rows(
                        iq[toks], iw[toks], idx_store, keys, qpos, self.topk, self.indexer.head_dim
                    )
                elif self.indexer is not None:
                    keep = self.select_sparse(iq[toks], iw[toks], idx_store, keys, qpos)
                else:
                    keep = prev_keep[gi][bi]
                gkeep.append(keep)
                q_lat = torch.einsum("nhd,hdc->nhc", q_nope[toks], w_uk)
                if small:  # decode: gather exactly each row's selected keys
                    if not fused:
                        s_, ok = dsa.selected_slots(keep, keys, self.topk)
                    pad = self.topk - s_.shape[1]
                    sel.append(torch.nn.functional.pad(s_, (0, pad), value=keys.first))
                    sel_ok.append(torch.nn.functional.pad(ok, (0, pad), value=False))
                    toks_all.append((toks, q_lat))
                else:
                    o_lat = dsa.sparse_prefill(
                        q_lat,
                        q_rot[toks],
                        kv_store,
                        keys,
                        keep,
                        c,
                        self.scale,
                        self.dsa,
                        self.ops,
                        self.topk,
                    )
                    out[toks] = torch.einsum("nhc,hvc->nhv", o_lat.to(x.dtype), w_uv)
            if small:
                toks = torch.cat([t for t, _ in toks_all])
                q_lat = torch.cat([q for _, q in toks_all])
                o_lat = self.ops.attend_gathered(
                    q_lat,
                    q_rot[toks],
                    kv_store,
                    torch.cat(sel),
                    torch.cat(sel_ok),
                    c,
                    self.scale,
                    self.dsa.gather_cap_bytes,
                )
                out[toks] = torch.einsum("nhc,hvc->nhv", o_lat.to(x.dtype), w_uv)
            keeps.append(gkeep)
        return self.o_proj(out.reshape(T, h * self.v_dim)), keeps
