"""The reference routing (moepipe.runtime.routing) against each family's Hugging Face router.

Families come from the routing registry (``moepipe.arch.routing.HF_ROUTING``).

Every architecture in the routing registry is built here as its transformers router module
(a tiny random config, nothing downloaded) and must select the same experts with the same
weights as ``route`` with the spec derived from its config.
"""

import importlib

import pytest
import torch
import transformers

from moepipe.arch import REGISTRY
from moepipe.arch.routing import (
    DEVICE_LIMITED,
    DEVICE_LIMITED_RENORM,
    HF_ROUTING,
    NONE,
    RENORMALIZE,
    RoutingSpec,
    spec_from_hf,
)
from moepipe.errors import UnsupportedError
from moepipe.runtime.routing import expert_counts, route

# architectures[0] -> (config class, router module path, tiny config). Small but with every
# mode switched on: groups, norm_topk_prob, scaling factors, biases.
HF_ROUTERS = {
    "MixtralForCausalLM": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralTopKRouter",
                           dict(num_local_experts=8, num_experts_per_tok=2)),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
                            dict(num_experts=12, num_experts_per_tok=4, norm_topk_prob=False)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
                            dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)),
    "OlmoeForCausalLM": ("OlmoeConfig", "olmoe.modeling_olmoe.OlmoeTopKRouter",
                         dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)),
    "GptOssForCausalLM": ("GptOssConfig", "gpt_oss.modeling_gpt_oss.GptOssTopKRouter",
                          dict(num_local_experts=16, num_experts_per_tok=4)),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config",
                              "deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
                              dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                   topk_group=2, topk_method="group_limited_greedy",
                                   routed_scaling_factor=16.0)),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config",
                              "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
                              dict(n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                                   topk_group=2, routed_scaling_factor=2.5,
                                   norm_topk_prob=True)),
}


def hf_router(arch: str, seed: int = 0):
    """The transformers router module of ``arch`` with seeded random weights and biases."""
    config_cls, path, fields = HF_ROUTERS[arch]
    config = getattr(transformers, config_cls)(hidden_size=16, num_attention_heads=2,
                                               num_key_value_heads=2, **fields)
    module, cls = path.rsplit(".", 1)
    router = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in router.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        for _, b in router.named_buffers():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
    return config, router


def test_every_registered_router_has_a_transformers_check():
    assert set(HF_ROUTING) == set(HF_ROUTERS)


@pytest.mark.parametrize("arch", sorted(HF_ROUTING))
def test_route_matches_the_hugging_face_router(arch):
    config, router = hf_router(arch)
    spec = spec_from_hf(arch, config.to_dict())
    hidden = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_ids = router(hidden)
    biases = {}
    if spec.router_bias:
        biases["router_bias"] = router.bias.detach()
    if spec.correction_bias:
        biases["correction_bias"] = router.e_score_correction_bias
    ids, weights = route(hidden @ router.weight.detach().float().T, spec, **biases)
    # DeepSeek's routers return their k experts unsorted: compare per expert id
    hf_sorted, ours_sorted = hf_ids.sort(dim=1), ids.sort(dim=1)
    assert torch.equal(hf_sorted.values, ours_sorted.values)
    torch.testing.assert_close(weights.gather(1, ours_sorted.indices),
                               hf_weights.float().gather(1, hf_sorted.indices),
                               rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_ids_come_sorted_by_key():
    spec = RoutingSpec(6, 3)
    ids, _ = route(torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 3.0]]), spec)
    assert ids.tolist() == [[5, 1, 2]]


def test_group_limited_selection_masks_the_losing_groups():
    # groups {0,1} {2,3} {4,5}; sum of top-2 picks groups 1 and 2 although expert 0 is best
    spec = RoutingSpec(6, 2, score="sigmoid", n_group=3, topk_group=2, group_score="top2_sum",
                       correction_bias=True)
    logits = torch.tensor([[4.0, -4.0, 1.0, 1.0, 0.5, 0.5]])
    ids, _ = route(logits, spec, correction_bias=torch.zeros(6))
    assert sorted(ids[0].tolist()) == [2, 3]


def test_counts_count_every_selected_slot():
    ids = torch.tensor([[0, 2], [2, 1], [2, 0]])
    assert expert_counts(ids, 4).tolist() == [2, 1, 3, 0]


