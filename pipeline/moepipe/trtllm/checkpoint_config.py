"""The ``config.json`` of a TensorRT-LLM checkpoint, as the pinned 1.2.x release reads it.

``PretrainedConfig``, ``MoeConfig``, ``QuantConfig`` and ``Mapping`` are rebuilt with
``cls(**dict)`` in TensorRT-LLM, so only keys that release knows are written.
"""

from __future__ import annotations

from typing import Any

from moepipe import __version__
from moepipe.arch.family import Family, Fixed
from moepipe.arch.spec import ModelSpec
from moepipe.checkpoints.modelopt import AWQ, SQ, QuantInfo
from moepipe.mapping import Mapping


def quant_block(quant_algo: str | None = None, kv_cache_quant_algo: str | None = None,
                **extra: Any) -> dict[str, Any]:
    block = {
        "quant_algo": quant_algo,
        "kv_cache_quant_algo": kv_cache_quant_algo,
        "group_size": 128,
        "smoothquant_val": 0.5,
        "clamp_val": None,
        "use_meta_recipe": False,
        "has_zero_point": False,
        "pre_quant_scale": False,
        "exclude_modules": None,
    }
    block.update(extra)
    return block


def quantization_block(info: QuantInfo) -> dict[str, Any]:
    """The ``quantization`` block of a quantized checkpoint's config.json (modelopt's
    unified checkpoint described by ``info``)."""
    kw: dict[str, Any] = {"exclude_modules": ["lm_head", "*router", "*shared_expert_gate",
                                              "*vocab_embedding"]}
    if info.algo == AWQ:
        kw.update(group_size=info.group_size, has_zero_point=False, pre_quant_scale=True)
    if info.algo == SQ:
        # No SmoothQuant MoE: the routed experts' block stays unquantized. TensorRT-LLM's
        # quantize_layers() re-creates an excluded MixtureOfExperts with QuantMode(0)
        # (tensorrt_llm/quantization/quantize.py); modelopt's exporter excludes `...mlp*`.
        kw["exclude_modules"] += ["*.mlp", "*.mlp.fc", "*.mlp.proj"]
    return quant_block(info.algo, info.kv_algo, **kw)


def build_config(family: Family, spec: ModelSpec, mapping: Mapping, dtype: str,
                 quantization: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architecture": family.trtllm_architecture,
        "dtype": dtype,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "hidden_act": "swiglu",
        "logits_dtype": "float32",
        "norm_epsilon": spec.rms_norm_eps,
        "runtime_defaults": None,
        "position_embedding_type": "rope_gpt_neox",
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.dense_intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "mapping": mapping.to_trtllm(),
        "quantization": quantization or quant_block(),
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "head_size": spec.head_dim,
        "qk_layernorm": "attention.q_layernorm.weight" in family.layer_rules,
        "rotary_embedding_dim": spec.head_dim,
    }
    for key, source in family.trtllm_fields.items():
        cfg[key] = source.value if isinstance(source, Fixed) else getattr(spec, source)
    cfg["moe"] = {
        "num_experts": spec.num_experts,
        "shared_expert_intermediate_size": 0,
        "top_k": spec.top_k,
        "normalization_mode": int(family.normalization_mode(spec)),
        "sparse_mixer_epsilon": 0.01,
        "tp_mode": 0,
        "device_limited_n_group": 0,
        "device_limited_topk_group": 0,
        "device_limited_routed_scaling_factor": 1.0,
    }
    family.finish_config(cfg, spec)
    cfg["producer"] = {"name": "moepipe", "version": __version__}
    return cfg
