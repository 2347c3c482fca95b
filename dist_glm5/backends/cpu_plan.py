"""The CPU backend's planned decode step: a model's layers as its C kernels called in sequence,
every argument that does not change between steps prepared once: `plan(model)`, the CPU
backend's `Ops.decode_plan`.

Why: on `bench decode`'s small model (batch 1, one thread) about 40% of a step was Python and torch
dispatch around the kernels (perf: libpython 25%, libtorch 15%): per layer some 30 module calls,
20 kernel wrappers re-checking weights that never change, a projection-weights tuple rebuilt,
and their small allocations. Here a layer is about ten foreign calls and a few torch ops.

The layers' modules stay the reference and run whatever the plan does not take: the same kernels
with the same inputs, so the same bits (tests/test_decode_plan.py). `plan(model)` is None for a
model it cannot run (not bf16, the dense reference attention, a kernel that does not build, an
experts op without a kernel); a built plan returns None for a step it does not take (a prefill
chunk, more than ROWS rows, forward hooks other than the profiler's (whose spans the plan opens
itself), a tensor-parallel reduce, routes being recorded, a cache store of another dtype), and the
modules run that step. One step at a time per model: the plan reuses its argument structs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dist_glm5.kernels import (
    bf16_gemv,
    dsa_select,
    mla_decode,
    mla_project,
    mxfp4_moe,
    mxfp4_w4a8,
    norm_rope,
    router,
)
from dist_glm5.model.kv_cache import SMALL_CHUNK
from dist_glm5.model.mla import Selected

BF16 = torch.bfloat16
# rows a planned step takes at most: the products' (beyond them torch's GEMMs pay); past the
# router kernel's ROWS the module's router runs (its torch reference, as in the modules' step)
ROWS = min(bf16_gemv.ROWS, mla_project.ROWS)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _is(fn, kernel) -> bool:
    """Whether an op is `kernel` (bare or a functools.partial of it)."""
    return fn is kernel or (isinstance(fn, functools.partial) and fn.func is kernel)


def _bf16(*ts) -> bool:
    return all(t is None or (t.dtype == BF16 and t.is_contiguous()) for t in ts)


class _Linear:
    """A bias-optional bf16 product y = x W^T (+ b) of a decode step's rows (bf16_gemv.linear)."""

    def __init__(self, lin):
        self.w, self.b = lin.weight, lin.bias
        self.n, self.k = self.w.shape
        self.pw, self.pb = self.w.data_ptr(), _ptr(self.b)

    def __call__(self, lib, x: torch.Tensor, T: int, nt: int) -> torch.Tensor:
        y = torch.empty(T, self.n, dtype=BF16)
        if lib.bf16_gemv(x.data_ptr(), T, self.k, self.pw, self.n, self.pb, y.data_ptr(), nt):
            raise MemoryError("bf16_gemv: no memory for the fp32 copy of x")
        return y


class _MLP:
    """down(silu(gate(x)) * up(x)), as model/moe.MLP computes it."""

    def __init__(self, mlp):
        self.gate, self.up = _Linear(mlp.gate_proj), _Linear(mlp.up_proj)
        self.down = _Linear(mlp.down_proj)

    def __call__(self, lib, x, T, nt):
        act = F.silu(self.gate(lib, x, T, nt)) * self.up(lib, x, T, nt)
        return self.down(lib, act, T, nt)


def _hook_dicts(module: torch.nn.Module) -> list[dict]:
    """The forward (pre-)hook dicts of module and its children: non-empty when something outside
    watches or changes its work (read when the plan runs: hooks come and go)."""
    return [d for s in module.modules() for d in (s._forward_hooks, s._forward_pre_hooks)]


