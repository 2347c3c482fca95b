"""Multi-head latent attention with DSA sparse selection, over the paged cache.

The module: projections, the cache write, the indexer and the choice of attention form per group;
the attention math is the backend's (`Ops`; references in ops/attention.py: `mla_expanded` for
prefill, `mla_absorbed` for decode, the sparse forms for the scaled path).
The cache row per token is [kv_a_layernorm(latent) | roped k_rot].
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from dist_glm5.model import dsa
from dist_glm5.model.config import ModelConfig
from dist_glm5.model.dsa import DSAConfig
from dist_glm5.model.indexer import Indexer
from dist_glm5.model.kv_cache import SMALL_CHUNK, ForwardBatch, PagedKVCache
from dist_glm5.model.linear import Linear
from dist_glm5.model.norm import RMSNorm
from dist_glm5.ops import Ops, reference_ops
from dist_glm5.ops.mla_project import IndexerWeights, ProjectWeights
from dist_glm5.quant import index_q8


class Indexed(NamedTuple):
    """A full layer's indexer output for one forward (shared layers have none)."""

    q: torch.Tensor  # [T, hi, d] index queries
    w: torch.Tensor  # [T, hi] head weights
    store: torch.Tensor  # [slots, d] this layer's index keys (the cache's)


class Selected(NamedTuple):
    """One sequence's rows' keys on the sparse path: the keep mask [n, L] and, when the selection
    listed them (dsa.select_fused), their slots and valid [n, k], which a 'shared' layer after
    it reuses instead of listing the mask again (a top-k over [n, L] bytes per layer). keep is
    None when the slots were listed and nothing attends by a mask (decode; "rows" prefill)."""

    keep: torch.Tensor | None
    slots: torch.Tensor | None = None
    valid: torch.Tensor | None = None


class AttnIn(NamedTuple):
    """What both attention forms read, for one forward of one layer."""

    q_nope: torch.Tensor  # [T, h, nope]
    q_rot: torch.Tensor  # [T, h, rope], roped
    kv_store: torch.Tensor  # [slots, kv_lora + rope] this layer's cache rows
    index: Indexed | None  # None on a 'shared' layer, which reuses prev_keep
    prev_keep: list | None  # the previous full layer's selection per group (sparse: Selected)


