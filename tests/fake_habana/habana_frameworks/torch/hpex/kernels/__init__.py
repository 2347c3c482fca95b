"""FusedSDPA: recorded; computed in fp64 (softmax over additive bias), returned in q's dtype."""

from __future__ import annotations

import math

import torch

from .... import record

_MODES = ("None", "none", "fast", "fp32")


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
        assert softmax_mode in _MODES, softmax_mode
        assert q.dim() == k.dim() == v.dim() == 4, "q/k/v are [B, heads, S, D]"
        s = (q.double() @ k.double().transpose(-1, -2)) * (
            scale if scale is not None else 1 / math.sqrt(q.shape[-1])
        )
        if attn_mask is not None:
            s = s + attn_mask.double()
        if is_causal:
            n, L = s.shape[-2:]
            s = s.masked_fill(torch.ones(n, L, dtype=torch.bool).triu(1), float("-inf"))
        return (torch.softmax(s, -1) @ v.double()).to(q.dtype)
