"""``moepipe-trtllm-build``: ``trtllm-build`` with moepipe's routing plugin in every MoE layer.

Runs TensorRT-LLM's own ``trtllm-build`` entry point in this process after (1) registering the
``moepipe::moe_route`` TensorRT plugin and (2) replacing the routing step of TensorRT-LLM 1.2's
``MixtureOfExperts.forward`` as ``plugins.trtllm_plan`` describes. Thin by design: TensorRT-LLM
exists only in NVIDIA's container; here it fails with one clear line.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

from moepipe.arch.routing import RoutingSpec
from moepipe.errors import EnvironmentMissing, MoepipeError, UnsupportedError


def _checkpoint_routing(argv: list[str]) -> RoutingSpec:
    path = Path(argv[argv.index("--checkpoint_dir") + 1]) / "config.json"
    return RoutingSpec.from_checkpoint_config(json.loads(path.read_text()))


def patch_moe_layer(spec: RoutingSpec) -> None:
    """Route every ``MixtureOfExperts`` of the network being built through the plugin."""
    import numpy as np
    import tensorrt as trt
    import tensorrt.plugin as trtp
    from tensorrt_llm.functional import _create_tensor, cast, constant, default_trtnet
    from tensorrt_llm.layers import moe

    from moepipe.plugins.trt_plugin import plugin_attrs, register

    if "token_selected_experts" not in inspect.signature(moe._moe_plugin).parameters:
        raise UnsupportedError("this TensorRT-LLM routes inside its MoE plugin",
                               "moepipe's routing plugin needs TensorRT-LLM 1.2")
    register()
    original = moe.MixtureOfExperts.forward
    zeros = np.zeros(spec.num_experts, dtype=np.float32)

    def forward(self, hidden_states, lora_layer_params=None, all_reduce_params=None,
                last_local_layer_residual=None, side_stream_id=moe.SideStreamIDType.disable,
                static_routing_input=None):
        if self.static_routing or lora_layer_params is not None \
                or side_stream_id != moe.SideStreamIDType.disable:
            return original(self, hidden_states, lora_layer_params, all_reduce_params,
                            last_local_layer_residual, side_stream_id, static_routing_input)
        logits = self.router(cast(hidden_states, trt.float32), None)
        bias = constant(zeros)
        layer = default_trtnet().add_plugin(
            trtp.op.moepipe.moe_route(logits.trt_tensor, bias.trt_tensor, bias.trt_tensor,
                                      **plugin_attrs(spec)), aot=True)
        ids = _create_tensor(layer.get_output(0), layer)
        weights = _create_tensor(layer.get_output(1), layer)
        output = self.forward_experts(hidden_states, ids, weights, None, side_stream_id)
        if self.use_all_reduce:
            output = self.forward_allreduce(output, all_reduce_params, last_local_layer_residual)
        return output

    moe.MixtureOfExperts.forward = forward


def main(argv: list[str] | None = None) -> int:
    """Entry point: the same arguments as ``trtllm-build``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            from tensorrt_llm.commands import build
        except ImportError:
            raise EnvironmentMissing("TensorRT-LLM is not installed: moepipe-trtllm-build "
                                     "cannot build an engine here",
                                     "run it inside NVIDIA's TensorRT-LLM 1.2 container") from None
        spec = _checkpoint_routing(argv)
        if spec.router_bias or spec.correction_bias:
            raise UnsupportedError("TensorRT-LLM 1.2's engine models have no router or "
                                   "correction bias weights to feed the plugin",
                                   "serve this model with the trtllm-pytorch or cpu target")
        patch_moe_layer(spec)
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    sys.argv = ["trtllm-build", *argv]
    return build.main() or 0


if __name__ == "__main__":
    raise SystemExit(main())
