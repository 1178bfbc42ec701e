"""Multi-head latent attention (DeepSeek-V2/V3) of the reference runtime, on TensorRT-LLM's
``DeepseekV2ForCausalLM`` checkpoint tensors (``moepipe.arch.deepseek`` describes them).

Per token, the replicated ``fused_a`` projection gives the compressed query ``c_q`` (or the
hidden state itself when ``q_lora_rank`` is null), the latent ``c_kv`` (RMS-normed) and the
decoupled rope key ``k_pe`` shared by all heads. The cache holds ``[c_kv | rope(k_pe)]`` per token,
once per layer (every tensor-parallel rank reads the same latent).

Two formulations give the same numbers:

* *absorbed* (default, what TensorRT-LLM's kernels compute): the query is projected into the
  latent space by ``fused_q_proj`` (``W_UK^T W_UQ`` per head, then the rope rows); scores are
  ``q_lat . c_kv + q_pe . k_pe`` and the values ``W_UV`` applied to the attended latent;
* *plain* (Hugging Face's): ``q_b_proj`` gives per-head ``(q_nope, q_pe)``, ``kv_b_proj`` expands
  the latent to per-head ``k_nope`` and ``v``.

DeepSeek rotates the rope part in interleaved pairs ``(x0, x1), (x2, x3), ...``; the runtime
de-interleaves ``q_pe`` and ``k_pe`` first and then rotates halves, which is what transformers'
DeepSeek-V3 computes (``apply_rotary_pos_emb_interleave``) and gives DeepSeek-V2's complex
rotation up to the same permutation of both q and k (so the same scores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moepipe.errors import CheckpointError


@dataclass(frozen=True)
class MlaDims:
    """The MLA sizes of a TensorRT-LLM DeepSeek checkpoint config.json."""

    q_lora_rank: int  # 0: no query compression
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    eps: float
    rope_scaling: dict | None = None  # TensorRT-LLM rotary_scaling (yarn) or None


    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> MlaDims | None:
        """None for a checkpoint without MLA."""
        if not cfg.get("kv_lora_rank"):
            return None
        try:
            return cls(int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]),
                       int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]),
                       int(cfg["v_head_dim"]), float(cfg.get("norm_epsilon", 1e-6)),
                       cfg.get("rotary_scaling") or None)
        except KeyError as e:
            raise CheckpointError(f"config.json has kv_lora_rank but lacks {e.args[0]}",
                                  "an MLA checkpoint needs every MLA dimension") from None

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """Softmax scale: 1/sqrt(qk head dim), times yarn's mscale(mscale_all_dim) squared."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        y = self.rope_scaling
        if y and y.get("mscale_all_dim"):
            scale *= _mscale(_factor(y), y["mscale_all_dim"]) ** 2
        return scale


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _factor(y: dict) -> float:
    return float(y["factor"])


def yarn(dim: int, base: float, y: dict) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and cos/sin factor (DeepSeek's, as transformers computes them:
    ``modeling_rope_utils._compute_yarn_parameters`` with truncated correction range)."""
    factor, orig = _factor(y), float(y["original_max_position_embeddings"])
    mscale, mscale_all = y.get("mscale"), y.get("mscale_all_dim")
    attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all \
        else _mscale(factor)
    beta_fast, beta_slow = y.get("beta_fast") or 32, y.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if y.get("truncate", True):  # GPT-OSS publishes truncate: false
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low)
                       / ((high - low) or 0.001), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv_freq, float(attention)


@dataclass
class MlaRank:
    """One tensor-parallel rank's attention weights (float32)."""

    fused_a: torch.Tensor  # [q_lora + kv_lora + rope, H], replicated
    q_a_norm: torch.Tensor | None
    kv_a_norm: torch.Tensor
    fused_q: torch.Tensor  # [heads_r * (kv_lora + rope), q_in]
    q_b: torch.Tensor  # [heads_r * (nope + rope), q_in]
    w_uk: torch.Tensor  # [heads_r, nope, kv_lora]
    w_uv: torch.Tensor  # [heads_r, v, kv_lora]
    dense: torch.Tensor  # [H, heads_r * v]
    heads: int


