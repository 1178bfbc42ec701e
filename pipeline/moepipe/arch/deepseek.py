"""DeepSeek-V2 and DeepSeek-V3 -> the TensorRT-LLM 1.2 ``DeepseekV2ForCausalLM`` checkpoint layout.

Names, fusions and shards follow TensorRT-LLM 1.2's own converter
(``tensorrt_llm/models/deepseek_v2/convert.py`` ``load_weights_from_hf_model``; config keys from
``deepseek_v2/config.py`` ``DeepSeekV2Config.from_hugging_face``):

* multi-head latent attention: ``attention.fused_a`` = ``[q_a_proj; kv_a_proj_with_mqa]``
  (only ``kv_a_proj_with_mqa`` when ``q_lora_rank`` is null, V2-Lite), replicated;
  ``attention.q_b_proj`` (``q_proj`` when ``q_lora_rank`` is null) split by heads;
  ``attention.kv_b_proj`` split by heads and re-laid out as ``[k_nope rows; v rows]``;
  ``attention.fused_q_proj`` = per head ``[W_UK^T W_UQ_nope; W_UQ_rope]`` (the absorbed query);
  ``attention.dense`` = ``o_proj`` row-parallel; the a-layernorms replicated;
* the first ``first_k_dense_replace`` layers are dense gated MLPs in TensorRT-LLM's GatedMLP
  names: ``mlp.fc`` <- ``gate_proj``, ``mlp.gate`` <- ``up_proj``, ``mlp.proj`` <- ``down_proj``;
* MoE layers: routed experts as for the other families, the shared experts as one ungated
  ``mlp.shared_expert`` (``fc = [up; gate]``), the router in float32 and, for DeepSeek-V3's
  ``noaux_tc`` routing, ``mlp.e_score_correction_bias``.

DeepSeek-V3 uses the same layout; TensorRT-LLM 1.2 has no engine for it, so its checkpoints
serve the cpu target only (``trtllm-engine`` refuses it; ``trtllm-pytorch`` serves the Hugging
Face checkpoint itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from moepipe.arch.bounds import check_shape
from moepipe.arch.common import MLP_EXPERTS, MODEL_RULES
from moepipe.arch.family import Family, Fixed, RuntimeFacts
from moepipe.arch.mla import ATTN, KVB, QB, DeepseekSpec, FusedA, FusedQ
from moepipe.arch.routing import NormalizationMode, RoutingSpec, spec_from_hf
from moepipe.arch.rules import (
    ExpertsDown,
    ExpertsGatedPair,
    GatedPair,
    Replicated,
    Router,
    Rule,
    Split,
)
from moepipe.arch.spec import ModelSpec
from moepipe.errors import CheckpointError, UnsupportedError

_MLP = "model.layers.{layer}.mlp."
_ATTN = ATTN

_EXPERTS = MLP_EXPERTS

_COMMON = {
    "input_layernorm.weight": Replicated("model.layers.{layer}.input_layernorm.weight"),
    "post_layernorm.weight": Replicated("model.layers.{layer}.post_attention_layernorm.weight"),
    "attention.fused_a.weight": FusedA(),
    "attention.kv_a_layernorm.weight": Replicated(_ATTN + "kv_a_layernorm.weight",
                                                  dims=("kv_lora_rank",)),
    "attention.q_a_layernorm.weight": Replicated(_ATTN + "q_a_layernorm.weight",
                                                 dims=("q_lora_rank",), when="q_lora_rank"),
    "attention.fused_q_proj": FusedQ(),
    "attention.q_b_proj": QB(),
    "attention.kv_b_proj": KVB(),
    "attention.dense.weight": Split(_ATTN + "o_proj.weight", "hidden_size", "o_in", dim=1),
}

MOE_RULES: dict[str, Rule] = {
    **_COMMON,
    "mlp.router.weight": Router(_MLP + "gate.weight"),
    "mlp.fc.weight": ExpertsGatedPair(_EXPERTS),
    "mlp.proj.weight": ExpertsDown(_EXPERTS),
    "mlp.shared_expert.fc.weight": GatedPair(_MLP + "shared_experts.gate_proj.weight",
                                             _MLP + "shared_experts.up_proj.weight",
                                             "shared_expert_intermediate_size",
                                             when="shared_expert_intermediate_size"),
    "mlp.shared_expert.proj.weight": Split(_MLP + "shared_experts.down_proj.weight",
                                           "hidden_size", "shared_expert_intermediate_size", dim=1,
                                           when="shared_expert_intermediate_size"),
}

DENSE_RULES: dict[str, Rule] = {
    **_COMMON,
    # TensorRT-LLM GatedMLP: fc is the activated input (gate_proj), gate multiplies (up_proj)
    "mlp.fc.weight": Split(_MLP + "gate_proj.weight", "dense_intermediate_size", "hidden_size",
                           dim=0),
    "mlp.gate.weight": Split(_MLP + "up_proj.weight", "dense_intermediate_size", "hidden_size",
                             dim=0),
    "mlp.proj.weight": Split(_MLP + "down_proj.weight", "hidden_size", "dense_intermediate_size",
                             dim=1),
}

CORRECTION_BIAS = {
    "mlp.e_score_correction_bias": Replicated(_MLP + "gate.e_score_correction_bias",
                                              dims=("num_experts",), float32=True),
}


@dataclass(frozen=True)
class DeepseekFamily(Family):
    """A family whose first ``first_k_dense_replace`` layers are dense and whose attention is
    MLA; the spec carries the extra dimensions (:class:`DeepseekSpec`)."""

    dense_rules: dict[str, Rule] = field(default_factory=dict)

    def spec(self, hf_config: dict[str, Any], where: str) -> ModelSpec:
        _check_deepseek(hf_config, where)
        rope_scaling = _yarn(hf_config, where)
        if rope_scaling is not None:  # the generic checks refuse rope scaling: yarn is ours
            hf_config = {k: v for k, v in hf_config.items() if k != "rope_scaling"}
            hf_config["rope_parameters"] = {**(hf_config.get("rope_parameters") or {}),
                                            "rope_type": "default"}
        base = super().spec(hf_config, where)
        routing = spec_from_hf(self.hf_architecture, hf_config)
        mla = mla_numbers(hf_config, where, base.num_layers)
        n_shared = mla.pop("n_shared_experts")
        mtp = mla.pop("num_nextn_predict_layers")
        extra: dict[str, Any] = {**mla, "routing": routing.to_dict(),
                                 "rope_scaling": rope_scaling, "mtp_layers": mtp}
        values: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(ModelSpec)}
        values.update(shared_expert_intermediate_size=n_shared * base.expert_intermediate_size,
                      head_dim=extra["qk_rope_head_dim"])
        return DeepseekSpec(**values, **extra)

    def engine_problem(self, spec: ModelSpec) -> str | None:
        """TensorRT-LLM 1.2's deepseek_v2/model.py builds MoE for ``layer_idx > 0`` (one dense
        layer) and reads the yarn keys of ``rotary_scaling`` unconditionally."""
        if self.no_engine or not isinstance(spec, DeepseekSpec):
            return self.no_engine
        if spec.first_k_dense_replace != 1:
            return (f"TensorRT-LLM 1.2's DeepseekV2 engine model has exactly one dense layer "
                    f"(deepseek_v2/model.py: MoE when layer_idx > 0); this model has "
                    f"first_k_dense_replace {spec.first_k_dense_replace}")
        y = spec.rope_scaling
        if y is None or any(y.get(k) is None for k in _YARN_KEYS):
            return ("TensorRT-LLM 1.2's DeepseekV2 engine model reads the yarn rotary_scaling "
                    "keys (beta_fast, beta_slow, mscale, mscale_all_dim, ...) unconditionally "
                    "(deepseek_v2/model.py); this model has no complete yarn rope scaling")
        return None

    def dropped_for(self, spec: ModelSpec) -> tuple[str, ...]:
        """DeepSeek-V3's multi-token-prediction layers (``model.layers.{num_layers + i}``), which
        transformers and TensorRT-LLM's checkpoint do not load."""
        mtp = spec.mtp_layers if isinstance(spec, DeepseekSpec) else 0
        if not mtp:
            return self.dropped
        layers = "|".join(str(spec.num_layers + i) for i in range(mtp))
        return (*self.dropped, rf"model\.layers\.({layers})\.")

    def rules_for(self, spec: ModelSpec, layer: int) -> dict[str, Rule]:
        if isinstance(spec, DeepseekSpec) and layer < spec.first_k_dense_replace:
            return self.dense_rules
        return self.layer_rules

    def normalization_mode(self, spec: ModelSpec) -> NormalizationMode:
        mode = _routing(spec).trtllm_normalization_mode()
        # noaux_tc has no engine mode; TensorRT-LLM's own config writes DEVICE_LIMITED for it
        return NormalizationMode.DEVICE_LIMITED if mode is None else mode

    def finish_config(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        """TensorRT-LLM 1.2 ``DeepSeekV2Config`` keys (``from_hugging_face``) and the ``moe``
        block's DeepSeek fields; ``moepipe_routing`` where the engine cannot route (V3)."""
        if not isinstance(spec, DeepseekSpec):
            return
        routing = spec.routing_spec
        cfg.update({
            "num_key_value_heads": 1,
            "head_size": spec.kv_lora_rank + spec.qk_rope_head_dim,
            "rotary_embedding_dim": spec.qk_rope_head_dim,
            "qk_layernorm": False,
            "moe_inter_size": spec.expert_intermediate_size,
            "kv_lora_rank": spec.kv_lora_rank,
            "q_lora_rank": spec.q_lora_rank or None,
            "qk_nope_head_dim": spec.qk_nope_head_dim,
            "qk_rope_head_dim": spec.qk_rope_head_dim,
            "v_head_dim": spec.v_head_dim,
            "topk_method": "noaux_tc" if routing.correction_bias else (
                "group_limited_greedy" if routing.n_group > 1 else "greedy"),
            "first_k_dense_replace": spec.first_k_dense_replace,
            "moe_layer_freq": 1,
            "coring_func": routing.score,  # sic: TensorRT-LLM's key for scoring_func
            "fp8_format": False,
            "rotary_scaling": spec.rope_scaling,
        })
        cfg["moe"].update({
            "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
            "device_limited_n_group": routing.n_group,
            "device_limited_topk_group": routing.topk_group,
            "device_limited_routed_scaling_factor": routing.routed_scaling_factor,
        })
        if routing.trtllm_normalization_mode() is None:
            cfg["moepipe_routing"] = routing.to_dict()


def _routing(spec: ModelSpec) -> RoutingSpec:
    if isinstance(spec, DeepseekSpec):
        return spec.routing_spec
    raise UnsupportedError(f"{spec.architecture}: not a DeepSeek spec")


_YARN_KEYS = ("beta_fast", "beta_slow", "factor", "mscale", "mscale_all_dim",
              "original_max_position_embeddings")


def _yarn(cfg: dict[str, Any], where: str) -> dict[str, Any] | None:
    """The checkpoint's YaRN scaling as TensorRT-LLM's ``rotary_scaling`` (deepseek_v2/config.py:
    the six keys plus ``type: yarn``); None for plain RoPE."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: rope_scaling must be a mapping, not {rope!r}"[:200])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise UnsupportedError(f"{where}: rope scaling {kind!r} is not supported for DeepSeek",
                               "DeepSeek models use yarn (or plain RoPE)")
    if rope.get("attention_factor") is not None or rope.get("truncate") is False:
        raise UnsupportedError(f"{where}: yarn with attention_factor / truncate: false is not "
                               "supported", "TensorRT-LLM's DeepSeek yarn has neither")
    out = {k: rope.get(k) for k in _YARN_KEYS}
    if out["original_max_position_embeddings"] is None:
        raise UnsupportedError(f"{where}: yarn without original_max_position_embeddings",
                               "the checkpoint's rope scaling is incomplete")
    check_shape({"max_position_embeddings": cfg.get("max_position_embeddings"),
                 "original_max_position_embeddings": out["original_max_position_embeddings"]},
                where)
    if out["factor"] is None:  # transformers: max_position_embeddings / the original
        out["factor"] = cfg["max_position_embeddings"] / out["original_max_position_embeddings"]
    out.update(beta_fast=out["beta_fast"] or 32, beta_slow=out["beta_slow"] or 1, type="yarn")
    return out


def mla_numbers(cfg: dict[str, Any], where: str, layers: int) -> dict[str, int]:
    """DeepSeek's own numbers (latent attention ranks and head dims, dense layers, shared
    experts), checked by :func:`moepipe.arch.bounds.check_shape`; unset optional ones are 0."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if cfg.get(key) is None:
            raise CheckpointError(f"{where}: missing '{key}'",
                                  "is this a complete DeepSeek config.json?")
    values = {k: cfg.get(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                      "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
                                      "n_shared_experts", "moe_layer_freq",
                                      "num_nextn_predict_layers")}
    check_shape({**values, "num_layers": layers}, where)
    return {k: v or 0 for k, v in values.items() if k != "moe_layer_freq"}


