"""Every HF tensor is mapped or explicitly dropped; every TensorRT-LLM tensor is produced; and
full-size models plan to the expected rank shapes without any weights (meta device)."""

import pytest
import torch
from meta_reader import MetaReader
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from moepipe.arch import get_family
from moepipe.arch.hf import open_hf_checkpoint
from moepipe.checkpoints.reader import CheckpointReader
from moepipe.conversion.plan import plan_conversion, unmapped_tensors
from moepipe.examples import family_examples
from moepipe.mapping import Mapping

FAMILIES = list(family_examples().values())  # one example per registered family

# TensorRT-LLM's per-layer parameter names for each family (models/{llama,qwen}/model.py).
LAYER_TENSORS = {
    "tiny-mixtral": {"input_layernorm.weight", "post_layernorm.weight", "attention.qkv.weight",
                     "attention.dense.weight", "mlp.router.weight", "mlp.fc.weight",
                     "mlp.proj.weight"},
}
LAYER_TENSORS["tiny-qwen2-moe"] = LAYER_TENSORS["tiny-mixtral"] | {
    "attention.qkv.bias", "mlp.shared_expert.fc.weight", "mlp.shared_expert.proj.weight",
    "mlp.shared_expert_gate.weight"}
LAYER_TENSORS["tiny-qwen3-moe"] = LAYER_TENSORS["tiny-mixtral"] | {
    "attention.q_layernorm.weight", "attention.k_layernorm.weight"}
# OLMoE (no TensorRT-LLM model): the same names, its q/k norms span the whole projection
LAYER_TENSORS["tiny-olmoe"] = LAYER_TENSORS["tiny-qwen3-moe"]
# GPT-OSS (TensorRT-LLM serves it on the PyTorch backend only): biases, sinks
LAYER_TENSORS["tiny-gpt-oss"] = LAYER_TENSORS["tiny-mixtral"] | {
    "attention.qkv.bias", "attention.dense.bias", "attention.sinks", "mlp.router.bias",
    "mlp.fc.bias", "mlp.proj.bias"}
# DeepSeek (TensorRT-LLM 1.2 tensorrt_llm/models/deepseek_v2/convert.py load_weights_from_hf_model):
# MLA names without a .weight suffix where upstream writes them so (fused_q_proj, q_b_proj,
# kv_b_proj); dense layers (index < first_k_dense_replace) are GatedMLPs (fc, gate, proj).
_MLA = {"input_layernorm.weight", "post_layernorm.weight", "attention.fused_a.weight",
        "attention.kv_a_layernorm.weight", "attention.fused_q_proj", "attention.q_b_proj",
        "attention.kv_b_proj", "attention.dense.weight"}
_DS_DENSE = _MLA | {"mlp.fc.weight", "mlp.gate.weight", "mlp.proj.weight"}
_DS_MOE = _MLA | {"mlp.router.weight", "mlp.fc.weight", "mlp.proj.weight",
                  "mlp.shared_expert.fc.weight", "mlp.shared_expert.proj.weight"}
_V3 = {"attention.q_a_layernorm.weight"}  # q_lora_rank set (the V2 example has none)
DEEPSEEK_LAYERS = {  # first_k_dense_replace = 1 in both examples
    "tiny-deepseek-v2": (_DS_DENSE, _DS_MOE),
    "tiny-deepseek-v3": (_DS_DENSE | _V3, _DS_MOE | _V3 | {"mlp.e_score_correction_bias"}),
}


def expected_layer(family: str, layer: int) -> set[str]:
    """The TensorRT-LLM tensors of global decoder layer ``layer``."""
    if family in DEEPSEEK_LAYERS:
        dense, moe = DEEPSEEK_LAYERS[family]
        return dense if layer < 1 else moe
    return LAYER_TENSORS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_mapped_and_produced(family, examples):
    ckpt = open_hf_checkpoint(examples[family])
    with CheckpointReader(ckpt.path) as reader:
        plan = plan_conversion(ckpt.family, ckpt.spec, Mapping.create(tp=2, pp=2, moe_ep=2),
                               "float32", reader)
        assert unmapped_tensors(plan, reader.tensors, ckpt.family) == []
        assert plan.sources == set(reader.tensors)
    for rank, tensors in enumerate(plan.ranks):
        names = {t.name for t in tensors}
        layers = plan.mapping.pp_layers(ckpt.spec.num_layers, rank)
        for local, layer in enumerate(layers):
            prefix = f"transformer.layers.{local}."
            per_layer = {n.removeprefix(prefix) for n in names if n.startswith(prefix)}
            assert per_layer == expected_layer(family, layer)
        first, last = rank // 2 == 0, rank // 2 == 1
        assert ("transformer.vocab_embedding.weight" in names) == first
        assert ("lm_head.weight" in names) == last and ("transformer.ln_f.weight" in names) == last
        assert {int(n.split(".")[2]) for n in names if n.startswith("transformer.layers.")} \
            == set(range(len(layers)))


