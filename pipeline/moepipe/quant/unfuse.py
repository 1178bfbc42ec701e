"""transformers 5 keeps a MoE layer's experts as fused 3-D parameters. modelopt smooths (AWQ,
SmoothQuant), calibrates per expert and exports only per-expert ``nn.Linear`` modules, so the
quantize stage swaps the fused block for a list of experts with the checkpoint's own names
(Mixtral ``w1/w3/w2``, Qwen ``gate_proj/up_proj/down_proj``). Same call signature, same math.
"""

from __future__ import annotations

import torch
from torch import nn


class _Expert(nn.Module):
    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int, act):
        super().__init__()
        self._names = names  # (gate, up, down)
        setattr(self, names[0], nn.Linear(hidden, inter, bias=False))
        setattr(self, names[1], nn.Linear(hidden, inter, bias=False))
        setattr(self, names[2], nn.Linear(inter, hidden, bias=False))
        self.act_fn = act

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self._names)
        return down(self.act_fn(gate(x)) * up(x))


class UnfusedExperts(nn.ModuleList):
    """Drop-in for a transformers-5 fused experts module: ``forward(hidden, top_k_index,
    top_k_weights)``."""

    def __init__(self, fused: nn.Module, names: tuple[str, str, str], copy: bool = True):
        gate_up: torch.Tensor = fused.gate_up_proj  # type: ignore[assignment]
        down: torch.Tensor = fused.down_proj  # type: ignore[assignment]
        num, two_inter, hidden = gate_up.shape
        inter = two_inter // 2
        super().__init__([_Expert(names, hidden, inter, fused.act_fn) for _ in range(num)])
        self.num_experts = num
        if not copy:
            return
        with torch.no_grad():  # fused gate_up_proj: gate rows first, then up
            for e, expert in enumerate(list(self.children())):
                getattr(expert, names[0]).weight.copy_(gate_up[e, :inter])
                getattr(expert, names[1]).weight.copy_(gate_up[e, inter:])
                getattr(expert, names[2]).weight.copy_(down[e])

    @classmethod
    def like(cls, fused: nn.Module, names: tuple[str, str, str]) -> UnfusedExperts:
        """The same experts with uninitialized weights (on the current default device: the
        meta device before layer-by-layer quantization loads them)."""
        return cls(fused, names, copy=False)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel():
                y = self[e](hidden_states[tok]) * top_k_weights[tok, slot, None]
                out.index_add_(0, tok, y.to(out.dtype))
        return out


def unfuse_experts(model: nn.Module, names: tuple[str, str, str]) -> int:
    """Replace every fused experts module of ``model``; returns how many were replaced."""
    count = 0
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and isinstance(
                getattr(experts, "gate_up_proj", None), torch.Tensor):
            module.experts = UnfusedExperts(experts, names)
            count += 1
    return count
