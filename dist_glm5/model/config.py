"""The one reader of a GLM-5 (`glm_moe_dsa`) config.json: a frozen, validated ModelConfig.

Every field of transformers' `GlmMoeDsaConfig` is read, plus the fields GLM releases carry that
transformers drops (`num_nextn_predict_layers`, rope interleave flags, `quantization_config`).
Derived values are properties. Invalid values raise ValueError naming the field, the value and
what is allowed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

MODEL_TYPE = "glm_moe_dsa"
ROPE_TYPES = ("default", "linear", "yarn")
INDEXER_TYPES = ("full", "shared")
MLP_LAYER_TYPES = ("dense", "sparse")
# quantization_config.quant_method of checkpoints our converters write (routed experts in fused
# MXFP4)
SERVING_QUANT_METHOD = "dist_glm5"


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False
    mlp_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    num_nextn_predict_layers: int = 0
    # GLM rotates interleaved pairs (x0,x1),(x2,x3)...; DeepSeek-V3.2 rotates halves. Read, never
    # assume.
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    torch_dtype: str = "bfloat16"
    quantization_config: dict | None = field(default=None, compare=False, hash=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per-token width of the MLA cache: normalised latent then the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.type != "default" and r.mscale_all_dim:
            m = _yarn_mscale(r.factor or 1.0, r.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def experts_format(self) -> str:
        """'mxfp4' when routed experts are stored in our fused MXFP4 serving layout, else
        'float'."""
        q = self.quantization_config or {}
        if q.get("quant_method") == SERVING_QUANT_METHOD:
            return q.get("format", "mxfp4")
        return "float"

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    def is_moe_layer(self, layer: int) -> bool:
        if layer >= self.num_hidden_layers:  # MTP layers are MoE blocks (DeepSeek-V3 / GLM layout)
            return True
        return self.mlp_layer_types[layer] == "sparse"

    def has_indexer(self, layer: int) -> bool:
        if layer >= self.num_hidden_layers:  # the MTP block runs its own indexer
            return True
        return self.indexer_types[layer] == "full"

    # ---- construction --------------------------------------------------------------------
    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.mlp_layer_types:
            k = min(self.first_k_dense_replace, n)
            object.__setattr__(self, "mlp_layer_types", ("dense",) * k + ("sparse",) * (n - k))
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", ("full",) * n)
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._validate()

    def _validate(self) -> None:
        """Checks in a fixed order: the first invalid field is the one reported."""
        self._check_integers()
        if self.hidden_act != "silu":
            raise _bad("hidden_act", self.hidden_act, "only 'silu' is supported")
        self._check_attention()
        self._check_routing()
        if not (self.rms_norm_eps > 0):
            raise _bad("rms_norm_eps", self.rms_norm_eps, "must be > 0")
        self._check_layer_types()
        _check_rope(self.rope)
        self._check_quantization()
        for tid in self.eos_token_id:
            if not 0 <= tid < self.vocab_size:
                raise _bad(
                    "eos_token_id",
                    list(self.eos_token_id),
                    f"ids must be in 0..vocab_size-1={self.vocab_size - 1}",
                )

    def _check_integers(self) -> None:
        for names, least, allowed in (
            (_POSITIVE, 1, "must be a positive integer"),
            (_NON_NEGATIVE, 0, "must be a non-negative integer"),
        ):
            for name in names:
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or v < least:
                    raise _bad(name, v, allowed)

    def _check_attention(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise _bad(
                "qk_rope_head_dim", self.qk_rope_head_dim, "must be even (RoPE rotates pairs)"
            )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise _bad(
                "index_head_dim",
                self.index_head_dim,
                f"must be >= qk_rope_head_dim={self.qk_rope_head_dim}",
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise _bad(
                "num_key_value_heads",
                self.num_key_value_heads,
                "MLA expands one latent into every head; must equal "
                f"num_attention_heads={self.num_attention_heads}",
            )

    def _check_routing(self) -> None:
        if self.n_routed_experts % self.n_group:
            raise _bad(
                "n_group", self.n_group, f"must divide n_routed_experts={self.n_routed_experts}"
            )
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2:
            raise _bad(
                "n_group",
                self.n_group,
                "groups are scored by their top-2 experts: each group needs >= 2 experts",
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise _bad("topk_group", self.topk_group, f"must be in 1..n_group={self.n_group}")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise _bad(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                f"must be <= topk_group * experts per group = {self.topk_group * per_group}",
            )
        if not (
            isinstance(self.routed_scaling_factor, (int, float))
            and math.isfinite(self.routed_scaling_factor)
        ):
            raise _bad(
                "routed_scaling_factor", self.routed_scaling_factor, "must be a finite number"
            )

    def _check_layer_types(self) -> None:
        n = self.num_hidden_layers
        for name, allowed in (
            ("mlp_layer_types", MLP_LAYER_TYPES),
            ("indexer_types", INDEXER_TYPES),
        ):
            types = getattr(self, name)
            if len(types) != n or any(t not in allowed for t in types):
                raise _bad(
                    name,
                    list(types),
                    f"must list {n} entries (one per layer), each one of {allowed}",
                )
        if self.indexer_types[0] != "full":
            raise _bad(
                "indexer_types",
                list(self.indexer_types),
                "layer 0 must be 'full': a 'shared' layer reuses the previous full layer's "
                "selection",
            )

    def _check_quantization(self) -> None:
        # another quant_method (e.g. Quark's or the FP8 release's) is readable for planning; the
        # loader says what it can serve
        q = self.quantization_config
        if q is not None and not isinstance(q, dict):
            raise _bad("quantization_config", q, "must be a JSON object")
        if (
            q
            and q.get("quant_method") == SERVING_QUANT_METHOD
            and q.get("format", "mxfp4") != "mxfp4"
        ):
            raise _bad("quantization_config.format", q.get("format"), "only 'mxfp4' is served")

    @classmethod
    def from_hf(cls, src: str | Path | dict) -> "ModelConfig":
        """Read a config.json (a directory, a file path, or an already-parsed dict)."""
        d, where = _read_json(src)
        mt = d.get("model_type")
        if mt is not None and mt != MODEL_TYPE:
            raise ValueError(
                f"{where}: model_type={mt!r}, expected {MODEL_TYPE!r} (a GLM-5 family checkpoint)"
            )

        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {
            k: d[k] for k in known if k in d and k not in ("rope", "eos_token_id", "torch_dtype")
        }
        if "num_experts" in d and "n_routed_experts" not in d:
            kw["n_routed_experts"] = d["num_experts"]
        eos = d.get("eos_token_id", 1)
        kw["eos_token_id"] = (
            tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        )
        kw["torch_dtype"] = str(d.get("dtype") or d.get("torch_dtype") or "bfloat16")
        for k in ("mlp_layer_types", "indexer_types"):
            if d.get(k) is not None:
                kw[k] = tuple(d[k])
            else:
                kw.pop(k, None)
        if d.get("indexer_types") is None:
            legacy = _legacy_indexer_types(
                d, int(d.get("num_hidden_layers", cls.num_hidden_layers))
            )
            if legacy is not None:
                kw["indexer_types"] = legacy
        kw["rope"] = _read_rope(d)
        try:
            return cls(**kw)
        except TypeError as e:  # a field of the wrong JSON type
            raise ValueError(f"{where}: {e}") from None

    def to_hf(self) -> dict:
        """The config.json dict transformers and our loader read back."""
        d = {k: v for k, v in asdict(self).items() if k not in ("rope", "torch_dtype")}
        d["model_type"] = MODEL_TYPE
        d["architectures"] = ["GlmMoeDsaForCausalLM"]
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["indexer_types"] = list(self.indexer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        d["dtype"] = self.torch_dtype
        d["rope_parameters"] = _rope_to_hf(self.rope)
        if d["quantization_config"] is None:
            del d["quantization_config"]
        return d


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config field {name}={value!r} is invalid: {allowed}")


_POSITIVE = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
    "num_attention_heads n_routed_experts kv_lora_rank q_lora_rank qk_rope_head_dim "
    "v_head_dim qk_nope_head_dim n_group topk_group num_experts_per_tok "
    "max_position_embeddings index_topk index_head_dim index_n_heads"
).split()
_NON_NEGATIVE = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")


def _check_rope(r: RopeConfig) -> None:
    if r.type not in ROPE_TYPES:
        raise _bad("rope_parameters.rope_type", r.type, f"supported: {ROPE_TYPES}")
    if not (r.theta > 0):
        raise _bad("rope_parameters.rope_theta", r.theta, "must be > 0")
    if r.type == "linear" and not (r.factor and r.factor > 0):
        raise _bad("rope_parameters.factor", r.factor, "linear rope needs a factor > 0")
    if r.type == "yarn" and r.factor is None and r.original_max_position_embeddings is None:
        raise _bad(
            "rope_parameters.factor",
            r.factor,
            "yarn rope needs factor or original_max_position_embeddings",
        )


def _read_json(src: str | Path | dict) -> tuple[dict, str]:
    """The config as a dict, and where it came from (for messages)."""
    if isinstance(src, dict):
        return dict(src), "config dict"
    p = Path(src)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"no config.json at {p}: pass a checkpoint directory that holds one")
    try:
        return json.loads(p.read_text()), str(p)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None


def _legacy_indexer_types(d: dict, n: int) -> tuple[str, ...] | None:
    """indexer_types from the older fields (index_topk_pattern, or index_topk_freq with
    index_skip_topk_offset); None when the config has neither."""
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    if "index_topk_freq" in d or "index_skip_topk_offset" in d:
        freq = max(int(d.get("index_topk_freq", 1)), 1)
        offset = int(d.get("index_skip_topk_offset", 2))
        return tuple("full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n))
    return None


def _read_rope(d: dict) -> RopeConfig:
    rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    rtype = rp.get("rope_type", rp.get("type", "default"))
    omp = rp.get("original_max_position_embeddings")
    if rtype == "yarn" and omp is None:
        omp = d.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    return RopeConfig(
        theta=float(theta),
        type=rtype,
        factor=rp.get("factor"),
        original_max_position_embeddings=omp,
        beta_fast=rp.get("beta_fast"),
        beta_slow=rp.get("beta_slow"),
        mscale=rp.get("mscale"),
        mscale_all_dim=rp.get("mscale_all_dim"),
        attention_factor=rp.get("attention_factor"),
        truncate=bool(rp.get("truncate", True)),
    )


def _rope_to_hf(r: RopeConfig) -> dict:
    out: dict[str, Any] = {"rope_theta": r.theta, "rope_type": r.type}
    for k in (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
    ):
        v = getattr(r, k)
        if v is not None:
            out[k] = v
    if not r.truncate:
        out["truncate"] = False
    return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
