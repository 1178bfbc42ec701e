"""What the numbers of a model's ``config.json`` may be: the one check that ``inspect``,
``convert`` and ``plan`` share.

:func:`moepipe.arch.spec.normalize` (every stage) and the planner's readers
(:mod:`moepipe.sizing.shapes`) both pass the numbers they read through :func:`check_shape`
before anything divides by them or loops over them: a zero would divide by zero, a string or
a fraction would fail deep inside a stage, a negative count would be planned as if it made
sense, and ``num_hidden_layers: 1000000000`` would keep the planner and the converter busy for
hours.
"""

from __future__ import annotations

from typing import Any

from moepipe.errors import CheckpointError

# Normalised name -> (least, most). The most is far above any published model (DeepSeek-V3:
# 61 layers, 256 experts of 2048, hidden 7168, 128 heads, vocabulary 129280, 163840 positions)
# and low enough that the work growing with it (the planner's and converter's per-layer
# tensors, a placement's per-expert lists) stays within seconds.
LIMITS: dict[str, tuple[int, int]] = {
    "num_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "num_heads": (1, 1 << 12),
    "num_kv_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 12),
    "vocab_size": (1, 1 << 24),
    "num_experts": (1, 1 << 14),
    "top_k": (1, 1 << 14),
    "expert_intermediate_size": (1, 1 << 18),
    "dense_intermediate_size": (0, 1 << 18),
    "shared_expert_intermediate_size": (0, 1 << 18),
    "max_position_embeddings": (1, 1 << 28),
    "original_max_position_embeddings": (1, 1 << 28),
    # multi-head latent attention (DeepSeek)
    "q_lora_rank": (0, 1 << 16),
    "kv_lora_rank": (1, 1 << 16),
    "qk_nope_head_dim": (0, 1 << 12),
    "qk_rope_head_dim": (1, 1 << 12),
    "v_head_dim": (1, 1 << 12),
    "n_shared_experts": (0, 1 << 14),
    "num_nextn_predict_layers": (0, 1024),
    # which layers are dense (their upper bound is the number of layers, checked below)
    "first_k_dense_replace": (0, 1024),
    "decoder_sparse_step": (1, 1024),
    "moe_layer_freq": (1, 1024),
}
MAX_LAYERS = LIMITS["num_layers"][1]
MAX_EXPERTS = LIMITS["num_experts"][1]


def _fail(where: str, message: str, hint: str = "is this a complete Hugging Face config.json "
          "of a MoE model?") -> CheckpointError:
    return CheckpointError(f"{where}: {message}", hint)


def check_shape(values: dict[str, Any], where: str, keys: dict[str, str] | None = None
                ) -> dict[str, Any]:
    """``values`` (normalised name -> the value the config gives; None: not given) checked:
    each an integer within :data:`LIMITS`, and together a model (top-k at most the experts,
    KV heads dividing the heads, a hidden size the heads divide when no head_dim is given,
    dense layers among the layers). Returns the values; a CheckpointError naming the
    config key (``keys``: normalised name -> the config's key) for the first problem."""
    keys = keys or {}

    def key(name: str) -> str:
        return keys.get(name, name)

    for name, value in values.items():
        if value is None:
            continue
        if name == "mlp_only_layers":
            _check_layer_list(value, values.get("num_layers"), where, key(name))
            continue
        lo, hi = LIMITS[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(where, f"{key(name)} must be an integer, not {value!r}"[:200])
        if not lo <= value <= hi:
            shown = str(value) if len(str(value)) < 40 else f"a {len(str(value))}-digit number"
            raise _fail(where, f"{key(name)} = {shown} is outside {lo}..{hi}",
                        "moepipe plans and converts models within these bounds")
    _relations(values, where, key)
    return values


def _check_layer_list(value: Any, layers: Any, where: str, name: str) -> None:
    if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise _fail(where, f"{name} must be a list of layer indices")
    top = layers if isinstance(layers, int) else MAX_LAYERS
    bad = [i for i in value if not 0 <= i < top]
    if bad:
        raise _fail(where, f"{name} holds layer {bad[0]}, outside 0..{top - 1}")


def _relations(v: dict[str, Any], where: str, key: Any) -> None:
    def given(*names: str) -> bool:
        return all(v.get(n) is not None for n in names)

    if given("top_k", "num_experts") and v["top_k"] > v["num_experts"]:
        raise _fail(where, f"{key('top_k')} {v['top_k']} exceeds the number of experts "
                           f"{v['num_experts']}")
    if given("num_kv_heads", "num_heads") and (v["num_kv_heads"] > v["num_heads"]
                                               or v["num_heads"] % v["num_kv_heads"]):
        raise _fail(where, f"{key('num_heads')} {v['num_heads']} is not a multiple of "
                           f"{key('num_kv_heads')} {v['num_kv_heads']}")
    if given("hidden_size", "num_heads") and v.get("head_dim") is None \
            and v["hidden_size"] % v["num_heads"]:
        raise _fail(where, f"{key('hidden_size')} {v['hidden_size']} is not divisible by "
                           f"{key('num_heads')} {v['num_heads']} (and no head_dim is given)")
    for name in ("first_k_dense_replace", "decoder_sparse_step", "moe_layer_freq"):
        if given(name, "num_layers") and v[name] > v["num_layers"]:
            raise _fail(where, f"{key(name)} {v[name]} exceeds {key('num_layers')} "
                               f"{v['num_layers']}")
