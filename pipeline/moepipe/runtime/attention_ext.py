"""Attention features beyond the Llama-style block, used by the reference runtime per family.

* :func:`projection_qk_norm` - OLMoE's q/k RMSNorm over the whole projection (all heads), with
  the heads split over tensor-parallel ranks: each rank's sum of squares is all-reduced, as
  vLLM's all-gather before the norm does (``vllm/model_executor/models/olmoe.py``) - summed in
  the process that holds every rank, all-reduced among rank processes;
* :func:`window_mask` - sliding-window attention (GPT-OSS's ``sliding_attention`` layers);
* :func:`attend` - attention with per-head sink logits (GPT-OSS).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def projection_qk_norm(qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                       q_norms: list[torch.Tensor | None], k_norms: list[torch.Tensor | None],
                       num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                       tp: int | None = None,
                       reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """RMSNorm of q over all ``num_heads`` heads and of k over all ``num_kv_heads`` heads,
    given the (q, k, v) slices ``[T, heads_r * head_dim]`` of the ranks held here and their
    slices of each norm weight; ``reduce`` sums the squares over the ``tp`` ranks of other
    processes. When there are fewer KV heads than ranks, each KV head sits on
    ``tp / num_kv_heads`` ranks: its squares are counted once."""
    tp = tp or len(qkv)
    sq = torch.stack([torch.stack([q.float().pow(2).sum(-1) for q, _, _ in qkv]).sum(0),
                      torch.stack([k.float().pow(2).sum(-1) for _, k, _ in qkv]).sum(0)])
    if reduce is not None:
        sq = reduce(sq)  # one all-reduce for both
    q_sq, k_sq = sq[0][:, None], sq[1][:, None]
    dup = tp // num_kv_heads if num_kv_heads < tp else 1
    q_scale = torch.rsqrt(q_sq / (num_heads * head_dim) + eps)
    k_scale = torch.rsqrt(k_sq / (dup * num_kv_heads * head_dim) + eps)
    out = []
    for (q, k, v), qn, kn in zip(qkv, q_norms, k_norms, strict=True):
        if qn is None or kn is None:
            raise ValueError("a projection-wide q/k norm needs both norm weights")
        out.append((qn * (q.float() * q_scale), kn * (k.float() * k_scale), v))
    return out


def window_mask(mask: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """A causal ``mask`` [..., L] (keys 0..L-1) restricted to the last ``window`` positions
    before each query at ``q_pos`` [...]: key j is seen when ``j > q_pos - window``
    (transformers ``sliding_window_overlay``)."""
    if not window:
        return mask
    keys = torch.arange(mask.shape[-1])
    return mask & (keys > q_pos[..., None] - window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention (grouped-query); with ``sinks`` [heads] each head's softmax
    has one more logit, the sink, in its denominator (GPT-OSS). The sink is a zero key and value
    whose additive mask is the sink logit, so SDPA computes exactly
    ``softmax([q.k / sqrt(d), sink])[:-1] @ v``. ``q`` [..., heads, n, d], ``mask`` bool
    broadcastable to [..., heads, n, L]."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    zero = k.new_zeros((*k.shape[:-2], 1, k.shape[-1]))
    k, v = torch.cat([k, zero], dim=-2), torch.cat([v, zero], dim=-2)
    heads, n = q.shape[-3], q.shape[-2]
    bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    bias = bias.expand(*bias.shape[:-3], heads, n, bias.shape[-1])
    sink = sinks.to(q.dtype)[:, None, None].expand(heads, n, 1)
    bias = torch.cat([bias, sink.expand(*bias.shape[:-1], 1)], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
