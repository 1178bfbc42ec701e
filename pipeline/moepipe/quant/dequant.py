"""Quantized TensorRT-LLM tensors -> what the reference runtime computes with.

Weights are dequantized once at load (fake quantization); activations and the KV cache are
quantized and dequantized on the fly with the checkpoint's static scales, as the engine does.
So the cpu target serves - and the quality stage measures - exactly the quantized model that
would be deployed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moepipe.quant.trtllm import AWQ, FP8, FP8_MAX, GROUP, SQ


@dataclass(frozen=True)
class ActQuant:
    """Static per-tensor activation quantization: fp8 (e4m3) or int8, after an optional
    SmoothQuant pre-quant scale (x * prescale, as TensorRT-LLM's Int8SmoothQuantLinear)."""

    kind: str  # "fp8" | "int8"
    scale: float
    prescale: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prescale is not None:
            x = x * self.prescale
        if self.kind == "fp8":
            q = (x / self.scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return q.to(x.dtype) * self.scale
        return torch.clamp(torch.round(x / self.scale), -128, 127) * self.scale


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., out/2, in] with two int4 rows per byte (low nibble = even row) ->
    integer values [..., out, in] in [-8, 7]."""
    p = packed.view(torch.uint8).to(torch.int16)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    lo = torch.where(lo >= 8, lo - 16, lo)
    hi = torch.where(hi >= 8, hi - 16, hi)
    q = torch.stack([lo, hi], dim=-2)
    return q.reshape(*p.shape[:-2], p.shape[-2] * 2, p.shape[-1])


def linear(tensors: dict[str, torch.Tensor], prefix: str, algo: str | None
           ) -> tuple[torch.Tensor, ActQuant | None]:
    """(float32 weight, activation quantizer) of the linear layer ``prefix``."""
    w = tensors[f"{prefix}.weight"]
    expert = w.dim() == 3
    if algo == FP8 and w.dtype == torch.float8_e4m3fn:
        scale = tensors[f"{prefix}.weights_scaling_factor"].float()
        weight = w.float() * (scale.reshape(-1, 1, 1) if expert else scale.reshape(()))
        act = float(tensors[f"{prefix}.activation_scaling_factor"].reshape(-1)[0])
        return weight, ActQuant("fp8", act)
    if algo == AWQ and f"{prefix}.weights_scaling_factor" in tensors:
        q = unpack_int4(w).float()
        scale = tensors[f"{prefix}.weights_scaling_factor"].float()
        weight = q * scale.repeat_interleave(GROUP, dim=-1)
        pqs = tensors[f"{prefix}.prequant_scaling_factor"].float()
        # (x * pqs) @ W.T == x @ (W * pqs).T
        return weight * pqs.unsqueeze(-2), None
    if algo == SQ and f"{prefix}.weights_scaling_factor" in tensors:
        weight = w.float() * tensors[f"{prefix}.weights_scaling_factor"].float().reshape(-1, 1)
        act = float(tensors[f"{prefix}.activation_scaling_factor"].reshape(-1)[0])
        prescale = tensors[f"{prefix}.prequant_scaling_factor"].float().reshape(-1)
        return weight, ActQuant("int8", act, prescale)
    return w.float(), None


def kv_quant(tensors: dict[str, torch.Tensor], prefix: str, kv_algo: str | None
             ) -> ActQuant | None:
    """The KV cache's quantizer: keys and values are stored quantized with one scale."""
    if kv_algo is None:
        return None
    scale = float(tensors[f"{prefix}kv_cache_scaling_factor"].reshape(-1)[0])
    return ActQuant("fp8" if kv_algo == "FP8" else "int8", scale)