class _Layer:
    """One decoder layer's prepared arguments."""

    def __init__(self, layer):
        att, mlp = layer.self_attn, layer.mlp
        self.module, self.i = layer, att.layer
        # the hook dicts of its modules (registering a hook fills them in place): any filled one
        # makes the modules run the step; kept as a list, checked per step in microseconds
        self.hooks = _hook_dicts(layer)
        # every tensor whose address is kept is kept too (a replaced weight stays alive: the
        # model drops its plan when its weights move, Glm5Model._apply)
        self.keep = [p for p in layer.parameters()] + [b for b in layer.buffers()]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self.norms = [(n.weight.data_ptr(), float(n.eps)) for n in norms]
        # attention
        w = att.project_weights()
        self.proj_w = w
        self.proj = mla_project.prepare(w)
        self.heads, self.nope, self.rope, self.v = w.heads, att.nope, att.rope, att.v_dim
        self.c, self.scale, self.topk = att.kv_lora, float(att.scale), att.topk
        self.indexed = att.indexer is not None
        self.i_dim = att.indexer.head_dim if self.indexed else 0
        self.kv_b = att.kv_b_proj.weight
        self.o = _Linear(att.o_proj)
        # the MLP: a dense one, or the router + routed experts + shared expert
        self.moe = hasattr(mlp, "gate")
        if not self.moe:
            self.mlp = _MLP(mlp)
            return
        g, cfg = mlp.gate, mlp.gate.cfg
        self.route = (g.weight.data_ptr(), g.e_score_correction_bias.data_ptr(), g.weight.shape[0])
        self.route_cfg = (cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                          int(cfg.norm_topk_prob), float(cfg.routed_scaling_factor))  # fmt: skip
        ex = mlp.experts
        self.lo, self.n_local = ex.first_expert, ex.num_local
        self.mx = hasattr(ex, "w13_weight_scale")
        if self.mx:
            self.ex = [t.data_ptr() for t in (ex.w13_weight, ex.w13_weight_scale, ex.w2_weight,
                                              ex.w2_weight_scale)]  # fmt: skip
            self.inter = ex.w13_weight.shape[1] // 2
        else:
            self.ex = [ex.w13_weight.data_ptr(), ex.w2_weight.data_ptr()]
            self.inter = ex.w2_weight.shape[2]
        self.shared = _MLP(mlp.shared_experts) if mlp.shared_experts is not None else None

    def hooked(self, profiled: bool) -> bool:
        """Whether something outside watches or changes this layer's work (then the modules run
        the step): a tensor-parallel reduce, a route recorder, forward hooks other than the
        profiler's (the plan opens the profiler's spans itself)."""
        m = self.module
        if m.attn_reduce is not None or m.mlp_reduce is not None:
            return True
        if self.moe and m.mlp.recorder is not None:
            return True
        return not profiled and any(self.hooks)


def _weights_ok(layer) -> bool:
    """The static half of what the kernels take: bf16 contiguous weights everywhere."""
    att, mlp = layer.self_attn, layer.mlp
    lins = [att.o_proj]
    if hasattr(mlp, "gate"):
        if mlp.shared_experts is not None:
            s = mlp.shared_experts
            lins += [s.gate_proj, s.up_proj, s.down_proj]
        ex = mlp.experts
        if hasattr(ex, "w13_weight_scale"):
            ok_ex = all(t.dtype == torch.uint8 and t.is_contiguous() for t in ex.buffers())
        else:
            ok_ex = _bf16(ex.w13_weight, ex.w2_weight)
        g = mlp.gate
        ok_route = all(t.dtype == torch.float32 and t.is_contiguous()
                       for t in (g.weight, g.e_score_correction_bias))  # fmt: skip
        if not (ok_ex and ok_route):
            return False
    else:
        lins += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return _bf16(
        att.kv_b_proj.weight, *norms, *(x for lin in lins for x in (lin.weight, lin.bias))
    ) and mla_project.weights_ok(att.project_weights())


