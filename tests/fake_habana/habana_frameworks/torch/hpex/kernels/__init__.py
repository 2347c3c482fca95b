"""FusedSDPA: recorded; computed in fp64 (softmax over additive bias), returned in q's dtype.

softmax_mode (sources in gaudi.md §2; PB = gaudi-pytorch-bridge @ 5a56187, 1.19.0):
- [src] the wrapper lower-cases it (`softmax_mode = softmax_mode.lower()`, PB
  hpex/kernels/FusedSDPA.py:102) and hands it to the kernel; its own Python refuses no value, and
  the values any caller passes are "None", "fast" and "fp32" (optimum-habana, vllm-gaudi).
- [inferred] "fast" with bf16 q keeps the softmax's inverse row sum (`linv`) in bf16: the meta of
  the recompute kernel gives `linv_type = torch.bfloat16` when `softmax_mode == "fast" and
  q.dtype == torch.bfloat16` (PB dynamo/_custom_op_meta_registrations.py:643-646; that is the
  fp8 op's meta, the bf16 op's is not public). Modelled here, and only that: the project's own
  measurement of "fast" (worst-row cosine 0.086 at long context, design.md §3) is far worse than
  this model, so the fake understates fast's error.
- [unconfirmed] what "None" and "fp32" change inside the kernel (the accumulation precision of
  the max, exp and row sum): no source says. The fake computes both exactly (fp64, rounded once
  to q's dtype), so it CANNOT tell "None" from "fp32": a test can only check which one was
  passed (the recorded argument), never that the kernel honoured it.
"""

from __future__ import annotations

import math

import torch

from .... import record

_MODES = ("none", "fast", "fp32")  # after the wrapper's .lower()


class FusedSDPA:
    @staticmethod
    def apply(
        q,
        k,
        v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        softmax_mode="None",
        recompute_mode=None,
        valid_seq_len=None,
        seq_padding_type="left",
        *rest,
    ):
        # an autograd.Function's apply: positional arguments only
        args = (q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode)
        record("FusedSDPA.apply", *args, valid_seq_len, seq_padding_type, *rest)
        mode = softmax_mode.lower()
        assert mode in _MODES, f"softmax_mode {softmax_mode!r}: no caller passes it"
        assert q.dim() == k.dim() == v.dim() == 4, "q/k/v are [B, heads, S, D]"
        s = (q.double() @ k.double().transpose(-1, -2)) * (
            scale if scale is not None else 1 / math.sqrt(q.shape[-1])
        )
        if attn_mask is not None:
            s = s + attn_mask.double()
        if is_causal:
            n, L = s.shape[-2:]
            s = s.masked_fill(torch.ones(n, L, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        linv = 1 / p.sum(-1, keepdim=True)
        if mode == "fast" and q.dtype == torch.bfloat16:
            linv = linv.to(torch.bfloat16).double()  # the one sourced difference (see above)
        return ((p @ v.double()) * linv).to(q.dtype)
