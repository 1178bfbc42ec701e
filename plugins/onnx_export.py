"""The MoE layer as an ONNX graph whose routing is one custom node.

The node is the form TensorRT's ONNX parser maps to a plugin: ``op_type`` = the plugin name
(``moe_route``), a string attribute ``plugin_namespace`` (``moepipe``) and ``plugin_version``,
and the routing mode as plain attributes. Its domain is ``ai.onnx.contrib``, where
onnxruntime-extensions registers Python custom ops, so onnxruntime runs the same graph on CPU
with :func:`register_onnxruntime_op` (the reference routing). The experts are standard ONNX
ops computing every expert densely (small layers; the output equals the sparse sum).

Node: inputs ``logits f32 [T, E], router_bias f32 [E], correction_bias f32 [E]`` (zeros when
the mode has none), outputs ``ids i32 [T, k], weights f32 [T, k], counts_partial i32 [P, E]``
- the kernel's own argument list; ``counts = ReduceSum(counts_partial, axis 0)`` follows it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moepipe.arch.routing import RoutingSpec
from moepipe.plugins import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION

DOMAIN = "ai.onnx.contrib"
OPSET = 18
# routing attributes: name -> (RoutingSpec field, kind). Flags are ints (TensorRT plugin
# fields and onnxruntime-extensions attributes have no bool); the same names are the
# TensorRT plugin's attributes.
ATTRS = {"num_experts": ("num_experts", "int"), "top_k": ("top_k", "int"),
         "score": ("score", "str"), "topk_first": ("topk_first", "flag"),
         "renormalize": ("renormalize", "flag"), "n_group": ("n_group", "int"),
         "topk_group": ("topk_group", "int"), "group_score": ("group_score", "str"),
         "routed_scaling_factor": ("routed_scaling_factor", "float"),
         "has_router_bias": ("router_bias", "flag"),
         "has_correction_bias": ("correction_bias", "flag")}
_CAST = {"int": int, "flag": int, "float": float, "str": str}


def spec_attrs(spec: RoutingSpec) -> dict:
    """The node (and plugin) attributes of ``spec``."""
    raw = spec.to_dict()
    return {name: _CAST[kind](raw[field]) for name, (field, kind) in ATTRS.items()}


def spec_from_attrs(attrs: dict) -> RoutingSpec:
    """The inverse of :func:`spec_attrs`."""
    fields: dict[str, Any] = {
        field: bool(int(attrs[name])) if kind == "flag" else _CAST[kind](attrs[name])
        for name, (field, kind) in ATTRS.items()}
    return RoutingSpec(**fields)


def routing_node(spec: RoutingSpec, inputs: list[str], outputs: list[str], name: str):
    """The custom routing node."""
    from onnx import helper

    return helper.make_node(PLUGIN_NAME, inputs, outputs, name=name, domain=DOMAIN,
                            plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION,
                            **spec_attrs(spec))


def moe_layer_model(spec: RoutingSpec, router: np.ndarray, fc: np.ndarray, proj: np.ndarray, *,
                    router_bias: np.ndarray | None = None,
                    correction_bias: np.ndarray | None = None):
    """An ONNX model of one MoE layer: ``hidden f32 [T, H] -> out f32 [T, H]`` plus the
    routing's ``ids``, ``weights`` and ``counts``. ``router`` [E, H]; ``fc`` [E, 2I, H] with
    rows [up | gate] and ``proj`` [E, H, I] (TensorRT-LLM's expert layout); SiLU-gated."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    e, h = router.shape
    inter = proj.shape[2]
    zeros = np.zeros(e, dtype=np.float32)
    init = [
        numpy_helper.from_array(np.ascontiguousarray(router.T, dtype=np.float32), "router_t"),
        numpy_helper.from_array((zeros if router_bias is None else router_bias)
                                .astype(np.float32), "router_bias"),
        numpy_helper.from_array((zeros if correction_bias is None else correction_bias)
                                .astype(np.float32), "correction_bias"),
        numpy_helper.from_array(fc.astype(np.float32), "fc"),
        numpy_helper.from_array(proj.astype(np.float32), "proj"),
        numpy_helper.from_array(np.array([inter, inter], dtype=np.int64), "split"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "axis0"),
        numpy_helper.from_array(np.array([e], dtype=np.int64), "num_experts"),
    ]
    nodes = [
        helper.make_node("MatMul", ["hidden", "router_t"], ["logits"]),
        routing_node(spec, ["logits", "router_bias", "correction_bias"],
                     ["ids", "weights", "counts_partial"], name="routing"),
        helper.make_node("ReduceSum", ["counts_partial", "axis0"], ["counts"], keepdims=0),
        # dense [T, E] routing weights: zero except the selected experts
        helper.make_node("Shape", ["hidden"], ["hidden_shape"], end=1),
        helper.make_node("Concat", ["hidden_shape", "num_experts"], ["dense_shape"], axis=0),
        helper.make_node("ConstantOfShape", ["dense_shape"], ["dense_zeros"],
                         value=numpy_helper.from_array(np.zeros(1, dtype=np.float32))),
        helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
        helper.make_node("ScatterElements", ["dense_zeros", "ids64", "weights"], ["dense"],
                         axis=1),
        helper.make_node("Einsum", ["hidden", "fc"], ["up_gate"], equation="th,efh->tef"),
        helper.make_node("Split", ["up_gate", "split"], ["up", "gate"], axis=2),
        helper.make_node("Sigmoid", ["gate"], ["gate_sig"]),
        helper.make_node("Mul", ["gate", "gate_sig"], ["gate_silu"]),
        helper.make_node("Mul", ["gate_silu", "up"], ["act"]),
        helper.make_node("Einsum", ["act", "proj"], ["expert_out"], equation="tei,ehi->teh"),
        helper.make_node("Einsum", ["expert_out", "dense"], ["out"], equation="teh,te->th"),
    ]
    graph = helper.make_graph(
        nodes, "moepipe_moe_layer",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", h])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", h]),
         helper.make_tensor_value_info("ids", TensorProto.INT32, ["T", spec.top_k]),
         helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["T", spec.top_k]),
         helper.make_tensor_value_info("counts", TensorProto.INT32, [e])],
        init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(DOMAIN, 1)],
                              producer_name="moepipe")
    onnx.checker.check_model(model, full_check=False)
    return model