def plan(model):
    """A DecodePlan of `model` (a Glm5Model), or None when its kernels cannot run it."""
    ops = model.ops
    libs = [k._kernel.get() for k in (bf16_gemv, dsa_select, mla_decode, mla_project, norm_rope,
                                       router)]  # fmt: skip
    if any(lib is None for lib in libs) or not model.dsa.sparse:
        return None
    # DIST_GLM5_EXPERTS=w4a8 (ops/experts.py): the opt-in int8-activation kernel, as the modules
    # call it; decided here once for every layer and the draft layer
    w4 = _is(ops.experts.mxfp4, mxfp4_w4a8.moe_mxfp4_w4a8)
    # the kernels the modules' step calls, so that both give the same bits
    if not (
        _is(ops.linear, bf16_gemv.linear)
        and _is(ops.rms_norm, norm_rope.rms_norm)
        and _is(ops.select_many, dsa_select.select_many)
        and _is(ops.absorbed_gathered, mla_decode.absorbed_gathered)
        and _is(ops.mla_project, mla_project.project)
        and _is(ops.route, router.route)
    ):
        return None
    layers = [model.model.layers[str(i)] for i in model.layer_range]
    if any(lay.self_attn.row_split is not None or not _weights_ok(lay) for lay in layers):
        return None
    mtp = None
    if model.has_mtp:  # the draft layer, when its kernels take it too (a full DSA layer)
        d = model.mtp_layer(0)
        if (
            d.self_attn.indexer is not None
            and _weights_ok(d)
            and _bf16(d.enorm.weight, d.hnorm.weight, d.eh_proj.weight, d.shared_head.norm.weight)
        ):
            mtp = d
    any_mx = False
    for lay in layers + ([mtp] if mtp is not None else []):
        if hasattr(lay.mlp, "gate"):
            ex = lay.mlp.experts
            mx = hasattr(ex, "w13_weight_scale")
            any_mx |= mx
            if mx and w4:
                continue
            op = ops.experts.mxfp4 if mx else ops.experts.dense
            if not _is(op, mxfp4_moe.moe_mxfp4 if mx else bf16_gemv.experts):
                return None  # the reference: the modules' step
    mx_lib = mxfp4_moe._kernel.get()
    w4_lib = mxfp4_w4a8._kernel.get() if w4 else None
    if any_mx and (w4_lib is None if w4 else mx_lib is None):
        return None
    gemv, sel, dec, _, norm, route = libs
    return DecodePlan(model, layers, mtp, _Kernels(gemv, sel, dec, norm, route, mx_lib, w4_lib))


class _Kernels(NamedTuple):
    """The loaded C libraries a plan calls (plan() checked that each one it needs built)."""

    gemv: object
    sel: object
    dec: object
    norm: object
    route: object
    mx: object  # the exact MXFP4 experts kernel (None where w4a8 runs instead and it did not build)
    w4: object  # the w4a8 experts kernel, or None when not chosen


class _NoSpans:
    def begin(self, name: str) -> None:
        pass

    def end(self) -> None:
        pass


