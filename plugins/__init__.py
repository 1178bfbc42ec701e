"""moepipe's custom MoE plugins: one fused routing kernel for every MoE family (OpenAI Triton)
and its bindings - TensorRT (quickly deployable plugin), ONNX (one custom node) and PyTorch
(``torch.library`` custom op)."""

# The Triton release the kernel is built and tested with (also pinned in pyproject.toml).
TRITON_VERSION = "3.7.1"
PLUGIN_NAME = "moe_route"
PLUGIN_NAMESPACE = "moepipe"
PLUGIN_VERSION = "1"
