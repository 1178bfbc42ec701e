"""Supported upstream versions, declared once (pin, don't sniff).

Stage code reads these constants; nothing probes installed packages with ``hasattr``.
"""

from __future__ import annotations

# TensorRT-LLM line whose checkpoint format / trtllm-build the `trtllm-engine` target emits.
# 1.2.x is the last stable line that still has the TensorRT engine flow.
TRTLLM_ENGINE_VERSION = "1.2.1"
# NGC Triton container that ships TRTLLM_ENGINE_VERSION (Triton 26.04-26.07 ship 1.2.1).
TRITON_TRTLLM_CONTAINER = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"

# Versions moepipe is tested with on CPU.
TESTED = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "nvidia-modelopt": "0.47.0",
    "nvidia-pytriton": "0.7.0",
    "tritonclient": "2.73.0",
}