@pytest.mark.parametrize("mode,expected", [
    (NONE, RoutingSpec(8, 2)),
    (RENORMALIZE, RoutingSpec(8, 2, topk_first=True)),
    (DEVICE_LIMITED, RoutingSpec(8, 2, n_group=4, topk_group=2, routed_scaling_factor=2.0)),
    # TensorRT-LLM scales before it renormalises, so the factor cancels
    (DEVICE_LIMITED_RENORM, RoutingSpec(8, 2, renormalize=True, n_group=4, topk_group=2)),
])
def test_trtllm_modes(mode, expected):
    moe = {"num_experts": 8, "top_k": 2, "normalization_mode": mode,
           "device_limited_n_group": 4, "device_limited_topk_group": 2,
           "device_limited_routed_scaling_factor": 2.0}
    spec = RoutingSpec.from_trtllm(moe)
    assert spec == expected
    assert spec.trtllm_normalization_mode() == mode


def test_modes_the_trtllm_engine_path_lacks():
    for arch in ("GptOssForCausalLM", "DeepseekV3ForCausalLM"):
        config, _ = hf_router(arch)
        assert spec_from_hf(arch, config.to_dict()).trtllm_normalization_mode() is None


def test_checkpoint_config_prefers_moepipe_routing():
    spec = RoutingSpec(16, 4, score="sigmoid", correction_bias=True)
    cfg = {"moe": {"num_experts": 16, "top_k": 4, "normalization_mode": 1},
           "moepipe_routing": spec.to_dict()}
    assert RoutingSpec.from_checkpoint_config(cfg) == spec
    del cfg["moepipe_routing"]
    assert RoutingSpec.from_checkpoint_config(cfg) == RoutingSpec(16, 4, topk_first=True)


@pytest.mark.parametrize("fields,message", [
    (dict(num_experts=8, top_k=9), "top_k 9"),
    (dict(num_experts=8, top_k=2, n_group=3), "n_group 3"),
    (dict(num_experts=8, top_k=5, n_group=4, topk_group=2), "fewer than top_k"),
    (dict(num_experts=8, top_k=2, score="relu"), "score 'relu'"),
    (dict(num_experts=8, top_k=2, score="sigmoid", topk_first=True), "topk_first"),
])
def test_impossible_specs_are_refused(fields, message):
    with pytest.raises(UnsupportedError, match=message):
        RoutingSpec(**fields)


def test_biases_must_match_the_spec():
    with pytest.raises(UnsupportedError, match="biases"):
        route(torch.zeros(2, 8), RoutingSpec(8, 2, router_bias=True))
    with pytest.raises(UnsupportedError, match="unknown keys"):
        RoutingSpec.from_dict({"num_experts": 8, "top_k": 2, "jitter": 0.1})


@pytest.mark.parametrize("arch", sorted(REGISTRY))
def test_converted_routing_equals_the_hugging_face_routing(arch):
    """What the converter writes (TensorRT-LLM's moe section, or moepipe_routing where that
    cannot express the router) routes every registered family as its Hugging Face config does."""
    from moepipe.arch import get_family
    from moepipe.examples import EXAMPLES, family_examples
    from moepipe.mapping import Mapping
    from moepipe.trtllm.checkpoint_config import build_config

    example = EXAMPLES[family_examples()[arch]]
    hf_config = getattr(transformers, example.config_class)(**example.config).to_dict()
    family = get_family(arch)
    spec = family.spec({**hf_config, "architectures": [arch]}, "test")
    converted = RoutingSpec.from_checkpoint_config(
        build_config(family, spec, Mapping.create(), "float32"))
    logits = torch.randn(64, spec.num_experts, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(spec.num_experts, generator=torch.Generator().manual_seed(6)) * 0.1
    biases = {"correction_bias": bias} if converted.correction_bias else {}
    if converted.router_bias:  # GPT-OSS
        biases["router_bias"] = bias
    ids_c, w_c = route(logits, converted, **biases)
    ids_h, w_h = route(logits, spec_from_hf(arch, hf_config), **biases)
    assert torch.equal(ids_c, ids_h)
    torch.testing.assert_close(w_c, w_h, rtol=1e-6, atol=1e-6)
