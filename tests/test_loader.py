"""Checkpoint loading counts in both directions; every malformed checkpoint fails naming the
tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_tiny import save_hf_model

from dist_glm5.backends import get_backend
from dist_glm5.checkpoint.loader import load_model
from dist_glm5.checkpoint.safetensors_io import Checkpoint, CheckpointError, save_streaming
from dist_glm5.model.reference_loop import full_logits


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    save_hf_model("moe_only_linear_topk8", d)
    return d


def _variant(hf_dir, tmp_path, edit):
    """Copy the checkpoint with its tensors passed through `edit(dict)`."""
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    ck = Checkpoint(hf_dir)
    tensors = {n: ck.get(n).clone() for n in ck.names()}
    edit(tensors)
    save_streaming(d / "model.safetensors", tensors)
    return d


def _fails(d, *needles):
    with pytest.raises(CheckpointError) as e:
        load_model(d, ops=get_backend("cpu").ops())
    for n in needles:
        assert n in str(e.value), str(e.value)


EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def test_missing_tensor(hf_dir, tmp_path):
    _fails(
        _variant(hf_dir, tmp_path, lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight")),
        "missing",
        "model.layers.0.self_attn.kv_b_proj.weight",
    )


def test_extra_tensor(hf_dir, tmp_path):
    _fails(
        _variant(
            hf_dir,
            tmp_path,
            lambda t: t.__setitem__("model.layers.0.mlp.bonus.weight", torch.zeros(2)),
        ),
        "not used",
        "model.layers.0.mlp.bonus.weight",
    )


def test_wrong_shape(hf_dir, tmp_path):
    _fails(
        _variant(hf_dir, tmp_path, lambda t: t.__setitem__(EXPERT, t[EXPERT][:-1].clone())),
        EXPERT,
        "shape",
    )


def test_wrong_dtype(hf_dir, tmp_path):
    _fails(
        _variant(hf_dir, tmp_path, lambda t: t.__setitem__(EXPERT, t[EXPERT].half())),
        EXPERT,
        "dtype",
    )


def test_misnamed_expert(hf_dir, tmp_path):
    def edit(t):
        t["model.layers.1.mlp.experts.3.up.weight"] = t.pop(EXPERT)

    _fails(_variant(hf_dir, tmp_path, edit), EXPERT, "model.layers.1.mlp.experts.3.up.weight")


def test_expert_out_of_range(hf_dir, tmp_path):
    def edit(t):
        t["model.layers.1.mlp.experts.8.up_proj.weight"] = t.pop(EXPERT)

    _fails(_variant(hf_dir, tmp_path, edit), EXPERT, "experts.8.up_proj")


def test_truncated_file(hf_dir, tmp_path):
    d = _variant(hf_dir, tmp_path, lambda t: None)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _fails(d, "truncated", "model.safetensors")


def test_config_disagrees_with_tensors(hf_dir, tmp_path):
    d = _variant(hf_dir, tmp_path, lambda t: None)
    cfg = json.loads((d / "config.json").read_text())
    cfg["n_routed_experts"] = 4
    cfg["num_experts_per_tok"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(d, "not used", "experts.4.")


def test_sharded_checkpoint_loads_identically(hf_dir, tmp_path):
    ck = Checkpoint(hf_dir)
    names = ck.names()
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    wm = {}
    for fn, ns in halves.items():
        save_streaming(d / fn, {n: ck.get(n) for n in ns})
        wm.update({n: fn for n in ns})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    ids = list(range(2, 40))
    torch.testing.assert_close(
        full_logits(load_model(d, ops=get_backend("cpu").ops()), ids),
        full_logits(load_model(hf_dir, ops=get_backend("cpu").ops()), ids),
        rtol=0,
        atol=0,
    )
    # an index that names a tensor its file does not hold
    wm[names[0]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    _fails(d, names[0])


def test_tensors_are_memory_mapped(hf_dir):
    ck = Checkpoint(hf_dir)
    a, b = "lm_head.weight", "model.norm.weight"
    # zero-copy views into one mapping: addresses differ exactly by the file offsets
    assert ck.get(b).data_ptr() - ck.get(a).data_ptr() == ck.info(b).start - ck.info(a).start


def test_stage_loads_only_its_layers(hf_dir):
    m = load_model(hf_dir, layers=range(1, 2), ops=get_backend("cpu").ops())
    assert m.cache_layers == [1] and m.model.embed_tokens is None and m.lm_head is not None
