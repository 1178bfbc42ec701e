"""Architecture registry, keyed by the exact Hugging Face ``architectures[0]`` string."""

from __future__ import annotations

from moepipe.arch.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from moepipe.arch.family import Family
from moepipe.arch.gpt_oss import GPT_OSS
from moepipe.arch.mixtral import FAMILY as MIXTRAL
from moepipe.arch.olmoe import OLMOE
from moepipe.arch.qwen import QWEN2_MOE, QWEN3_MOE
from moepipe.errors import UnsupportedError

REGISTRY: dict[str, Family] = {f.hf_architecture: f for f in (MIXTRAL, QWEN2_MOE, QWEN3_MOE,
                                                               DEEPSEEK_V2, DEEPSEEK_V3, OLMOE,
                                                               GPT_OSS)}

# TensorRT-LLM checkpoints record the same architecture string.
BY_TRTLLM: dict[str, Family] = {f.trtllm_architecture: f for f in REGISTRY.values()}


def supported() -> list[str]:
    return sorted(REGISTRY)


def get_family(architecture: str) -> Family:
    try:
        return REGISTRY[architecture]
    except KeyError:
        raise UnsupportedError(
            f"architecture '{architecture}' is not supported",
            f"supported architectures: {', '.join(supported())}") from None


def get_family_for_trtllm(architecture: str) -> Family:
    try:
        return BY_TRTLLM[architecture]
    except KeyError:
        raise UnsupportedError(
            f"TensorRT-LLM checkpoint architecture '{architecture}' is not supported",
            f"supported: {', '.join(sorted(BY_TRTLLM))}") from None
