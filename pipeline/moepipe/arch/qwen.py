"""Qwen2-MoE and Qwen3-MoE -> TensorRT-LLM QWen-class checkpoints."""

from moepipe.arch.common import ATTENTION, MLP_EXPERTS, MODEL_RULES, QK_NORM, qwen_runtime_facts
from moepipe.arch.family import Family, Fixed
from moepipe.arch.rules import ExpertsDown, ExpertsGatedPair, GatedPair, Router, Split

_MLP = "model.layers.{layer}.mlp."
_EXPERTS = MLP_EXPERTS

_MOE = {
    "mlp.router.weight": Router(_MLP + "gate.weight"),
    "mlp.fc.weight": ExpertsGatedPair(_EXPERTS),
    "mlp.proj.weight": ExpertsDown(_EXPERTS),
}

_SHARED_EXPERT = {
    "mlp.shared_expert.fc.weight": GatedPair(_MLP + "shared_expert.gate_proj.weight",
                                             _MLP + "shared_expert.up_proj.weight",
                                             "shared_expert_intermediate_size"),
    "mlp.shared_expert.proj.weight": Split(_MLP + "shared_expert.down_proj.weight", "hidden_size",
                                           "shared_expert_intermediate_size", dim=1),
    # [1, H], replicated, in the model dtype (TensorRT-LLM never quantises it).
    "mlp.shared_expert_gate.weight": Router(_MLP + "shared_expert_gate.weight", rows=1,
                                            float32=False),
}


def _qwen_fields(qwen_type: str) -> dict:
    return {
        "mlp_bias": Fixed(False),
        # TensorRT-LLM forces attn_bias from qwen_type; moepipe writes what the checkpoint has
        # so that a Qwen3 checkpoint with attention_bias=true keeps its biases.
        "attn_bias": "attention_bias",
        "rotary_base": "rope_theta",
        "rotary_scaling": Fixed(None),
        "disable_weight_only_quant_plugin": Fixed(False),
        "use_logn_attn": Fixed(False),
        "num_labels": Fixed(1),
        "seq_length": Fixed(8192),
        "qwen_type": Fixed(qwen_type),
        "moe_intermediate_size": "expert_intermediate_size",
        "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
        "tie_word_embeddings": "tie_word_embeddings",
    }


QWEN2_MOE = Family(
    hf_architecture="Qwen2MoeForCausalLM",
    trtllm_architecture="Qwen2MoeForCausalLM",
    trtllm_class="QWenForCausalLM",
    description="Qwen2-MoE: routed experts plus a sigmoid-gated shared expert, QKV bias",
    layer_prefix="model.layers.{layer}.",
    layer_rules={**ATTENTION, **_MOE, **_SHARED_EXPERT},
    model_rules=MODEL_RULES,
    routing="norm_topk_prob",
    config_keys={"expert_intermediate_size": ("moe_intermediate_size",),
                 "attention_bias": ("qkv_bias", "attention_bias")},
    config_defaults={"attention_bias": True},  # Qwen2 attention always has q/k/v biases
    trtllm_fields=_qwen_fields("qwen2_moe"),
    runtime_facts=qwen_runtime_facts,
)

QWEN3_MOE = Family(
    hf_architecture="Qwen3MoeForCausalLM",
    trtllm_architecture="Qwen3MoeForCausalLM",
    trtllm_class="QWenForCausalLM",
    description="Qwen3-MoE: routed experts, per-head q/k RMSNorm, no shared expert",
    layer_prefix="model.layers.{layer}.",
    layer_rules={**ATTENTION, **QK_NORM, **_MOE},
    model_rules=MODEL_RULES,
    routing="norm_topk_prob",
    config_keys={"expert_intermediate_size": ("moe_intermediate_size",)},
    trtllm_fields=_qwen_fields("qwen3_moe"),
    runtime_facts=qwen_runtime_facts,
)