class DecodePlan:
    def __init__(self, model, layers, mtp, k: _Kernels):
        self.model = model
        self.layers = [_Layer(lay) for lay in layers]
        self.mtp_layer = _Layer(mtp) if mtp is not None else None
        if mtp is not None:  # the draft's input norms and projection, its output norm
            norms = (mtp.enorm, mtp.hnorm, mtp.shared_head.norm)
            self.mtp_norms = [(n.weight.data_ptr(), float(n.eps)) for n in norms]
            self.eh_proj = _Linear(mtp.eh_proj)
            self.mtp_embed = (mtp.embed_tokens or model.model.embed_tokens).weight
        # the output heads (the last stage's): the module's product is this kernel too (plan()
        # checked ops.linear), without the module call and the wrapper's checks per step
        self.heads = {}
        for lin in (model.lm_head, mtp.shared_head.head if mtp is not None else None):
            if lin is not None and lin.bias is None and _bf16(lin.weight):
                self.heads[id(lin)] = (_Linear(lin), _hook_dicts(lin))
        self.gemv, self.dec, self.norm, self.route = k.gemv, k.dec, k.norm, k.route
        self.mx, self.w4 = k.mx, k.w4  # w4: the w4a8 experts kernel when chosen, else None
        # the rows a step may have for mla_decode's scratch to stay under the gather cap (one
        # call per layer here; the modules' wrapper splits a larger step's rows)
        row = max(
            k.dec.mla_decode_row_bytes(L.heads, L.c, L.rope, L.topk, 1)
            for L in self.layers + ([self.mtp_layer] if self.mtp_layer is not None else [])
        )
        self.max_rows = min(ROWS, model.dsa.gather_cap_bytes // row)

    def head(self, lin, h: torch.Tensor) -> torch.Tensor | None:
        """lin(h) as fp32 logits (h [T, H] normed bf16 rows), or None when not taken (the
        module runs: another head, more than ROWS rows, a hook on it)."""
        got = self.heads.get(id(lin))  # the model holds its heads: an id is not reused
        T = h.shape[0]
        if got is None or h.dtype != BF16 or not 0 < T <= ROWS or any(got[1]):
            return None
        return got[0](self.gemv, h.contiguous(), T, torch.get_num_threads()).float()

    def takes(self, x: torch.Tensor, batch, cache, keep, layers) -> bool:
        T = batch.num_tokens
        profiled = getattr(self.model, "profiler", None) is not None
        if not 0 < T <= self.max_rows or len(batch.groups) != 1:
            return False
        g = batch.groups[0]
        if g.tok.shape[1] > SMALL_CHUNK or g.tok.numel() != T:  # decode rows, no padding
            return False
        if x.dtype not in (torch.int64, torch.int32, BF16):
            return False
        if layers[0].indexed is False and not (keep and isinstance(keep[0], Selected)):
            return False  # a shared first layer needs the previous stage's listed selection
        for L in layers:
            kv = cache.kv[L.i]
            if kv.dtype != BF16:  # mla_decode's (q's dtype); the rest is step_ok's
                return False
            if L.hooked(profiled):
                return False
        return True

    def __call__(self, x: torch.Tensor, batch, cache, keep=None):
        """The step, or None when not taken (the caller runs the modules): x token ids [T] or
        hidden [T, H] bf16 -> (hidden [T, H], the last selection per group), as the model's
        forward returns them."""
        if not self.takes(x, batch, cache, keep, self.layers):
            return None
        model = self.model
        if x.dtype in (torch.int64, torch.int32):
            x = model.embed(x.long())
        return self._layers(self.layers, x.contiguous(), batch, cache, keep)

    def mtp(self, next_ids: torch.Tensor, h_normed: torch.Tensor, batch, cache):
        """The MTP layer's step (Glm5Model.mtp_forward's contract), or None when not taken."""
        L = self.mtp_layer
        if L is None or h_normed.dtype != BF16:
            return None
        if not self.takes(h_normed, batch, cache, None, [L]):
            return None
        nt = torch.get_num_threads()
        T, H = h_normed.shape
        emb = F.embedding(next_ids.long(), self.mtp_embed)
        if any(c.start == 0 for c in batch.chunks):  # a row at position 0 takes no embedding
            emb = emb.masked_fill((batch.positions == 0)[:, None], 0.0)
        e, hn = (
            self._norm(emb, T, H, self.mtp_norms[0], nt),
            self._norm(h_normed.contiguous(), T, H, self.mtp_norms[1], nt),
        )
        x = self.eh_proj(self.gemv, torch.cat([e, hn], dim=-1), T, nt)
        out = self._layers([L], x, batch, cache, None)
        return None if out is None else self._norm(out[0], T, H, self.mtp_norms[2], nt)

    def _layers(self, layers, x, batch, cache, keep):
        model = self.model
        cos, sin = model.rope.lookup(batch.positions)
        slots = batch.write_slots
        # what the fused projection takes (x stands in for its normed rows: same shape and
        # layout); where it declines, the modules compose the projections
        if not all(
            mla_project.step_ok(x, L.proj_w, cos, sin, slots, cache.kv[L.i], self._idx(cache, L))
            for L in layers
        ):
            return None
        T, H = x.shape
        nt = torch.get_num_threads()
        g = batch.groups[0]
        rk = g.rows_keys
        ident = bool(torch.equal(rk.tok, torch.arange(T)))
        chosen = keep[0] if keep else None
        # every sequence within index_topk keys: each full layer selects them all, unscored, so
        # one selection serves the step's layers (the same slots; 7 calls of 8 saved a step)
        self.all_keys = int(rk.lengths.max()) <= min(L.topk for L in layers)
        self.spans = getattr(model, "profiler", None) or _NoSpans()
        for L in layers:
            x, chosen = self._layer(L, x, T, H, nt, cos, sin, slots, cache, rk, ident, chosen)
        return x, [chosen]

    @staticmethod
    def _idx(cache, L: _Layer):
        return cache.index_k[L.i] if L.indexed else None

    def _norm(self, x, T, H, which, nt):
        out = torch.empty(T, H, dtype=BF16)
        w, eps = which
        self.norm.rms_norm_rows(x.data_ptr(), H, T, H, 1, w, eps, out.data_ptr(), nt)
        return out

    def _layer(self, L: _Layer, x, T, H, nt, cos, sin, slots, cache, rk, ident, chosen):
        gemv, sp = self.gemv, self.spans
        # attention: projections and cache writes, selection, sparse MLA, o_proj
        h = self._norm(x, T, H, L.norms[0], nt)
        sp.begin("attention")
        kv, idx = cache.kv[L.i], self._idx(cache, L)
        q, q_rot, iq, iw = mla_project.run(L.proj, h, cos, sin, slots, kv, idx, nt)
        if L.indexed and not (self.all_keys and chosen is not None):
            qr, wr = (iq, iw) if ident else (iq[rk.tok], iw[rk.tok])
            sl, ok = dsa_select.select_many(qr, wr, idx, rk, L.topk, L.i_dim)
            chosen = Selected(None, sl, ok)
        sl, ok = chosen.slots, chosen.valid
        if not ident:
            q, q_rot = q[rk.tok], q_rot[rk.tok]
        att = torch.empty(T, L.heads, L.v, dtype=BF16)
        rc = self.dec.mla_decode(
            q.data_ptr(), q.stride(0), q.stride(1), q_rot.data_ptr(), L.kv_b.data_ptr(),
            kv.data_ptr(), sl.data_ptr(), ok.data_ptr(), T, L.heads, L.nope, L.v, L.c, L.rope,
            sl.shape[1], L.scale, 1 if kv.dtype == BF16 else 0, att.data_ptr(), nt,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("mla_decode: no memory for its scratch")
        if not ident:
            full = torch.empty(T, L.heads, L.v, dtype=BF16)
            full[rk.tok] = att
            att = full
        a = L.o(gemv, att, T, nt)
        sp.end()
        x = x + a
        # the MLP
        h = self._norm(x, T, H, L.norms[1], nt)
        if not L.moe:
            sp.begin("mlp")
            m = L.mlp(gemv, h, T, nt)
            sp.end()
            return x + m, chosen
        sp.begin("moe")
        sp.begin("router")
        k, n_group, topk_group, norm_topk, scaling = L.route_cfg
        rc = 1
        if T <= router.ROWS:
            w = torch.empty(T, k, dtype=torch.float32)
            ids = torch.empty(T, k, dtype=torch.int32)
            pw, pb, E = L.route
            rc = self.route.router(h.data_ptr(), 1, T, H, pw, pb, E, k, n_group, topk_group,
                                   norm_topk, scaling, w.data_ptr(), ids.data_ptr())  # fmt: skip
        if rc == -2:
            raise MemoryError("router: no memory for its scores")
        if rc != 0:  # a shape the kernel does not take: the module's router (its reference)
            w, ids = L.module.mlp.gate(h)
            w, ids = w.contiguous(), ids.to(torch.int32).contiguous()
        sp.end()
        sp.begin("experts")
        y = self._experts(L, h, w, ids, T, H, k, nt)
        sp.end()
        if L.shared is not None:
            sp.begin("shared")
            y = y + L.shared(gemv, h, T, nt)
            sp.end()
        sp.end()
        return x + y, chosen

    def _experts(self, L: _Layer, h, w, ids, T, H, k, nt):
        if not L.mx:
            out = torch.empty(T, H, dtype=BF16)
            w13, w2 = L.ex
            rc = self.gemv.bf16_experts(
                h.data_ptr(), T, H, L.inter, k, ids.data_ptr(), w.data_ptr(), L.lo, L.n_local,
                w13, w2, out.data_ptr(), nt,
            )  # fmt: skip
            if rc != 0:
                raise MemoryError("bf16_gemv.experts: no memory for its buffers")
            return out
        if self.w4 is not None:  # moe_mxfp4_w4a8's call (it has no GEMM path)
            out = torch.empty(T, H, dtype=torch.float32)
            w13, s13, w2, s2 = L.ex
            rc = self.w4.w4_moe_forward(
                h.data_ptr(), 1, T, H, L.inter, k, ids.data_ptr(), w.data_ptr(), L.lo, L.n_local,
                w13, s13, w2, s2, out.data_ptr(), nt,
            )  # fmt: skip
            if rc != 0:
                raise MemoryError("w4_moe_forward could not allocate its scratch buffers")
            return out.to(BF16)
        thr = mxfp4_moe.gemm_threshold()
        if T * k >= thr:  # some expert may take the GEMM path: the module's op does both
            return L.module.mlp.experts(h, w, ids)
        out = torch.empty(T, H, dtype=torch.float32)
        w13, s13, w2, s2 = L.ex
        rc = self.mx.mx_moe_forward(
            h.data_ptr(), 1, T, H, L.inter, k, ids.data_ptr(), w.data_ptr(), L.lo, L.n_local,
            w13, s13, w2, s2, out.data_ptr(), nt, thr, None,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("mx_moe_forward could not allocate its scratch buffers")
        return out.to(BF16)
