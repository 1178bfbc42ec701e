"""The TensorRT-LLM 1.2 network edit that puts moepipe's routing plugin into an engine, as data.

TensorRT-LLM 1.2's ``MixtureOfExperts.forward`` (``tensorrt_llm/layers/moe.py``) computes the
router logits with a float32 ``RowLinear`` (no bias), turns them into
``token_selected_experts`` int32 [T, k] and ``token_final_scales`` f32 [T, k] with functional
ops chosen by ``moe_config.normalization_mode`` (softmax/top-k, RENORMALIZE, DeepSeek-V2
group-limited, sparse mixer), and hands both to ``forward_experts`` (the ``MixtureOfExperts``
v1 plugin). The edit replaces exactly that middle step: router logits -> ``moepipe::moe_route``
(ahead-of-time PTX, no Python in the engine) -> ``forward_experts``. Everything else of the
layer (router GEMM, experts, all-reduce, LoRA, side streams) is TensorRT-LLM's own.

The per-expert counts stay inside the engine: TensorRT-LLM 1.2's executor returns extra engine
outputs only per request and per token (``OutputConfig.additionalModelOutputs``: [beams, x]
per step, [prompt, x] for the context), and its Triton backend never asks for them
(``triton_backend/inflight_batcher_llm/src/utils.cc`` ``getOutputConfigFromTensors``) nor
reports more than token totals as metrics (``model_instance_state.cc``
``reportCustomMetrics``), so a counts output cannot reach the server's metrics without
patching that C++ backend.
"""

from __future__ import annotations

from moepipe.arch.routing import RoutingSpec
from moepipe.plugins import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from moepipe.plugins.launch import launch_config
from moepipe.plugins.onnx_export import spec_attrs

WRAPPER = "moepipe-trtllm-build"
UPSTREAM_LAYER = "tensorrt_llm/layers/moe.py MixtureOfExperts.forward"
UPSTREAM_EXPERTS = "MixtureOfExperts.forward_experts(hidden_states, token_selected_experts, " \
                   "token_final_scales, lora_layer_params, side_stream_id)"


def routing_plan(spec: RoutingSpec, moe_layers: int) -> dict:
    """What the edit does to an engine routed by ``spec`` with ``moe_layers`` MoE layers."""
    config = launch_config(spec)
    mode = spec.trtllm_normalization_mode()
    return {
        "plugin": f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}", "plugin_version": PLUGIN_VERSION,
        "layers": moe_layers, "replaces": f"the routing of {UPSTREAM_LAYER}",
        "feeds": UPSTREAM_EXPERTS,
        "inputs": ["router logits f32 [T, E]", "router_bias f32 [E]",
                   "correction_bias f32 [E]"],
        "outputs": ["token_selected_experts i32 [T, k]", "token_final_scales f32 [T, k]",
                    "counts_partial i32 [P, E] (not an engine output)"],
        "attrs": spec_attrs(spec),
        "kernel": {"grid_x": config.num_programs, "block_x": config.num_warps * 32,
                   "block_t": config.block_t, "ptx": "compiled for the build GPU "
                   "(sm_80 / sm_90 / sm_100) by the plugin's aot_impl"},
        "trtllm_native_mode": None if mode is None else int(mode),
    }


def describe(plan: dict) -> str:
    """One line for ``moepipe build --dry-run``."""
    native = plan["trtllm_native_mode"]
    native = "none (only the plugin computes this routing)" if native is None else \
        f"normalization_mode {int(native)}"
    a = plan["attrs"]
    mode = (f"{a['score']}, top-{a['top_k']} of {a['num_experts']}"
            + (", top-k first" if a["topk_first"] else "")
            + (", renormalised" if a["renormalize"] else "")
            + (f", {a['topk_group']}/{a['n_group']} groups by {a['group_score']}"
               if a["n_group"] > 1 else "")
            + (", router bias" if a["has_router_bias"] else "")
            + (", correction bias" if a["has_correction_bias"] else "")
            + (f", x{a['routed_scaling_factor']:g}" if a["routed_scaling_factor"] != 1 else ""))
    k = plan["kernel"]
    return (f"{plan['plugin']} v{plan['plugin_version']} replaces the routing of "
            f"{plan['layers']} MoE layers ({mode}) -> forward_experts; kernel grid "
            f"{k['grid_x']} x {k['block_x']} threads, AOT PTX; TensorRT-LLM native: {native}")