class MLA(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, ops: Ops | None = None, dsa: DSAConfig | None = None
    ):
        """dsa: how attention runs, fixed at build time: the dense masked reference (the oracle)
        or the scaled sparse path (dsa.py), with its caps."""
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
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, cfg.attention_bias, self.ops)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, self.ops)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, False, self.ops)
        self.kv_a_proj_with_mqa = Linear(
            cfg.hidden_size, cfg.kv_cache_dim, cfg.attention_bias, self.ops
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, self.ops)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), False, self.ops
        )
        self.o_proj = Linear(
            self.n_heads * self.v_dim, cfg.hidden_size, cfg.attention_bias, self.ops
        )
        self.indexer = Indexer(cfg, self.ops) if cfg.has_indexer(layer) else None
        self.dsa = dsa or DSAConfig()
        # the attention form, chosen once here from the config (never per forward)
        self.attend = self._sparse if self.dsa.sparse else self._dense
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
        if self.indexer is None and prev_keep is None:
            raise ValueError(
                f"layer {self.layer} is a 'shared' DSA layer but no previous full layer's "
                "selection was passed"
            )
        kv_store = cache.kv[self.layer]
        idx_store = cache.index_k[self.layer] if self.indexer is not None else None
        fused = self.ops.mla_project
        got = None
        if fused is not None:
            got = fused(x, self.project_weights(), cos, sin, batch.write_slots, kv_store, idx_store)
        if got is None:
            got = self._project(x, batch.write_slots, cos, sin, kv_store, idx_store)
        q, q_rot, iq, iw = got
        q_nope = q[..., : self.nope]
        index = Indexed(iq, iw, idx_store) if self.indexer is not None else None
        out, keeps = self.attend(AttnIn(q_nope, q_rot, kv_store, index, prev_keep), batch)
        return self.o_proj(out.reshape(T, h * self.v_dim)), keeps

    def _project(self, x, slots, cos, sin, kv_store, idx_store):
        """The projections composed from the ops (the reference of `Ops.mla_project`): x [T, H]
        -> (q [T, h, nope + rope] unroped, q_rot [T, h, rope], iq, iw), the cache rows written."""
        T = x.shape[0]
        h = self.q_b_proj.out_features // (self.nope + self.rope)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(T, h, self.nope + self.rope)
        q_rot = self.ops.apply_rope(q[..., self.nope :], cos, sin, self.interleave)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[:, : self.kv_lora])
        k_rot = self.ops.apply_rope(ckv[:, None, self.kv_lora :], cos, sin, self.interleave)[:, 0]
        kv_store[slots] = torch.cat([latent, k_rot], dim=-1).to(kv_store.dtype)
        if self.indexer is None:
            return q, q_rot, None, None
        iq, ik, iw = self.indexer(x, q_resid, cos, sin)
        index_q8.write(idx_store, slots, ik)
        return q, q_rot, iq, iw

    def project_weights(self) -> ProjectWeights:
        """This layer's weights as `Ops.mla_project` takes them (read at each call: tensor
        parallelism replaces the projections after construction)."""
        ix = self.indexer
        iw = None
        if ix is not None:
            iw = IndexerWeights(
                ix.n_heads,
                ix.head_dim,
                ix.interleave,
                ix.wq_b.weight,
                ix.wk.weight,
                ix.k_norm.weight,
                ix.k_norm.bias,
                ix.k_norm.eps,
                ix.weights_proj.weight,
            )
        return ProjectWeights(
            self.q_b_proj.out_features // (self.nope + self.rope),
            self.nope,
            self.rope,
            self.kv_lora,
            self.interleave,
            self.q_a_proj.weight,
            self.q_a_proj.bias,
            self.q_a_layernorm.weight,
            self.q_a_layernorm.eps,
            self.q_b_proj.weight,
            self.kv_a_proj_with_mqa.weight,
            self.kv_a_proj_with_mqa.bias,
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
            iw,
        )

    def _dense(self, a: AttnIn, batch: ForwardBatch) -> tuple[torch.Tensor, list]:
        """The reference: every group over all its keys, the selection applied as a mask.
        Returns out [T, h, v] and the keep-mask per group [B, n, L]."""
        T, h = a.q_nope.shape[:2]
        out = torch.empty(T, h, self.v_dim, dtype=a.q_nope.dtype, device=a.q_nope.device)
        keeps = []
        for gi, g in enumerate(batch.groups):
            rows = a.kv_store[g.slots].to(a.q_nope.dtype)  # [B, L, c + r]
            if a.index is not None:
                ix = a.index
                keep = self.select_dense(ix.q[g.tok], ix.w[g.tok], ix.store[g.slots], g.q_pos)
            else:
                keep = a.prev_keep[gi]
            keeps.append(keep)
            # decode-sized groups attend over the compressed latent; prefill expands it per head
            small = g.tok.shape[1] <= SMALL_CHUNK
            attn = self.ops.mla_absorbed if small else self.ops.mla_expanded
            o = attn(
                a.q_nope[g.tok],
                a.q_rot[g.tok],
                rows[..., : self.kv_lora],
                rows[..., self.kv_lora :],
                self.kv_b_proj.weight,
                keep,
                self.scale,
                self.nope,
            )
            # the valid rows by their indices (made on the host), not by a boolean mask
            out[g.tok.view(-1)[g.real]] = o.flatten(0, 1)[g.real]
        return out, keeps

    def select_dense(self, iq, iw, keys, q_pos):
        # iq [B, n, hi, d], iw [B, n, hi], keys [B, L, d], q_pos [B, n] -> keep [B, n, L] bool
        scores = self.ops.index_scores(iq, iw, keys, self.indexer.head_dim)
        return self.ops.select_topk(scores, q_pos, self.topk)

    def select_sparse(self, iq, iw, idx_store, keys, q_pos):
        # one sequence's rows: iq [n, hi, d], iw [n, hi], its L keys (KeySlots) -> keep [n, L] bool
        hd = self.indexer.head_dim
        return dsa.select(
            iq, iw, idx_store, keys, q_pos, self.topk, hd, self.dsa, self.ops, self.row_split
        )

    def _fused_select(self, n: int) -> bool:
        """A full layer's rows select and list their keys in one scan of the index keys, when
        the backend has that op and the rows are not split over ranks."""
        return (
            self.indexer is not None
            and self.row_split is None
            and self.ops.select_rows is not None
            and n > 0
        )

    def _batched(self, a: AttnIn, gi: int) -> bool:
        """Whether decode group gi selects for all its sequences in one call: a full layer whose
        backend has select_many (rows not split over ranks), or a shared layer after one (its
        selection is then one Selected for the group, not one per sequence)."""
        if a.index is None:
            return isinstance(a.prev_keep[gi], Selected)
        return self.row_split is None and self.ops.select_many is not None

    def _decode_group(self, a: AttnIn, g, gi: int, out: torch.Tensor) -> Selected:
        """A decode group at once: one selection call for every sequence's rows (or the previous
        full layer's), one attention call (W_uk, the gathered keys, W_uv). Fills out's rows."""
        r = g.rows_keys  # built once per forward
        if a.index is not None:
            ix = a.index
            slots, valid = self.ops.select_many(
                ix.q[r.tok], ix.w[r.tok], ix.store, r, self.topk, self.indexer.head_dim
            )
            chosen = Selected(None, slots, valid)
        else:
            chosen = a.prev_keep[gi]
        out[r.tok] = self._attend_decode(a, r.tok, chosen.slots, chosen.valid)
        return chosen

    def _attend_decode(self, a: AttnIn, toks, slots, valid) -> torch.Tensor:
        """Decode rows toks over their selected cache rows in one call: W_uk, the gathered
        attention, W_uv -> [n, h, v]."""
        return self.ops.absorbed_gathered(
            a.q_nope[toks],
            a.q_rot[toks],
            self.kv_b_proj.weight,
            a.kv_store,
            slots,
            valid,
            self.nope,
            self.scale,
            self.dsa.gather_cap_bytes,
        )

    def _sparse(self, a: AttnIn, batch: ForwardBatch) -> tuple[torch.Tensor, list]:
        """The scaled path (dsa.py): per-row top-k, capped gathers; decode gathers exactly each
        row's keys, prefill attends per row or per window (DSAConfig.prefill_attention).
        Returns out [T, h, v] and the selections per group, per sequence (Selected)."""
        T, h = a.q_nope.shape[:2]
        c, ix = self.kv_lora, a.index
        w = self.kv_b_proj.weight.view(h, -1, c)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        out = torch.empty(T, h, self.v_dim, dtype=a.q_nope.dtype, device=a.q_nope.device)
        keeps = []
        for gi, g in enumerate(batch.groups):
            small = g.tok.shape[1] <= SMALL_CHUNK
            if small and self._batched(a, gi):
                keeps.append(self._decode_group(a, g, gi, out))
                continue
            # prefill "rows" attends as decode does, one call for the group's rows: the math of
            # dsa.sparse_prefill's rows form (W_uk, each row's own keys, W_uv), the backend's
            # decode kernel instead of a [rows, top-k] gather of the cache per row
            rows = small or self.dsa.prefill_attention == "rows"
            gkeep, dec_slots, dec_ok, toks_all = [], [], [], []
            for bi in range(g.tok.shape[0]):
                # the real rows are a prefix of the padded ones: a slice, not a boolean mask
                n_real = batch.chunks[g.chunk_ids[bi]].length
                toks, qpos = g.tok[bi, :n_real], g.q_pos[bi, :n_real]
                keys = g.keys[bi]  # positions 0..end-1 of this chunk's sequence
                if self._fused_select(toks.numel()):  # one scan: selection and slots at once
                    chosen = Selected(
                        *dsa.select_fused(
                            ix.q[toks],
                            ix.w[toks],
                            ix.store,
                            keys,
                            qpos,
                            self.topk,
                            self.indexer.head_dim,
                            self.dsa,
                            self.ops,
                            mask=not small and self.dsa.prefill_attention != "rows",
                        )
                    )
                elif ix is not None:
                    chosen = Selected(
                        self.select_sparse(ix.q[toks], ix.w[toks], ix.store, keys, qpos)
                    )
                else:
                    chosen = a.prev_keep[gi][bi]
                keep = chosen.keep
                listed = (chosen.slots, chosen.valid) if chosen.slots is not None else None
                gkeep.append(chosen)
                if rows:  # decode, or prefill by rows: exactly each row's selected keys
                    s_, ok = listed or dsa.selected_slots(keep, keys, self.topk)
                    pad = self.topk - s_.shape[1]
                    if pad:
                        s_ = torch.nn.functional.pad(s_, (0, pad), value=keys.first)
                        ok = torch.nn.functional.pad(ok, (0, pad), value=False)
                    dec_slots.append(s_)
                    dec_ok.append(ok)
                    toks_all.append(toks)
                else:
                    q_lat = self.ops.einsum("nhd,hdc->nhc", a.q_nope[toks], w_uk)
                    o_lat = dsa.sparse_prefill(
                        q_lat,
                        a.q_rot[toks],
                        a.kv_store,
                        keys,
                        keep,
                        c,
                        self.scale,
                        self.dsa,
                        self.ops,
                        self.topk,
                    )
                    out[toks] = self.ops.einsum("nhc,hvc->nhv", o_lat.to(out.dtype), w_uv)
            if rows:  # every such row of the group in one call: W_uk, attention, W_uv
                one = len(toks_all) == 1
                toks = toks_all[0] if one else torch.cat(toks_all)
                out[toks] = self._attend_decode(
                    a,
                    toks,
                    dec_slots[0] if one else torch.cat(dec_slots),
                    dec_ok[0] if one else torch.cat(dec_ok),
                )
            keeps.append(gkeep)
        return out, keeps
