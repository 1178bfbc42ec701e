"""``cpu``: moepipe's reference runtime (torch on CPU) in a Triton Python model, serving the
converted TensorRT-LLM checkpoint; the embedded default, started locally by ``moepipe deploy``."""

from moepipe.targets.base import Target

TARGET = Target(
    name="cpu",
    served_by="moepipe reference runtime",
    stages=("source", "inspect", "quantize", "convert", "quality"),
    artifact="checkpoint",
    gpu=False,
    multi_node=True,  # world size > 1: a rank group, one rank process per pod (moepipe.ranks)
    mpi_ranks=False,
    quant_formats=("none", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"),
    kv_cache_formats=("none", "fp8", "int8"),
    image="moepipe",
    python_model=True,
    metrics=("triton", "triton-summaries", "moepipe-cpu"),
    expert_counts="live",
    live_update=True,
)