_REGISTERED = False


def register_onnxruntime_op() -> None:
    """Register the routing node with onnxruntime-extensions (a Python custom op running the
    reference routing); sessions need ``onnxruntime_extensions.get_library_path()``."""
    global _REGISTERED
    if _REGISTERED:
        return
    import torch
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    from moepipe.runtime.routing import expert_counts, route

    kinds = {"int": PyCustomOpDef.dt_int64, "flag": PyCustomOpDef.dt_int64,
             "float": PyCustomOpDef.dt_float, "str": PyCustomOpDef.dt_string}
    attrs = {name: kinds[kind] for name, (_, kind) in ATTRS.items()}
    attrs.update(plugin_namespace=PyCustomOpDef.dt_string,
                 plugin_version=PyCustomOpDef.dt_string)

    @onnx_op(op_type=PLUGIN_NAME, inputs=[PyCustomOpDef.dt_float] * 3,
             outputs=[PyCustomOpDef.dt_int32, PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32],
             attrs=attrs)
    def _moe_route(logits, router_bias, correction_bias, **kw):
        spec = spec_from_attrs(kw)
        ids, weights = route(
            torch.from_numpy(np.asarray(logits, dtype=np.float32)), spec,
            router_bias=torch.from_numpy(router_bias) if spec.router_bias else None,
            correction_bias=torch.from_numpy(correction_bias) if spec.correction_bias else None)
        counts = expert_counts(ids, spec.num_experts)[None, :]
        return (ids.to(torch.int32).numpy(), weights.numpy(), counts.numpy())

    _REGISTERED = True


def run_onnxruntime(model, hidden: np.ndarray) -> dict:
    """Run ``model`` on CPU with onnxruntime and the registered custom op."""
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    register_onnxruntime_op()
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"hidden": hidden.astype(np.float32)}), strict=True))
