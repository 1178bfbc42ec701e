"""``trtllm-pytorch``: TensorRT-LLM's PyTorch backend (LLM API) in Triton's ``llmapi`` Python
model, loading the Hugging Face checkpoint; one tritonserver, TensorRT-LLM starts the ranks."""

from moepipe.targets.base import Target

TARGET = Target(
    name="trtllm-pytorch",
    served_by="TensorRT-LLM PyTorch backend",
    stages=("source", "inspect", "quantize", "quality"),
    artifact="hf",
    gpu=True,
    multi_node=False,  # one server process whose workers TensorRT-LLM starts on its node
    mpi_ranks=False,
    # the PyTorch backend's quantized linear layers (no SmoothQuant, no W4A8 AWQ)
    quant_formats=("none", "fp8", "int4_awq", "nvfp4"),
    kv_cache_formats=("none", "fp8"),
    image="triton",
    python_model=True,
    # TensorRT-LLM's LLM-API Python model registers no nv_trt_llm_* metrics.
    metrics=("triton", "triton-summaries", "triton-first-response", "triton-gpu",
             "moepipe-tokens"),
    attention_dp=True,
    expert_placement=True,
    expert_statistic=True,
    expert_counts="window",
    min_startup_s=900,
)
