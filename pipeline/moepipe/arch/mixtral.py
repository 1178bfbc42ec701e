"""Mixtral (``MixtralForCausalLM``) -> TensorRT-LLM LLaMA-class checkpoint."""

from moepipe.arch.common import ATTENTION, MODEL_RULES, llama_runtime_facts
from moepipe.arch.family import Family, Fixed
from moepipe.arch.rules import ExpertsDown, ExpertsGatedPair, ExpertSource, Router

_EXPERTS = ExpertSource(
    gate="model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
    up="model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
    down="model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
    # transformers 5 in-memory layout (renamed to mlp.*): gate_up [E, 2I, H], down [E, H, I]
    fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
    fused_down="model.layers.{layer}.mlp.experts.down_proj",
)

FAMILY = Family(
    hf_architecture="MixtralForCausalLM",
    trtllm_architecture="MixtralForCausalLM",
    trtllm_class="LLaMAForCausalLM",
    description="Mixtral: top-k routed SwiGLU experts, softmax over the selected k",
    layer_prefix="model.layers.{layer}.",
    layer_rules={
        **ATTENTION,
        "mlp.router.weight": Router("model.layers.{layer}.block_sparse_moe.gate.weight"),
        "mlp.fc.weight": ExpertsGatedPair(_EXPERTS),
        "mlp.proj.weight": ExpertsDown(_EXPERTS),
    },
    model_rules=MODEL_RULES,
    routing="renormalize",
    config_keys={"expert_intermediate_size": ("intermediate_size",),
                 "dense_intermediate_size": ("intermediate_size",)},
    trtllm_fields={
        "mlp_bias": Fixed(False),
        "attn_bias": "attention_bias",
        "rotary_base": "rope_theta",
        "rotary_scaling": Fixed(None),
        "residual_mlp": Fixed(False),
        "disable_weight_only_quant_plugin": Fixed(False),
        "remove_duplicated_kv_heads": Fixed(False),
        "fc_after_embed": Fixed(False),
        "use_input_layernorm_in_first_layer": Fixed(True),
        "use_last_layernorm": Fixed(True),
        "layer_idx_offset": Fixed(0),
        "embedding_multiplier": Fixed(1.0),
        "attention_multiplier": Fixed(1.0),
        "residual_multiplier": Fixed(1.0),
        "output_multiplier_scale": Fixed(1.0),
        "tie_word_embeddings": "tie_word_embeddings",
    },
    runtime_facts=llama_runtime_facts,
    expert_names=("w1", "w3", "w2"),
    # transformers 5 keeps the router as mlp.gate in memory (fused-expert layout).
    source_aliases={"model.layers.{layer}.block_sparse_moe.gate.weight":
                    "model.layers.{layer}.mlp.gate.weight"},
)
