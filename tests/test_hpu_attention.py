"""Gaudi attention, norm and rope against the CPU references, on the recording fake.

FusedSDPA's call contract (positional bridge-1.19 order, additive -inf bias in q's dtype
[B, 1, n, L], not causal, no dropout, softmax "None" and never "fast"; the fake tells "fast"
apart in bf16 but cannot tell "None" from "fp32"), and every form's output
against its CPU reference with padding: padded query rows, masked keys, key lists that are not a
whole number of chunks, several capped chunks.
"""

from __future__ import annotations

import hpu_fake
import pytest
import torch

from dist_glm5.backends.hpu import _hf, attention, norm_rope
from dist_glm5.model.rope import RopeTable
from dist_glm5.ops import attention as ref
from dist_glm5.ops.gather import attn_key_bytes, decode_row_bytes
from dist_glm5.ops.key_slots import KeySlots
from dist_glm5.ops.norm import rms_norm
from dist_glm5.ops.rope import apply_rope

fake_hf = hpu_fake.fake_hf
B, n, h, NOPE, R, V, C, L = 2, 3, 4, 8, 4, 8, 16, 10


def mla_inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g).to(dtype)

    keep = torch.rand(B, n, L, generator=g) < 0.6
    keep[..., 0] = True  # every row keeps a key
    keep[1, 2] = keep[1, 0]  # a padded query row repeats a real one
    keep[:, :, L - 2 :] = False  # padded keys, masked for every row
    return r(B, n, h, NOPE), r(B, n, h, R), r(B, L, C), r(B, L, R), r(h * (NOPE + V), C), keep


