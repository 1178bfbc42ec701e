"""Attention features beyond the Llama-style block, used by the reference runtime per family.

* :func:`projection_qk_norm` - OLMoE's q/k RMSNorm over the whole projection (all heads), with
  the heads split over tensor-parallel ranks: each rank's sum of squares is all-reduced, as
  vLLM's all-gather before the norm does (``vllm/model_executor/models/olmoe.py``).
"""

from __future__ import annotations

import torch


def projection_qk_norm(qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                       q_norms: list[torch.Tensor | None], k_norms: list[torch.Tensor | None],
                       num_heads: int, num_kv_heads: int, head_dim: int,
                       eps: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """RMSNorm of q over all ``num_heads`` heads and of k over all ``num_kv_heads`` heads,
    given each rank's (q, k, v) slices ``[T, heads_r * head_dim]`` and its slice of each norm
    weight. When there are fewer KV heads than ranks, each KV head sits on ``tp / num_kv_heads``
    ranks: its squares are counted once."""
    tp = len(qkv)
    q_sq = torch.stack([q.float().pow(2).sum(-1) for q, _, _ in qkv]).sum(0)[:, None]
    k_sq = torch.stack([k.float().pow(2).sum(-1) for _, k, _ in qkv]).sum(0)[:, None]
    dup = tp // num_kv_heads if num_kv_heads < tp else 1
    q_scale = torch.rsqrt(q_sq / (num_heads * head_dim) + eps)
    k_scale = torch.rsqrt(k_sq / (dup * num_kv_heads * head_dim) + eps)
    out = []
    for (q, k, v), qn, kn in zip(qkv, q_norms, k_norms, strict=True):
        if qn is None or kn is None:
            raise ValueError("a projection-wide q/k norm needs both norm weights")
        out.append((qn * (q.float() * q_scale), kn * (k.float() * k_scale), v))
    return out
