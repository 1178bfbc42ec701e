"""TensorRT-LLM's routing modes: the one encoding moepipe uses for ``moe.normalization_mode``.

``ExpertScaleNormalizationMode`` of TensorRT-LLM 1.2 (``tensorrt_llm/layers/moe.py``); the value
is what the checkpoint's ``config.json`` carries.
"""

from __future__ import annotations

from enum import IntEnum


class NormalizationMode(IntEnum):
    NONE = 0  # softmax over all experts, then top-k
    RENORMALIZE = 1  # top-k of the logits, then softmax over the k selected
    SPARSE_MIXER = 2
    DEVICE_LIMITED = 3  # DeepSeek-V2 group-limited greedy
    DEVICE_LIMITED_RENORM = 4

    @property
    def description(self) -> str:
        """What the mode computes, for people (inspect)."""
        return {0: "softmax -> top-k (NONE)", 1: "top-k -> softmax (RENORMALIZE)",
                2: "sparse mixer (SPARSE_MIXER)", 3: "group-limited (DEVICE_LIMITED)",
                4: "group-limited, renormalised (DEVICE_LIMITED_RENORM)"}[int(self)]