def _check_deepseek(cfg: dict[str, Any], where: str) -> None:
    freq = cfg.get("moe_layer_freq") or 1
    if freq != 1:
        raise UnsupportedError(f"{where}: moe_layer_freq {freq} is not supported",
                               "moepipe converts DeepSeek models whose layers after "
                               "first_k_dense_replace are all MoE (moe_layer_freq: 1)")
    if cfg.get("rope_interleave") is False:
        raise UnsupportedError(f"{where}: rope_interleave false is not supported",
                               "DeepSeek checkpoints rotate interleaved pairs (the default)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedError(f"{where}: attention or MLP biases are not supported for DeepSeek",
                               "TensorRT-LLM's DeepSeek-V2 model has none")
    if cfg.get("topk_method") not in (None, "greedy", "group_limited_greedy", "noaux_tc"):
        raise UnsupportedError(f"{where}: topk_method {cfg.get('topk_method')!r} is not supported",
                               "supported: greedy, group_limited_greedy, noaux_tc")


def deepseek_runtime_facts(cfg: dict[str, Any]) -> RuntimeFacts:
    """DeepseekV2ForCausalLM: MLA, no q/k norm, ungated shared experts sized by the moe block."""
    return RuntimeFacts(qk_norm=False,
                        shared_expert_intermediate_size=int(
                            cfg.get("moe", {}).get("shared_expert_intermediate_size", 0)),
                        attn_bias=False, shared_expert_gate=False)


