"""Rules shared by the Llama-style families (attention, embeddings, final norm)."""

from __future__ import annotations

from typing import Any

from moepipe.arch.family import RuntimeFacts
from moepipe.arch.rules import QKV, ExpertSource, Replicated, Split, VocabSplit

_ATTN = "model.layers.{layer}.self_attn."

ATTENTION = {
    "input_layernorm.weight": Replicated("model.layers.{layer}.input_layernorm.weight"),
    "attention.qkv.weight": QKV(_ATTN + "q_proj.weight", _ATTN + "k_proj.weight",
                                _ATTN + "v_proj.weight"),
    "attention.qkv.bias": QKV(_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias",
                              bias=True, when="attention_bias"),
    "attention.dense.weight": Split(_ATTN + "o_proj.weight", "hidden_size", "attn_width", dim=1),
    "post_layernorm.weight": Replicated("model.layers.{layer}.post_attention_layernorm.weight"),
}

# Routed experts as Qwen-MoE, OLMoE and DeepSeek store them (mlp.experts.{e}.{gate,up,down}_proj;
# transformers 5's fused in-memory layout as the alternative).
_MLP = "model.layers.{layer}.mlp."
MLP_EXPERTS = ExpertSource(
    gate=_MLP + "experts.{expert}.gate_proj.weight",
    up=_MLP + "experts.{expert}.up_proj.weight",
    down=_MLP + "experts.{expert}.down_proj.weight",
    fused_gate_up=_MLP + "experts.gate_up_proj",
    fused_down=_MLP + "experts.down_proj",
)

QK_NORM = {
    "attention.q_layernorm.weight": Replicated(_ATTN + "q_norm.weight", dims=("head_dim",)),
    "attention.k_layernorm.weight": Replicated(_ATTN + "k_norm.weight", dims=("head_dim",)),
}

MODEL_RULES = {
    "transformer.vocab_embedding.weight": (
        "first", Replicated("model.embed_tokens.weight", dims=("vocab_size", "hidden_size"))),
    "transformer.ln_f.weight": ("last", Replicated("model.norm.weight")),
    "lm_head.weight": ("last", VocabSplit("lm_head.weight", tied="model.embed_tokens.weight")),
}


def llama_runtime_facts(cfg: dict[str, Any]) -> RuntimeFacts:
    """LLaMAForCausalLM (Mixtral): qk norm and shared experts only through generic fields."""
    return RuntimeFacts(qk_norm=bool(cfg.get("qk_layernorm", False)),
                        shared_expert_intermediate_size=int(
                            cfg.get("moe", {}).get("shared_expert_intermediate_size", 0)),
                        attn_bias=bool(cfg.get("attn_bias", False)))


def qwen_runtime_facts(cfg: dict[str, Any]) -> RuntimeFacts:
    """QWenForCausalLM: ``qwen_type`` decides q/k norms (qwen3*) and the shared expert
    (qwen2_moe, sized by ``moe_shared_expert_intermediate_size``)."""
    qwen_type = cfg.get("qwen_type")
    shared = (int(cfg.get("moe_shared_expert_intermediate_size", 0))
              if qwen_type == "qwen2_moe" else 0)
    return RuntimeFacts(qk_norm=qwen_type in ("qwen3", "qwen3_moe"),
                        shared_expert_intermediate_size=shared,
                        attn_bias=bool(cfg.get("attn_bias", True)))
