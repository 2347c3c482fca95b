"""transformers' side of a checkpoint of ours: the copy transformers loads (the trainer's held-out
figure, and the tests and benchmarks that hold our runtime against transformers)."""

from __future__ import annotations

import json
from pathlib import Path


def hf_copy(model_dir: Path, dst: Path) -> Path:
    """A transformers-loadable copy: no MTP layer (transformers does not run it)."""
    from dist_glm5.checkpoint.safetensors_io import Checkpoint, save_streaming
    from dist_glm5.model.config import ModelConfig

    cfg = ModelConfig.from_hf(model_dir)
    d = cfg.to_hf()
    d["num_nextn_predict_layers"] = 0
    (dst / "config.json").write_text(json.dumps(d))
    ck = Checkpoint(model_dir)
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    save_streaming(
        dst / "model.safetensors",
        {n: ck.get(n) for n in ck.names() if not n.startswith(mtp)},
        metadata={"format": "pt"},
    )
    return dst