def load_rank(get, opt, prefix: str, dims: MlaDims) -> MlaRank:
    """``get(name)`` / ``opt(name)``: a rank's (required / optional) float32 tensors."""
    p = prefix + "attention."
    kv_b = get(p + "kv_b_proj")
    fused_q = get(p + "fused_q_proj")
    heads = fused_q.shape[0] // dims.cache_width
    k_rows = heads * dims.qk_nope_head_dim
    return MlaRank(
        fused_a=get(p + "fused_a.weight"),
        q_a_norm=get(p + "q_a_layernorm.weight") if dims.q_lora_rank else None,
        kv_a_norm=get(p + "kv_a_layernorm.weight"),
        fused_q=fused_q, q_b=get(p + "q_b_proj"),
        w_uk=kv_b[:k_rows].view(heads, dims.qk_nope_head_dim, dims.kv_lora_rank),
        w_uv=kv_b[k_rows:].view(heads, dims.v_head_dim, dims.kv_lora_rank),
        dense=get(p + "dense.weight"), heads=heads)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs -> halves, then the rotate-half rotation (x: [T, heads, rope])."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention(x: torch.Tensor, ranks: list[MlaRank], dims: MlaDims, cos, sin, plan: Any,
              cache: torch.Tensor | None, absorbed: bool = True) -> torch.Tensor:
    """The attention block's output ``[T, H]`` (summed over ranks). ``plan`` is the runtime's
    attention plan (decode batch, prefill sequences); ``cache`` this layer's latent cache
    ``[slots, 1, max_len, kv_lora + rope]`` or None."""
    a = x @ ranks[0].fused_a.T
    w0 = ranks[0]
    if dims.q_lora_rank and w0.q_a_norm is not None:
        q_c, kv_c, k_pe = a.split([dims.q_lora_rank, dims.kv_lora_rank, dims.qk_rope_head_dim],
                                  dim=-1)
        q_c = _rms(q_c, w0.q_a_norm, dims.eps)
    else:
        kv_c, k_pe = a.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
        q_c = x
    kv_c = _rms(kv_c, w0.kv_a_norm, dims.eps)
    latent = torch.cat((kv_c, _rope(k_pe[:, None, :], cos, sin)[:, 0]), dim=-1)
    keys = _store(latent, plan, cache)
    out = torch.zeros_like(x)
    for w in ranks:
        if absorbed:
            q = (q_c @ w.fused_q.T).view(-1, w.heads, dims.cache_width)
            q_lat, q_pe = q.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
        else:
            q = (q_c @ w.q_b.T).view(-1, w.heads, dims.qk_nope_head_dim + dims.qk_rope_head_dim)
            q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
            # q_nope . (W_UK c_kv) == (W_UK^T q_nope) . c_kv: from q_b_proj and kv_b_proj's
            # k rows instead of fused_q_proj
            q_lat = torch.einsum("thd,hdk->thk", q_nope, w.w_uk)
        q = torch.cat((q_lat, _rope(q_pe, cos, sin)), dim=-1)
        o_lat = _attend(q, keys, plan, dims)  # [T, heads, kv_lora]
        v = torch.einsum("thk,hvk->thv", o_lat, w.w_uv)
        out += v.reshape(-1, w.heads * dims.v_head_dim) @ w.dense.T
    return out


def _store(latent: torch.Tensor, plan: Any, cache: torch.Tensor | None):
    """Write the new tokens' latents into the cache; what each sequence attends to."""
    prefill = []
    for start, n, past, slot in plan.prefill:
        if cache is None:
            prefill.append(latent[start:start + n])
            continue
        cache[slot, 0, past:past + n] = latent[start:start + n]
        prefill.append(cache[slot, 0, :past + n])
    decode = None
    if plan.decode is not None and cache is not None:
        idx, slots, past, length, mask = plan.decode
        cache[slots, 0, past] = latent[idx]
        decode = (cache[slots, :, :length], mask)
    return prefill, decode


def _attend(q: torch.Tensor, keys, plan: Any, dims: MlaDims) -> torch.Tensor:
    """MQA over the latent: keys ``[c_kv | k_pe]``, values ``c_kv``."""
    prefill, decode = keys
    out = q.new_zeros(q.shape[0], q.shape[1], dims.kv_lora_rank)
    for (start, n, past, _), kv in zip(plan.prefill, prefill, strict=True):
        mask = torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]
        qs = q[start:start + n].transpose(0, 1)  # [heads, n, D]
        o = F.scaled_dot_product_attention(qs, kv[None], kv[None, :, :dims.kv_lora_rank],
                                           attn_mask=mask, scale=dims.scale, enable_gqa=True)
        out[start:start + n] = o.transpose(0, 1)
    if decode is not None:
        kv, mask = decode  # [B, 1, L, D]
        idx = plan.decode[0]
        o = F.scaled_dot_product_attention(q[idx][:, :, None, :], kv,
                                           kv[..., :dims.kv_lora_rank], attn_mask=mask,
                                           scale=dims.scale, enable_gqa=True)
        out[idx] = o[:, :, 0, :]
    return out
