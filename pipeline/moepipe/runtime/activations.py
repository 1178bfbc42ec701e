"""The gated activations of the routed experts: ``act(gate, up)``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` (Mixtral, Qwen, DeepSeek, OLMoE)."""
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """GPT-OSS's SwiGLU (transformers ``GptOssExperts._apply_gate``): the gate clamped from
    above, the up projection from both sides, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_activation(cfg: dict[str, Any]) -> Activation:
    """The activation a checkpoint ``config.json`` asks for (``swiglu_limit``: GPT-OSS's)."""
    if cfg.get("swiglu_limit") is None:
        return swiglu
    return partial(clamped_swiglu, alpha=float(cfg.get("swiglu_alpha", 1.702)),
                   limit=float(cfg["swiglu_limit"]))
