"""The embedded default models, both needing no download.

- The trained default model (`ensure_default_model`, what `launch generate` runs with no
  `--model`): a small GLM-5-architecture byte-level model trained by dist_glm5/train/trainer.py
  on the Python standard library and synthetic needle documents (dist_glm5/train/corpus.py),
  shipped in `trained/` as an ordinary HF checkpoint (bf16 weights, the routers in fp32).
- The deterministic random model (`ensure_random_model`, for tests that need no trained weights):
  `config.json` here, weights made from a seed on first use and cached on disk (per-expert names,
  config.json, a byte-level tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

import torch

from dist_glm5.checkpoint.safetensors_io import save_streaming
from dist_glm5.checkpoint.tokenizer import write_tokenizer_files
from dist_glm5.model.config import ModelConfig

log = logging.getLogger(__name__)
CONFIG_PATH = Path(__file__).with_name("config.json")
TRAINED_DIR = Path(__file__).with_name("trained")
SEED = 5


def cache_root() -> Path:
    return Path(os.environ.get("DIST_GLM5_HOME", Path.home() / ".cache" / "dist_glm5"))


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights under HF names; scales chosen so activations stay O(1) through the
    stack."""
    from dist_glm5.checkpoint.loader import hf_state_dict, meta_model

    shapes = {k: (tuple(v.shape), v.dtype) for k, v in hf_state_dict(meta_model(cfg)).items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):  # the indexer key norm bias and the router correction bias
            t = 0.05 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name:
            t = torch.randn(shape, generator=g)
        else:  # linear weights [out, in]
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        out[name] = t.to(dtype)
    return out


def ensure_default_model() -> Path:
    """Directory of the trained default model shipped in the package (the random model if a
    source tree has no trained weights)."""
    if (TRAINED_DIR / "model.safetensors").exists():
        return TRAINED_DIR
    log.warning("no trained default model in %s: using the random one", TRAINED_DIR)
    return ensure_random_model()


def ensure_random_model() -> Path:
    """Directory of the deterministic random model, created (atomically) on first use."""
    raw = CONFIG_PATH.read_bytes()
    tag = hashlib.sha256(raw + str(SEED).encode()).hexdigest()[:12]
    dst = cache_root() / "models" / f"default-{tag}"
    if (dst / "model.safetensors").exists():
        if not (dst / "tokenizer.json").exists():  # made before it had transformers' tokenizer
            write_tokenizer_files(dst)
        return dst
    cfg = ModelConfig.from_hf(json.loads(raw))
    log.info("creating the embedded default model in %s (first use)", dst)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_bytes(raw)
    write_tokenizer_files(tmp)
    save_streaming(tmp / "model.safetensors", random_weights(cfg, SEED), metadata={"format": "pt"})
    try:
        os.replace(tmp, dst)
    except OSError:  # another process won the race: theirs is complete, keep it
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