def _meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


MIXTRAL_8X7B = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             num_local_experts=8, num_experts_per_tok=2,
                             max_position_embeddings=32768, rope_theta=1e6)
QWEN3_30B_A3B = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                               moe_intermediate_size=768, num_hidden_layers=48,
                               num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                               max_position_embeddings=40960, rope_theta=1e6)


def _plan(config, **mapping):
    model = _meta(config)
    spec = get_family(config.architectures[0]).spec(config.to_dict(), "meta")
    family = get_family(config.architectures[0])
    reader = MetaReader(model)
    plan = plan_conversion(family, spec, Mapping.create(**mapping), "bfloat16", reader)
    assert unmapped_tensors(plan, reader.shapes, family) == []
    return plan


def _shapes(plan, rank):
    return {t.name: t.shape for t in plan.ranks[rank]}


def test_mixtral_8x7b_shapes_on_meta_device():
    MIXTRAL_8X7B.architectures = ["MixtralForCausalLM"]
    plan = _plan(MIXTRAL_8X7B, tp=4, pp=2, moe_ep=2)
    s = _shapes(plan, 0)
    assert s["transformer.layers.0.attention.qkv.weight"] == ((32 + 2 * 8) * 128 // 4, 4096)
    assert s["transformer.layers.0.attention.dense.weight"] == (4096, 1024)
    assert s["transformer.layers.0.mlp.fc.weight"] == (4, 2 * 14336 // 2, 4096)
    assert s["transformer.layers.0.mlp.proj.weight"] == (4, 4096, 14336 // 2)
    assert s["transformer.layers.0.mlp.router.weight"] == (8, 4096)
    assert s["transformer.vocab_embedding.weight"] == (32000, 4096)
    assert "lm_head.weight" not in s and len([n for n in s if n.endswith("qkv.weight")]) == 16
    last = _shapes(plan, 7)
    assert last["lm_head.weight"] == (8000, 4096)
    assert "transformer.layers.15.mlp.fc.weight" in last
    dtypes = {t.name: t.dtype for t in plan.ranks[0]}
    assert dtypes["transformer.layers.0.mlp.router.weight"].name == "F32"
    assert dtypes["transformer.layers.0.mlp.fc.weight"].name == "BF16"
    # 46.7B parameters in all, ~87 GB of bf16 weights across the 8 ranks
    total = sum(plan.rank_bytes(r) for r in range(8))
    assert 85e9 < total < 95e9


def test_qwen3_30b_a3b_shapes_on_meta_device():
    QWEN3_30B_A3B.architectures = ["Qwen3MoeForCausalLM"]
    plan = _plan(QWEN3_30B_A3B, tp=8, moe_ep=8)
    s = _shapes(plan, 3)
    # 4 KV heads over tp=8: each rank gets one duplicated KV head
    assert s["transformer.layers.0.attention.qkv.weight"] == ((32 // 8 + 2) * 128, 2048)
    assert s["transformer.layers.0.attention.dense.weight"] == (2048, 512)
    assert s["transformer.layers.0.attention.q_layernorm.weight"] == (128,)
    assert s["transformer.layers.0.mlp.fc.weight"] == (16, 2 * 768, 2048)
    assert s["transformer.layers.0.mlp.proj.weight"] == (16, 2048, 768)
    assert s["transformer.layers.0.mlp.router.weight"] == (128, 2048)
    assert s["lm_head.weight"] == (151936 // 8, 2048)
    assert plan.config()["moe"]["normalization_mode"] == 1