_KEYS = {"num_experts": ("n_routed_experts", "num_local_experts", "num_experts"),
         "expert_intermediate_size": ("moe_intermediate_size",),
         "dense_intermediate_size": ("intermediate_size",),
         # MLA: the nominal KV head count is the query head count (moepipe shards by heads)
         "num_kv_heads": ("num_attention_heads",),
         # MLA: heads are as wide as their dims say, not hidden_size / heads (the spec's
         # head_dim is the rotary part, as TensorRT-LLM's)
         "head_dim": ("qk_rope_head_dim",)}

_FIELDS: dict[str, str | Fixed] = {
    "mlp_bias": Fixed(False),
    "attn_bias": Fixed(False),
    "rotary_base": "rope_theta",
    "rotary_scaling": Fixed(None),
    "residual_mlp": Fixed(False),
    "disable_weight_only_quant_plugin": Fixed(False),
    "remove_duplicated_kv_heads": Fixed(False),
    "fc_after_embed": Fixed(False),
    "use_input_layernorm_in_first_layer": Fixed(True),
    "use_last_layernorm": Fixed(True),
    "layer_idx_offset": Fixed(0),
}

DEEPSEEK_V2 = DeepseekFamily(
    hf_architecture="DeepseekV2ForCausalLM",
    trtllm_architecture="DeepseekV2ForCausalLM",
    trtllm_class="DeepseekV2ForCausalLM",
    description="DeepSeek-V2: multi-head latent attention, dense first layers, shared experts, "
                "group-limited softmax routing",
    layer_prefix="model.layers.{layer}.",
    layer_rules=MOE_RULES,
    dense_rules=DENSE_RULES,
    model_rules=MODEL_RULES,
    routing="deepseek",
    config_keys=_KEYS,
    trtllm_fields=_FIELDS,
    runtime_facts=deepseek_runtime_facts,
    quantizable=False,
)

DEEPSEEK_V3 = replace(
    DEEPSEEK_V2,
    hf_architecture="DeepseekV3ForCausalLM",
    trtllm_architecture="DeepseekV3ForCausalLM",
    description="DeepSeek-V3: multi-head latent attention, dense first layers, shared expert, "
                "sigmoid noaux_tc routing with e_score_correction_bias (no TensorRT-LLM 1.2 "
                "engine: cpu and trtllm-pytorch targets)",
    layer_rules={**MOE_RULES, **CORRECTION_BIAS},
    no_engine="TensorRT-LLM 1.2 has no DeepSeek-V3 engine model: trtllm-build makes no "
              "DeepSeek-V3 engines (only its preview `deepseek` branch does), and its engine MoE "
              "cannot route noaux_tc (sigmoid scores, e_score_correction_bias) without a router "
              "plugin",
)
