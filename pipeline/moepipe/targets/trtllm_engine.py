"""``trtllm-engine``: TensorRT engines (``trtllm-build``, TensorRT-LLM 1.2) behind the C++
``tensorrtllm`` backend, one tritonserver MPI rank per GPU."""

from moepipe.targets.base import Target

TARGET = Target(
    name="trtllm-engine",
    served_by="TensorRT-LLM engine",
    stages=("source", "inspect", "quantize", "convert", "quality", "engine"),
    artifact="engine",
    gpu=True,
    multi_node=True,  # the MPI ranks of one engine span nodes (LeaderWorkerSet)
    mpi_ranks=True,
    quant_formats=("none", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"),
    kv_cache_formats=("none", "fp8", "int8"),
    image="triton",
    python_model=False,
    metrics=("triton", "triton-summaries", "triton-first-response", "triton-gpu",
             "trtllm-backend"),
    min_startup_s=900,
)