def close(a, b, tol):
    return (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sdpa_call_contract_and_output(fake_hf, dtype):
    q_nope, q_rot, lat, k_rot, w, keep = mla_inputs(dtype)
    out = attention.mla_expanded(q_nope, q_rot, lat, k_rot, w, keep, 0.3, NOPE)
    ((args, kw),) = fake_hf.calls("FusedSDPA.apply")
    assert kw == {} and len(args) == 11  # autograd.Function.apply: positional only
    q, k, v, bias, dropout, causal, scale, mode, recompute, valid_len, padding = args
    assert q.shape == (B, h, n, NOPE + R) and k.shape == (B, h, L, NOPE + R)
    assert v.shape == (B, h, L, V)
    assert bias.shape == (B, 1, n, L) and bias.dtype == q.dtype == dtype
    assert int(torch.isinf(bias).sum()) == int((~keep).sum()) and bias.max() == 0
    assert (dropout, causal, scale, mode, recompute, valid_len) == (
        0.0,
        False,
        0.3,
        "None",
        None,
        None,
    )
    want = ref.mla_expanded(q_nope, q_rot, lat, k_rot, w, keep, 0.3, NOPE)
    assert out.shape == want.shape and out.dtype == dtype
    assert close(out, want, 1e-5 if dtype == torch.float32 else 3e-2)


def test_softmax_mode_is_never_fast(fake_hf, monkeypatch):
    inputs = mla_inputs()
    for vllm in (None, "0", "1"):  # vllm-gaudi's knob is not ours: it changes nothing here
        if vllm is None:
            monkeypatch.delenv("VLLM_FP32_SOFTMAX", raising=False)
        else:
            monkeypatch.setenv("VLLM_FP32_SOFTMAX", vllm)
        for ours, want in ((None, "None"), ("None", "None"), ("fp32", "fp32")):
            if ours is None:
                monkeypatch.delenv(attention.SOFTMAX_ENV, raising=False)
            else:
                monkeypatch.setenv(attention.SOFTMAX_ENV, ours)
            attention.mla_expanded(*inputs, 0.3, NOPE)
            assert fake_hf.calls("FusedSDPA.apply")[-1][0][7] == want
    monkeypatch.setenv(attention.SOFTMAX_ENV, "fast")
    with pytest.raises(ValueError, match="'fast' is refused"):
        attention.mla_expanded(*inputs, 0.3, NOPE)
    with pytest.raises(ValueError, match="softmax mode 'fast'"):
        attention.mla_expanded(*inputs, 0.3, NOPE, mode="fast")
    modes = {a[7] for a, _ in fake_hf.calls("FusedSDPA.apply")}
    assert modes == {"None", "fp32"}


def test_fake_sdpa_tells_fast_apart_but_not_none_from_fp32(fake_hf):
    """Said plainly: the fake cannot tell "None" from "fp32" (no source says what either changes
    in the kernel; both are computed exactly here), so for those two only the recorded argument
    shows which mode we pass. "fast" is told apart in bf16 by its one sourced difference, the
    inverse row sum kept in bf16 (tests/fake_habana/.../hpex/kernels)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, s, 8, generator=g) for s in (16, 64, 64))
    sdpa = _hf.fused_sdpa()
    for dtype, fast_differs in ((torch.bfloat16, True), (torch.float32, False)):
        args = (q.to(dtype), k.to(dtype), v.to(dtype), None, 0.0, False, None)
        out = {m: sdpa.apply(*args, m) for m in ("None", "none", "fp32", "fast")}
        assert torch.equal(out["None"], out["none"]) and torch.equal(out["None"], out["fp32"])
        assert torch.equal(out["None"], out["fast"]) is not fast_differs, dtype


@pytest.mark.parametrize("env", [None, "None", "fp32"])
def test_hpu_attention_passes_the_mode_it_claims(fake_hf, monkeypatch, env):
    """The recorded mode is the one softmax_mode() names, and in bf16 the output is the fake's
    output for that mode, not for "fast" (for "fp32" that cannot tell it from "None": above)."""
    if env is None:
        monkeypatch.delenv(attention.SOFTMAX_ENV, raising=False)
    else:
        monkeypatch.setenv(attention.SOFTMAX_ENV, env)
    claimed = attention.softmax_mode()
    assert claimed == (env or "None")
    out = attention.mla_expanded(*mla_inputs(torch.bfloat16), 0.3, NOPE)
    ((args, _),) = fake_hf.calls("FusedSDPA.apply")
    assert args[7] == claimed
    sdpa = _hf.fused_sdpa()

    def rerun(mode):
        return sdpa.apply(*args[:7], mode, *args[8:]).transpose(1, 2)

    assert torch.equal(out, rerun(claimed)) and not torch.equal(out, rerun("fast"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_equals_reference(dtype):
    inputs = mla_inputs(dtype, seed=1)
    got, want = attention.mla_absorbed(*inputs, 0.3, NOPE), ref.mla_absorbed(*inputs, 0.3, NOPE)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert close(got, want, 1e-5 if dtype == torch.float32 else 3e-2)


def store_and_queries(N=64, m=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    store = torch.randn(N, C + R, generator=g).to(torch.bfloat16)
    return store, torch.randn(m, h, C, generator=g), torch.randn(m, h, R, generator=g)


def test_attend_gathered_equals_reference_with_padding_and_chunks():
    store, q_lat, q_rot = store_and_queries()
    g = torch.Generator().manual_seed(3)
    k = 12
    slots = torch.randint(0, 64, (5, k), generator=g)
    valid = torch.rand(5, k, generator=g) < 0.7
    valid[:, 0] = True
    slots = torch.where(valid, slots, slots[:, :1])  # padding repeats a valid slot
    row = decode_row_bytes(k, h, C + R, 2)
    for cap in (10 * row, 2 * row):  # one chunk, then three
        got = attention.attend_gathered(q_lat, q_rot, store, slots, valid, C, 0.2, cap)
        want = ref.attend_gathered(q_lat, q_rot, store, slots, valid, C, 0.2, cap)
        assert close(got, want, 1e-5)


def test_attend_absorbed_chunked_equals_reference_with_padded_chunks():
    store, q_lat, q_rot = store_and_queries()
    g = torch.Generator().manual_seed(4)
    K = 23
    slots = torch.randperm(64, generator=g)[:K]
    mask = torch.rand(5, K, generator=g) < 0.5
    mask[:, 3] = True
    row = attn_key_bytes(5, h, C + R, 2)
    for cap in (100 * row, 5 * row):  # one chunk, then 5 chunks of 5 keys (2 padded)
        got = attention.attend_absorbed_chunked(q_lat, q_rot, store, slots, mask, C, 0.2, cap)
        want = ref.attend_absorbed_chunked(q_lat, q_rot, store, slots, mask, C, 0.2, cap)
        assert close(got, want, 1e-5)
    # a whole sequence by its block table, as the sparse prefill passes it
    keys = KeySlots(torch.tensor([3, 0, 5, 1]), 16, 50)
    mask = torch.rand(5, 50, generator=g) < 0.3
    mask[:, 0] = True
    got = attention.attend_absorbed_chunked(
        q_lat, q_rot, store.repeat(2, 1)[:96], keys, mask, C, 0.2, 7 * row
    )
    want = ref.attend_absorbed_chunked(
        q_lat, q_rot, store.repeat(2, 1)[:96], keys, mask, C, 0.2, 7 * row
    )
    assert close(got, want, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_through_fused_rms_norm(fake_hf, dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    w = torch.rand(64, generator=g).to(dtype)
    got, want = norm_rope.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype
    assert close(got, want, 1e-6 if dtype == torch.float32 else 1e-2)
    ((args, _),) = fake_hf.calls("FusedRMSNorm.apply")
    assert args[0].dtype == torch.float32 and torch.equal(args[1], torch.ones(64))
    assert args[2] == 1e-6


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_equals_reference_and_device_table_slices(interleave):
    from dist_glm5.model.config import RopeConfig

    table = RopeTable(RopeConfig(theta=1e6), 16, 4096, initial=8)
    dev = norm_rope.DeviceRopeTable.from_host(table, 1000, "cpu")
    pos = torch.tensor([0, 5, 999, 17])
    cos, sin = table.lookup(pos)
    dcos, dsin = dev.lookup(pos)
    assert torch.equal(cos, dcos) and torch.equal(sin, dsin)
    x = torch.randn(4, 3, 16)
    want = apply_rope(x, cos, sin, interleave)
    assert torch.equal(norm_rope.apply_rope(x, dcos, dsin, interleave), want)
