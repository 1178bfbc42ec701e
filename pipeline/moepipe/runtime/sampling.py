"""Token sampling with TensorRT-LLM's semantics: greedy when temperature is 0 or top_k is 1;
otherwise temperature, then top-k, then top-p (nucleus), with a per-request seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from one row of logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float()
    best = scores.max()
    if not torch.isfinite(best):
        raise ValueError("no token can be sampled: the logits are NaN or every token is "
                         "excluded")
    # The best score goes to 0 before dividing: a tiny temperature then sends every other
    # score to -inf (greedy in the limit) instead of overflowing to inf, and inf - inf = NaN.
    scores = (scores - best) / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
