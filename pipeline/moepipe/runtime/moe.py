"""The expert FFNs of a MoE layer on the reference runtime, rank by rank: the routed experts
of each rank's EP group on its slice of the expert FFN (TensorRT-LLM's fused ``fc`` = up|gate
and ``proj``), and the shared expert split over tp. Routing itself is
:func:`moepipe.runtime.routing.route_op`; :class:`moepipe.runtime.model.ReferenceModel` picks
the dense or the sparse form by work size (same result)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from moepipe.runtime.weights import Layer, RankLayer

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> hidden


def experts_sparse(x: torch.Tensor, layer: Layer, ids: torch.Tensor, weights: torch.Tensor,
                   counts: torch.Tensor, act: Activation) -> torch.Tensor:
    """One loop over the selected experts: each expert's tokens gathered, run, scattered back
    with their routing weights (``counts``: tokens per expert, from the router)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // ids.shape[1]
    weight_of = weights.reshape(-1)[order]
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    out = torch.zeros_like(x)
    for w in layer.ranks:
        for local, expert in enumerate(w.experts):
            start, stop = offsets[expert], offsets[expert + 1]
            if start == stop:
                continue
            idx = token_of[start:stop]
            h1 = w.quant("fc", x[idx]) @ w.fc[local].T
            up, gate = (h1 if w.fc_bias is None else h1 + w.fc_bias[local]).chunk(2, dim=-1)
            y = w.quant("proj", act(gate, up)) @ w.proj[local].T
            if w.proj_bias is not None:
                y = y + w.proj_bias[local]
            out.index_add_(0, idx, y * weight_of[start:stop, None])
        shared_expert(x, layer, w, out)
    return out


def experts_dense(x: torch.Tensor, layer: Layer, ids: torch.Tensor, weights: torch.Tensor,
                  num_experts: int, act: Activation) -> torch.Tensor:
    """Every local expert on every token in two matmuls; unselected experts get weight 0
    (same result as the loop; far fewer operations when the layer is small)."""
    dense = torch.zeros(x.shape[0], num_experts).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for w in layer.ranks:
        e_loc, inter = w.fc.shape[0], w.fc.shape[1] // 2
        y = w.quant("fc", x) @ w.fc_flat.T
        if w.fc_bias is not None:
            y = y + w.fc_bias.reshape(-1)
        y = y.view(-1, e_loc, 2, inter)
        hidden = w.quant("proj", act(y[:, :, 1], y[:, :, 0]))
        mine = dense[:, w.experts.start:w.experts.stop]
        out += (hidden * mine[:, :, None]).reshape(x.shape[0], -1) @ w.proj_flat
        if w.proj_bias is not None:  # sum over experts of weight * bias
            out += mine @ w.proj_bias
        shared_expert(x, layer, w, out)
    return out


def shared_expert(x: torch.Tensor, layer: Layer, w: RankLayer, out: torch.Tensor) -> None:
    """Add rank ``w``'s slice of the shared expert (SwiGLU; sigmoid-gated where the layer has
    a gate: Qwen2-MoE) to ``out``."""
    if w.shared_fc is not None and w.shared_proj is not None:
        up, gate = (w.quant("shared_fc", x) @ w.shared_fc.T).chunk(2, dim=-1)
        shared = w.quant("shared_proj", F.silu(gate) * up) @ w.shared_proj.T
        if layer.shared_gate is not None:  # Qwen2-MoE gates it; DeepSeek does not
            shared = torch.sigmoid(x @ layer.shared_gate.T) * shared
        out += shared
