"""The normalised model description every stage reads.

Hugging Face families spell the same facts differently (``num_local_experts`` vs
``num_experts``, ``rope_theta`` vs ``rope_parameters.rope_theta``). :func:`normalize` absorbs
those differences once, through the alias tables of :mod:`moepipe.arch`; stages only ever see a
:class:`ModelSpec`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moepipe.arch.bounds import LIMITS, check_shape
from moepipe.errors import CheckpointError, UnsupportedError

# Normalised name -> HF config keys to try, in order. A family may override an entry.
DEFAULT_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_hidden_layers",),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "dense_intermediate_size": ("intermediate_size",),
    "expert_intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    "num_experts": ("num_local_experts", "num_experts"),
    "top_k": ("num_experts_per_tok",),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    "norm_topk_prob": ("norm_topk_prob",),
    "rms_norm_eps": ("rms_norm_eps",),
    "rope_theta": ("rope_parameters.rope_theta", "rope_theta"),
    "rope_type": ("rope_parameters.rope_type", "rope_scaling.rope_type", "rope_scaling.type"),
    "max_position_embeddings": ("max_position_embeddings",),
    "hidden_act": ("hidden_act",),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "attention_bias": ("attention_bias", "qkv_bias"),
    "torch_dtype": ("dtype", "torch_dtype"),
    "bos_token_id": ("bos_token_id",),
    "eos_token_id": ("eos_token_id",),
    "pad_token_id": ("pad_token_id",),
    "sliding_window": ("sliding_window",),
    "use_sliding_window": ("use_sliding_window",),
    "decoder_sparse_step": ("decoder_sparse_step",),
    "mlp_only_layers": ("mlp_only_layers",),
}

# Values used when a family's config does not carry the key at all.
DEFAULTS: dict[str, Any] = {
    "num_kv_heads": None,  # = num_heads
    "head_dim": None,  # = hidden_size // num_heads
    "shared_expert_intermediate_size": 0,
    "norm_topk_prob": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_type": "default",
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "sliding_window": None,
    "use_sliding_window": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "dense_intermediate_size": 0,
}

REQUIRED = ("vocab_size", "hidden_size", "num_layers", "num_heads", "expert_intermediate_size",
            "num_experts", "top_k")


@dataclass(frozen=True)
class ModelSpec:
    """A Mixture-of-Experts decoder, in moepipe's own names."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dense_intermediate_size: int
    expert_intermediate_size: int
    num_experts: int
    top_k: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    @property
    def attn_width(self) -> int:
        """Width of the attention output (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _lookup(cfg: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    cur: Any = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def normalize(cfg: dict[str, Any], keys: dict[str, tuple[str, ...]], where: str,
              defaults: dict[str, Any] | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from an HF ``config.json`` dict using alias table ``keys``
    (and family ``defaults`` for keys the file does not carry).

    ``where`` names the file in error messages.
    """
    defaults = {**DEFAULTS, **(defaults or {})}
    raw: dict[str, Any] = {}
    given: dict[str, str] = {}  # normalised name -> the config key that gave it
    for name, candidates in keys.items():
        for key in candidates:
            found, value = _lookup(cfg, key)
            if found and value is not None:
                raw[name], given[name] = value, key
                break
        else:
            if name in REQUIRED:
                raise CheckpointError(
                    f"{where}: missing '{candidates[0]}' (needed for {name})",
                    "is this a complete Hugging Face config.json of a MoE model?")
            raw[name] = defaults.get(name)
    check_shape({k: raw[k] for k in (*LIMITS, "mlp_only_layers") if k in raw}, where,
                {k: given.get(k, keys[k][0]) for k in raw})

    if raw["num_kv_heads"] is None:
        raw["num_kv_heads"] = raw["num_heads"]
    if raw["head_dim"] is None:
        raw["head_dim"] = raw["hidden_size"] // raw["num_heads"]
    eos = raw["eos_token_id"]
    if isinstance(eos, list):
        raw["eos_token_id"] = eos[0] if eos else None
    if raw["torch_dtype"] not in ("float32", "float16", "bfloat16"):
        raw["torch_dtype"] = "bfloat16"

    _check_supported(raw, where)
    fields = {k: raw[k] for k in ModelSpec.__dataclass_fields__ if k in raw}
    ints = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "expert_intermediate_size", "num_experts", "top_k", "shared_expert_intermediate_size",
            "max_position_embeddings", "dense_intermediate_size")
    for k in ints:
        fields[k] = int(fields[k] or 0)
    fields["rms_norm_eps"] = float(fields["rms_norm_eps"])
    fields["rope_theta"] = float(fields["rope_theta"])
    fields["norm_topk_prob"] = bool(fields["norm_topk_prob"])
    fields["tie_word_embeddings"] = bool(fields["tie_word_embeddings"])
    fields["attention_bias"] = bool(fields["attention_bias"])
    return ModelSpec(architecture=cfg["architectures"][0], model_type=cfg.get("model_type", ""),
                     **fields)


def _check_supported(raw: dict[str, Any], where: str) -> None:
    """Refuse model features the converter and reference runtime do not implement."""
    if raw["hidden_act"] != "silu":
        raise UnsupportedError(f"{where}: hidden_act '{raw['hidden_act']}' is not supported",
                               "moepipe supports SwiGLU experts (hidden_act: silu)")
    if raw["rope_type"] not in ("default", None):
        raise UnsupportedError(f"{where}: rope scaling '{raw['rope_type']}' is not supported yet",
                               "only plain RoPE (rope_type: default) is converted today")
    if raw["use_sliding_window"]:
        raise UnsupportedError(f"{where}: sliding-window attention is not supported",
                               "set use_sliding_window: false")
    if raw["mlp_only_layers"] or raw["decoder_sparse_step"] != 1:
        raise UnsupportedError(f"{where}: dense (non-MoE) layers are not supported yet",
                               "mlp_only_layers must be empty and decoder_sparse_step 1")
