"""Converters end to end on checkpoints transformers wrote: glm53 -> shard -> verify -> load; bad
inputs; resume."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from hf_tiny import make_hf_model

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.checkpoint.safetensors_io import (
    Checkpoint,
    CheckpointError,
    SafeTensorsFile,
    save_streaming,
)
from dist_glm5.model.reference_loop import full_logits

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    make_hf_model("dense1_shared_topk16", seed=3).to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def converted(bf16_dir, tmp_path_factory):
    from dist_glm5.convert.glm53 import convert_glm53

    d = tmp_path_factory.mktemp("mxfp4") / "out"
    convert_glm53(bf16_dir, d)
    return d


def _prompts(n=4, length=48):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, 300, (length,), generator=g).tolist() for _ in range(n)]


def test_glm53_layout_and_bytes(bf16_dir, converted):
    from dist_glm5.quant.mxfp4 import encode

    cfg = json.loads((converted / "config.json").read_text())
    assert (
        cfg["quantization_config"]["quant_method"] == "dist_glm5"
        and cfg["quantization_config"]["rule"] == "quark"
    )
    src, out = Checkpoint(bf16_dir), Checkpoint(converted)
    pre = "model.layers.1.mlp.experts"
    w13 = out.get(f"{pre}.routed_experts.w13_weight")
    assert w13.dtype == torch.uint8 and tuple(w13.shape) == (16, 64, 32)
    for e in (0, 7, 15):  # expert e's rows: its gate then its up, each encoded with Quark's rule
        g, s = encode(src.get(f"{pre}.{e}.gate_proj.weight"), "quark")
        u, su = encode(src.get(f"{pre}.{e}.up_proj.weight"), "quark")
        assert torch.equal(w13[e], torch.cat([g, u]))
        assert torch.equal(out.get(f"{pre}.routed_experts.w13_weight_scale")[e], torch.cat([s, su]))
        d, sd = encode(src.get(f"{pre}.{e}.down_proj.weight"), "quark")
        assert torch.equal(out.get(f"{pre}.routed_experts.w2_weight")[e], d)
        assert torch.equal(out.get(f"{pre}.routed_experts.w2_weight_scale")[e], sd)
    # everything that is not a routed expert is copied byte for byte (shared experts stay bf16)
    for n in src.names():
        if ".mlp.experts." not in n:
            assert torch.equal(out.get(n).view(torch.uint8), src.get(n).view(torch.uint8)), n
    assert out.get("model.layers.1.mlp.shared_experts.up_proj.weight").dtype == torch.bfloat16


def test_end_to_end_shard_verify_load_and_quality(bf16_dir, converted, tmp_path):
    from dist_glm5.convert.shard import shard_checkpoint
    from dist_glm5.convert.verify import verify

    sh = tmp_path / "sharded"
    meta = shard_checkpoint(converted, sh, stages=2, ep=2)
    assert meta["layers"] == [[0, 2], [2, 3]] and meta["experts"] == [[0, 8], [8, 16]]
    problems, n = verify(sh)
    assert problems == [] and n > 0
    bf16 = load_model(bf16_dir, dtype=torch.float32, ops=get_backend("cpu").ops())
    mx_whole = load_model(converted, dtype=torch.float32, ops=get_backend("cpu").ops())
    mx_sharded = load_model(sh, dtype=torch.float32, ops=get_backend("cpu").ops())
    kls, agree, total = [], 0, 0
    for p in _prompts():
        a, b = full_logits(bf16, p), full_logits(mx_sharded, p)
        torch.testing.assert_close(b, full_logits(mx_whole, p), rtol=0, atol=0)
        kls.append(
            torch.nn.functional.kl_div(
                b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none"
            ).sum(-1)
        )
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += len(p)
    kl = torch.cat(kls).mean().item()
    top1 = agree / total
    log.warning(
        "MXFP4 (quark rule) vs BF16 on the tiny model: per-token KL %.4f, top-1 agreement %.3f",
        kl,
        top1,
    )
    assert kl < 0.05 and top1 > 0.8


def test_verify_catches_tampering(converted, tmp_path):
    from dist_glm5.convert.verify import verify

    d = tmp_path / "copy"
    shutil.copytree(converted, d)
    f = d / "model-layer-00001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0xFF  # flip bits inside the last tensor's data
    f.write_bytes(bytes(raw))
    problems, _ = verify(d)
    assert any("sha256" in p for p in problems), problems


def _edited_copy(src, dst, edit=None, cfg_edit=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    ck = Checkpoint(src)
    t = {n: ck.get(n).clone() for n in ck.names()}
    if edit:
        edit(t)
    save_streaming(dst / "model.safetensors", t)
    return dst


EXPERT = "model.layers.2.mlp.experts.5.gate_proj.weight"


@pytest.mark.parametrize(
    "case,edit,cfg_edit,needle",
    [
        ("missing expert", lambda t: t.pop(EXPERT), None, EXPERT),
        ("wrong dtype", lambda t: t.__setitem__(EXPERT, t[EXPERT].to(torch.int16)), None, EXPERT),
        ("config disagrees", None, lambda c: c.update(moe_intermediate_size=64), "shape"),
    ],
)
def test_glm53_bad_inputs_name_the_problem(bf16_dir, tmp_path, case, edit, cfg_edit, needle):
    from dist_glm5.convert.glm53 import convert_glm53

    src = _edited_copy(bf16_dir, tmp_path / "src", edit, cfg_edit)
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        convert_glm53(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists() or not list((tmp_path / "dst").glob("*.safetensors"))


def test_glm53_truncated_source(bf16_dir, tmp_path):
    from dist_glm5.convert.glm53 import convert_glm53

    src = tmp_path / "src"
    shutil.copytree(bf16_dir, src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        convert_glm53(src, tmp_path / "dst")


def test_destination_holding_something_else(bf16_dir, tmp_path):
    from dist_glm5.convert.glm53 import convert_glm53
    from dist_glm5.convert.output import DestinationError

    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(DestinationError, match="already holds"):
        convert_glm53(bf16_dir, dst)
    convert_glm53(bf16_dir, tmp_path / "ok", rule="quark")
    with pytest.raises(DestinationError, match="different conversion"):
        convert_glm53(bf16_dir, tmp_path / "ok", rule="ocp")


def test_crash_leaves_no_partial_file_and_rerun_resumes(bf16_dir, converted, tmp_path, monkeypatch):
    from dist_glm5.convert import glm53

    dst = tmp_path / "dst"
    real, calls = glm53.encode, {"n": 0}

    def flaky(w, rule):
        calls["n"] += 1
        if calls["n"] == 40:  # dies inside the second MoE layer's file
            raise RuntimeError("simulated crash")
        return real(w, rule)

    monkeypatch.setattr(glm53, "encode", flaky)
    with pytest.raises(RuntimeError, match="simulated crash"):
        glm53.convert_glm53(bf16_dir, dst)
    done = sorted(p.name for p in dst.glob("*.safetensors"))
    assert "model-layer-00002.safetensors" not in done and not list(dst.glob("*.tmp*"))
    for (
        name
    ) in done:  # whatever has its final name is complete: its header and byte ranges check out
        SafeTensorsFile(dst / name)
    monkeypatch.setattr(glm53, "encode", real)
    glm53.convert_glm53(bf16_dir, dst)  # resumes
    a, b = (
        json.loads((dst / "manifest.json").read_text()),
        json.loads((converted / "manifest.json").read_text()),
    )
    assert {n: t["sha256"] for n, t in a["tensors"].items()} == {
        n: t["sha256"] for n, t in b["tensors"].items()
    }
    glm53.convert_glm53(bf16_dir, dst)  # a rerun of a finished job is a no-op


def test_parallel_encoding_writes_the_same_bytes(bf16_dir, converted, tmp_path):
    from dist_glm5.convert.glm53 import convert_glm53

    m = convert_glm53(bf16_dir, tmp_path / "par", workers=2)
    want = json.loads((converted / "manifest.json").read_text())["tensors"]
    assert {n: t["sha256"] for n, t in m["tensors"].items()} == {
        n: t["sha256"] for n, t in want.items()
    }


def test_probe_finds_gate_up_and_says_inconclusive_when_it_cannot_tell(converted):
    from dist_glm5.convert.probe import probe

    r = probe(converted)
    assert r["verdict"] == "gate_up", r
    r = probe(converted, act_scale=0.01)
    assert r["verdict"] == "inconclusive" and any("up_gate" in x for x in r["reasons"]), r

    def identical_experts_kernel(
        x, w, ids, w13, w2
    ):  # a kernel that ignores which expert is asked for
        from dist_glm5.convert.probe import cpu_kernel

        return cpu_kernel(x, w, torch.zeros_like(ids), w13, w2)

    r = probe(converted, kernel=identical_experts_kernel)
    assert r["verdict"] == "inconclusive" or r["candidates"][0]["rel_err"] > 0.05


def test_runtime_generates_from_converted_and_sharded(converted, tmp_path):
    from dist_glm5.convert.shard import shard_checkpoint
    from dist_glm5.model.reference_loop import generate
    from dist_glm5.sampling.params import SamplingParams

    sh = tmp_path / "sh"
    shard_checkpoint(converted, sh, stages=2, ep=1)
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    a = generate(load_model(converted, ops=get_backend("cpu").ops()), [_prompts(1)[0]], p)[
        0
    ].token_ids
    assert (
        generate(load_model(sh, ops=get_backend("cpu").ops()), [_prompts(1)[0]], p)[0].token_ids
        == a
    )
