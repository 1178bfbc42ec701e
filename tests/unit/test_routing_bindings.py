"""The routing kernel's bindings: the torch custom op (the runtime routes through it), the ONNX
export (one custom node TensorRT maps to the plugin, run by onnxruntime), the TensorRT plugin
layer and the TensorRT-LLM engine plan (thin where TensorRT is missing)."""

import ast
import inspect

import numpy as np
import pytest
import torch

from moepipe.arch.routing import RoutingSpec
from moepipe.errors import EnvironmentMissing
from moepipe.plugins import PLUGIN_NAME, PLUGIN_NAMESPACE
from moepipe.runtime.routing import expert_counts, op_args, route, route_op

V3 = RoutingSpec(16, 4, score="sigmoid", renormalize=True, n_group=4, topk_group=2,
                 group_score="top2_sum", routed_scaling_factor=2.5, correction_bias=True)


def test_torch_op_is_the_reference_with_counts():
    logits = torch.randn(11, 16, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(1)) - 0.5
    ids, weights, counts = route_op(logits, V3, correction_bias=bias)
    ids_r, w_r = route(logits, V3, correction_bias=bias)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ids_r)
    assert torch.equal(weights, w_r)
    assert torch.equal(counts, expert_counts(ids_r, 16)) and int(counts.sum()) == 11 * 4


