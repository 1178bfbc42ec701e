"""Expert routing: one replaceable function from router logits to (experts, weights).

``route`` follows TensorRT-LLM's ``ExpertScaleNormalizationMode`` exactly, so what the reference
runtime computes is what a TensorRT-LLM engine built from the same ``config.json`` computes.
Custom kernels (OpenAI Triton, TensorRT plugins) implement this same contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moepipe.arch.routing import NormalizationMode
from moepipe.errors import UnsupportedError


@dataclass(frozen=True)
class RoutingSpec:
    num_experts: int
    top_k: int
    normalization_mode: NormalizationMode

    @classmethod
    def from_trtllm(cls, moe: dict) -> RoutingSpec:
        try:
            mode = NormalizationMode(int(moe["normalization_mode"]))
        except ValueError:
            raise UnsupportedError(f"moe.normalization_mode {moe['normalization_mode']} is not "
                                   "a TensorRT-LLM routing mode") from None
        spec = cls(int(moe["num_experts"]), int(moe["top_k"]), mode)
        if spec.normalization_mode not in (NormalizationMode.NONE, NormalizationMode.RENORMALIZE):
            raise UnsupportedError(
                f"moe.normalization_mode {spec.normalization_mode} is not implemented by the "
                "reference runtime", "supported: 0 (NONE) and 1 (RENORMALIZE)")
        return spec


RouteFn = Callable[[torch.Tensor, RoutingSpec], tuple[torch.Tensor, torch.Tensor]]


def route(logits: torch.Tensor, spec: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [tokens, experts] float32 -> (expert ids [tokens, k] int64, weights [tokens, k]
    float32).

    * NONE: softmax over all experts, then top-k; weights are the selected probabilities.
    * RENORMALIZE: top-k of the logits, then softmax over the k selected (= Mixtral, and Qwen3
      with ``norm_topk_prob``).
    """
    logits = logits.float()
    if spec.normalization_mode == NormalizationMode.RENORMALIZE:
        values, ids = torch.topk(logits, spec.top_k, dim=-1)
        return ids, torch.softmax(values, dim=-1)
    if spec.normalization_mode == NormalizationMode.NONE:
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        return ids, weights
    raise UnsupportedError(f"normalization_mode {spec.normalization_mode} is not implemented")
