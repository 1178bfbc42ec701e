"""Bytes of weights one GPU holds: per-rank tensor shapes x the quantization format.

Formats (what each stores per GEMM weight ``[out, in]`` of a rank; everything that is not a
GEMM weight - norms, embedding, ``lm_head``, routers - stays in the model dtype, routers and the
routing bias in float32), following the TensorRT-LLM checkpoint tensors moepipe's converter
writes (``moepipe.quant.trtllm``) and DeepSeek's published FP8 checkpoint:

=========  ===================================================================================
none       ``out x in`` x dtype bytes
fp8        1 byte per weight; ``weights_scaling_factor`` and ``activation_scaling_factor``
           float32 scalars (one per expert for stacked experts)
fp8_block  1 byte per weight; one float32 ``weight_scale_inv`` per 128 x 128 block (DeepSeek-V3)
int4_awq   (and w4a8_awq) half a byte per weight; float32 scales per 128 inputs ``[out, in/128]``; a
           pre-quant scale per input in the model dtype
int8_sq    1 byte per weight plus float32 per-channel scales ``[out]``, one activation scale
           and a smoothing scale per input in the model dtype; routed experts stay in the model
           dtype (TensorRT-LLM has no SmoothQuant MoE)
nvfp4      half a byte per weight; one FP8 scale per 16 weights; two float32 scalars
=========  ===================================================================================

fp8, int4_awq and int8_sq equal the converter's quantized plans byte for byte
(tests/unit/test_plan.py); fp8_block and nvfp4 follow the published layouts (DeepSeek-V3's
checkpoint, modelopt's NVFP4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moepipe.checkpoints.dtypes import itemsize
from moepipe.errors import ConfigError
from moepipe.mapping import stage_layers
from moepipe.sizing.shapes import ModelShape, Tensor

FORMATS = ("none", "fp8", "fp8_block", "int4_awq", "w4a8_awq", "int8_sq", "nvfp4")
AWQ_GROUP = 128
FP8_BLOCK = 128
NVFP4_BLOCK = 16


@dataclass(frozen=True)
class Sharding:
    """How one GPU's slice is cut: the mapping, plus attention data parallelism."""

    tp: int
    pp: int
    moe_tp: int
    moe_ep: int
    attention_dp: bool = False

    @property
    def attn_tp(self) -> int:
        return 1 if self.attention_dp else self.tp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


def rank_shape(t: Tensor, s: Sharding) -> tuple[int, tuple[int, ...]]:
    """(matrices, shape of each) that one rank holds of ``t``."""
    shape = t.shape
    if t.split is None:
        return 1, shape
    if t.split == "heads_rows":
        return 1, (shape[0] // s.attn_tp, *shape[1:])
    if t.split == "heads_cols":
        return 1, (shape[0], shape[1] // s.attn_tp)
    if t.split == "qkv_rows":  # q heads / tp; K and V: ceil(kv/tp) heads each
        q = shape[0] - 2 * t.kv_heads * t.head_dim
        kv = math.ceil(t.kv_heads / s.attn_tp) * 2 * t.head_dim
        return 1, (q // s.attn_tp + kv, *shape[1:])
    if t.split == "kv_rows":  # K (or V) rows alone: ceil(kv/tp) heads (OLMoE's k norm)
        return 1, (math.ceil(t.kv_heads / s.attn_tp) * t.head_dim, *shape[1:])
    tp = 1 if s.attention_dp else s.tp  # dense MLPs and shared experts follow attention
    if t.split == "tp_rows":
        return 1, (shape[0] // tp, *shape[1:])
    if t.split == "tp_cols":
        return 1, (shape[0], shape[1] // tp)
    if t.split == "vocab":
        return 1, (math.ceil(shape[0] / tp), *shape[1:])
    experts = t.experts // s.moe_ep
    if t.split == "expert_rows":  # [up | gate] rows of each expert, both cut by moe_tp
        return experts, (shape[0] // s.moe_tp, *shape[1:])
    if t.split == "expert_cols":
        return experts, (shape[0], shape[1] // s.moe_tp)
    if t.split == "experts":  # the stack split by moe_ep only (GPT-OSS's proj bias)
        return experts, shape
    raise ValueError(f"unknown split {t.split}")


def tensor_bytes(t: Tensor, count: int, shape: tuple[int, ...], fmt: str, dtype: str,
                 hf_layout: bool = False) -> int:
    """Bytes of ``count`` matrices of ``shape`` of tensor ``t`` in format ``fmt``
    (``hf_layout``: as the Hugging Face checkpoint stores it, router in the model dtype)."""
    elems = math.prod(shape)
    if t.derived and hf_layout:
        return 0
    if t.float32 and not (hf_layout and t.router):
        return count * elems * 4
    base = itemsize(dtype)
    if not t.linear or fmt == "none" or (fmt == "int8_sq" and t.experts > 1):
        return count * elems * base
    out, inp = shape
    if fmt == "fp8":
        return count * (elems + 4) + 4
    if fmt == "fp8_block":
        return count * (elems + math.ceil(out / FP8_BLOCK) * math.ceil(inp / FP8_BLOCK) * 4)
    if fmt in ("int4_awq", "w4a8_awq"):
        return count * (elems // 2 + out * math.ceil(inp / AWQ_GROUP) * 4 + inp * base)
    if fmt == "int8_sq":
        return count * (elems + out * 4 + inp * base + 4)
    if fmt == "nvfp4":
        return count * (elems // 2 + elems // NVFP4_BLOCK + 8)
    raise ConfigError(f"quantization format '{fmt}' is unknown",
                      f"choose one of {', '.join(FORMATS)}")


def stage_weight_bytes(model: ModelShape, s: Sharding, stage: int, fmt: str,
                       dtype: str | None = None, hf_layout: bool = False) -> int:
    """Weight bytes of one GPU of pipeline stage ``stage`` (every GPU of a stage holds the
    same amount: heads, experts and vocab rows divide evenly)."""
    dtype = dtype or model.dtype
    total = 0
    first, last = model.model_tensors()
    extra = (first if stage == 0 else []) + (last if stage == s.pp - 1 else [])
    for t in extra:
        total += tensor_bytes(t, *rank_shape(t, s), fmt, dtype, hf_layout)
    cache: dict[bool, int] = {}
    for layer in stage_layers(model.num_layers, s.pp, stage):
        moe = model.is_moe_layer(layer)
        if moe not in cache:
            cache[moe] = sum(tensor_bytes(t, *rank_shape(t, s), fmt, dtype, hf_layout)
                             for t in model.layer_tensors(layer))
        total += cache[moe]
    return total


def model_bytes(model: ModelShape, fmt: str, dtype: str | None = None,
                hf_layout: bool = False) -> int:
    """Bytes of the whole model in ``fmt`` (one GPU holding everything)."""
    return stage_weight_bytes(model, Sharding(1, 1, 1, 1), 0, fmt, dtype, hf_layout)