def test_torch_op_schema_and_fake_implementation():
    logits, bias = torch.randn(5, 16), torch.randn(16)
    torch.library.opcheck(torch.ops.moepipe.route.default, (logits, None, bias, *op_args(V3)),
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ids, weights, counts = route_op(torch.empty(7, 16), V3, correction_bias=torch.empty(16))
    assert (ids.shape, weights.shape, counts.shape) == ((7, 4), (7, 4), (16,))
    assert (ids.dtype, weights.dtype, counts.dtype) == (torch.int32, torch.float32, torch.int32)


@pytest.fixture(scope="module")
def mixtral(examples, tmp_path_factory):
    from moepipe.conversion.write import convert
    from moepipe.runtime.checkpoint import load_checkpoint
    from moepipe.runtime.model import ReferenceModel

    out = tmp_path_factory.mktemp("routing") / "ckpt"
    convert(examples["tiny-mixtral"], out)
    return ReferenceModel(load_checkpoint(out))


def test_runtime_routes_through_the_op_and_counts_every_token(mixtral):
    from moepipe.runtime.model import Batch

    assert mixtral.route is route_op
    before = mixtral.expert_tokens.clone()
    prompt = [5, 17, 300, 41, 9, 77]
    mixtral.forward(Batch.single(prompt))
    added = mixtral.expert_tokens - before
    assert added.sum(dim=1).tolist() == [len(prompt) * mixtral.ckpt.routing.top_k] * \
        mixtral.ckpt.num_layers


def test_onnx_moe_layer_matches_the_runtime_layer(mixtral):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime_extensions")
    from moepipe.plugins.onnx_export import DOMAIN, moe_layer_model, run_onnxruntime

    layer = mixtral.layers[0]
    rank = layer.ranks[0]
    model = moe_layer_model(mixtral.ckpt.routing, layer.router.numpy(), rank.fc.numpy(),
                            rank.proj.numpy())
    onnx.checker.check_model(model, full_check=True)
    (node,) = [n for n in model.graph.node if n.domain == DOMAIN]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    # TensorRT's ONNX parser: op_type = plugin name, plugin_namespace / plugin_version attrs
    assert node.op_type == PLUGIN_NAME and attrs["plugin_namespace"] == PLUGIN_NAMESPACE.encode()
    assert attrs["plugin_version"] == b"1"
    hidden = torch.randn(9, mixtral.hidden, generator=torch.Generator().manual_seed(3))
    out = run_onnxruntime(model, hidden.numpy())
    ref = mixtral._moe(hidden, layer)
    np.testing.assert_allclose(out["out"], ref.numpy(), atol=1e-5)
    ids, _ = route(hidden @ layer.router.T, mixtral.ckpt.routing)
    assert np.array_equal(out["ids"], ids.numpy()) and out["ids"].dtype == np.int32
    assert np.array_equal(out["counts"], expert_counts(ids, 8).numpy())


def test_onnx_node_carries_every_routing_mode():
    pytest.importorskip("onnx")
    from moepipe.plugins.onnx_export import moe_layer_model, run_onnxruntime

    gen = torch.Generator().manual_seed(4)
    router, fc, proj = (torch.randn(16, 8, generator=gen), torch.randn(16, 12, 8, generator=gen),
                        torch.randn(16, 8, 6, generator=gen))
    bias = torch.randn(16, generator=gen)
    model = moe_layer_model(V3, router.numpy(), fc.numpy(), proj.numpy(),
                            correction_bias=bias.numpy())
    hidden = torch.randn(5, 8, generator=gen)
    out = run_onnxruntime(model, hidden.numpy())
    ids, weights = route(hidden @ router.T, V3, correction_bias=bias)
    assert np.array_equal(out["ids"], ids.numpy())
    np.testing.assert_allclose(out["weights"], weights.numpy(), atol=1e-6)


def test_tensorrt_plugin_fails_with_one_line_without_tensorrt():
    pytest.importorskip("onnx")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    from moepipe.plugins.trt_plugin import register

    with pytest.raises(EnvironmentMissing) as err:
        register()
    assert "\n" not in str(err.value) and "TensorRT" in str(err.value)


def test_tensorrt_plugin_attributes_are_the_onnx_node_attributes():
    """TensorRT hands the ONNX node's attributes to the plugin by name: the register, aot_impl
    and impl functions take exactly those (after the three input tensors)."""
    from moepipe.plugins import trt_plugin
    from moepipe.plugins.onnx_export import ATTRS

    tree = ast.parse(inspect.getsource(trt_plugin))
    functions = {f.name: [a.arg for a in f.args.args] for f in ast.walk(tree)
                 if isinstance(f, ast.FunctionDef) and f.name in ("_desc", "_aot", "_impl")}
    assert set(functions) == {"_desc", "_aot", "_impl"}
    for args in functions.values():
        assert args[:3] == ["logits", "router_bias", "correction_bias"]
        assert [a for a in args[3:] if a not in ("outputs", "stream", "tactic")] == list(ATTRS)


def test_trtllm_build_wrapper_fails_with_one_line_without_tensorrt_llm(capsys):
    from moepipe.plugins.trtllm_build import main

    assert main(["--checkpoint_dir", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: TensorRT-LLM is not installed") and err.count("\n") == 1


def test_engine_dry_run_shows_the_routing_plugin(tmp_path):
    """build.plugins.router: moepipe builds with moepipe-trtllm-build and the dry run shows
    the plugin's edit of the engine."""
    import yaml

    from moepipe.commands.build import run_build

    path = tmp_path / "moepipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"example": "tiny-qwen3-moe"}, "target": "trtllm-engine",
        "build": {"plugins": {"router": "moepipe"}}, "workdir": str(tmp_path / "work")}))
    lines = []
    plan = run_build(path, echo=lines.append, dry_run=True)
    engine = plan["stages"][-1]
    assert engine["stage"] == "engine" and engine["command"][0] == "moepipe-trtllm-build"
    text = "\n".join(lines)
    assert "routing plugin: moepipe::moe_route v1 replaces the routing of" in text
    assert "-> forward_experts" in text and "AOT PTX" in text
    assert not (tmp_path / "work").exists()


def test_engine_plan_data():
    from moepipe.plugins.trtllm_plan import describe, routing_plan

    plan = routing_plan(V3, moe_layers=58)
    assert plan["plugin"] == "moepipe::moe_route" and plan["layers"] == 58
    assert plan["trtllm_native_mode"] is None  # sigmoid + correction bias: only the plugin
    assert plan["attrs"]["has_correction_bias"] == 1 and plan["attrs"]["score"] == "sigmoid"
    line = describe(plan)
    assert "sigmoid, top-4 of 16, renormalised, 2/4 groups by top2_sum, correction bias, x2.5" \
        in line and "TensorRT-LLM native: none" in line
