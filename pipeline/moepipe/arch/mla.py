"""DeepSeek's multi-head latent attention in TensorRT-LLM 1.2's ``DeepseekV2ForCausalLM`` checkpoint
(``tensorrt_llm/models/deepseek_v2/convert.py``): the model spec with the MLA dimensions and the
rules that make ``attention.fused_a``, ``q_b_proj``, ``kv_b_proj`` and the absorbed
``fused_q_proj`` of one rank."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from moepipe.arch.geometry import COLUMN, REPLICATED, Geometry, Part, chunk
from moepipe.arch.routing import RoutingSpec
from moepipe.arch.rules import Rule
from moepipe.arch.spec import ModelSpec
from moepipe.errors import UnsupportedError


@dataclass(frozen=True)
class DeepseekSpec(ModelSpec):
    """A DeepSeek model: the common fields plus multi-head latent attention and dense layers."""

    q_lora_rank: int = 0  # 0: no query compression (q_proj), DeepSeek-V2-Lite
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_k_dense_replace: int = 0
    routing: dict = field(default_factory=dict)  # RoutingSpec.to_dict() of the HF router
    rope_scaling: dict | None = None  # TensorRT-LLM ``rotary_scaling`` (yarn) or None
    mtp_layers: int = 0  # num_nextn_predict_layers (on disk after the decoder layers; unused)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.qk_head_dim

    @property
    def q_in(self) -> int:
        return self.q_lora_rank or self.hidden_size

    @property
    def fused_a_rows(self) -> int:
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_rows(self) -> int:
        return self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def o_in(self) -> int:
        return self.num_heads * self.v_head_dim

    @property
    def routing_spec(self) -> RoutingSpec:
        return RoutingSpec.from_dict(self.routing)


ATTN = _ATTN = "model.layers.{layer}.self_attn."


@dataclass(frozen=True)
class FusedA(Rule):
    """``[q_a_proj; kv_a_proj_with_mqa]`` (or only the latter), replicated."""

    def _srcs(self, ctx):
        kv = ctx.name(_ATTN + "kv_a_proj_with_mqa.weight")
        return [ctx.name(_ATTN + "q_a_proj.weight"), kv] if ctx.spec.q_lora_rank else [kv]

    def sources(self, ctx, reader):
        return self._srcs(ctx)

    def source_shapes(self, ctx):
        s = ctx.spec
        shapes = {ctx.name(_ATTN + "kv_a_proj_with_mqa.weight"):
                  (s.kv_lora_rank + s.qk_rope_head_dim, s.hidden_size)}
        if s.q_lora_rank:
            shapes[ctx.name(_ATTN + "q_a_proj.weight")] = (s.q_lora_rank, s.hidden_size)
        return shapes

    def shape(self, ctx):
        return (ctx.spec.fused_a_rows, ctx.spec.hidden_size)

    def geometry(self, ctx, fused=False):
        srcs = self._srcs(ctx)
        return Geometry(REPLICATED, (tuple(Part(s) for s in srcs),), tuple(srcs))


def _q_src(ctx) -> str:
    return ctx.name(_ATTN + ("q_b_proj.weight" if ctx.spec.q_lora_rank else "q_proj.weight"))


@dataclass(frozen=True)
class QB(Rule):
    """``attention.q_b_proj``: the query up-projection, this rank's heads."""

    def sources(self, ctx, reader):
        return [_q_src(ctx)]

    def source_shapes(self, ctx):
        return {_q_src(ctx): (ctx.spec.q_rows, ctx.spec.q_in)}

    def shape(self, ctx):
        return (ctx.spec.q_rows // ctx.tp, ctx.spec.q_in)

    def geometry(self, ctx, fused=False):
        src = _q_src(ctx)
        return Geometry(COLUMN, ((Part(src, rows=chunk(ctx.spec.q_rows, ctx.tp, ctx.tp_rank)),),),
                        (src,))


def _local_heads(ctx) -> range:
    per = ctx.spec.num_heads // ctx.tp
    return range(ctx.tp_rank * per, (ctx.tp_rank + 1) * per)


@dataclass(frozen=True)
class KVB(Rule):
    """``attention.kv_b_proj``: this rank's heads, ``[k_nope of each head; v of each head]``
    (Hugging Face interleaves (k_nope, v) per head)."""

    def sources(self, ctx, reader):
        return [ctx.name(_ATTN + "kv_b_proj.weight")]

    def source_shapes(self, ctx):
        return {ctx.name(_ATTN + "kv_b_proj.weight"): (ctx.spec.kv_b_rows, ctx.spec.kv_lora_rank)}

    def shape(self, ctx):
        return (ctx.spec.kv_b_rows // ctx.tp, ctx.spec.kv_lora_rank)

    def geometry(self, ctx, fused=False):
        s, src = ctx.spec, ctx.name(_ATTN + "kv_b_proj.weight")
        per = s.qk_nope_head_dim + s.v_head_dim
        heads = _local_heads(ctx)
        k = tuple(Part(src, rows=slice(h * per, h * per + s.qk_nope_head_dim)) for h in heads)
        v = tuple(Part(src, rows=slice(h * per + s.qk_nope_head_dim, (h + 1) * per))
                  for h in heads)
        return Geometry(COLUMN, (k + v,), (src,))


@dataclass(frozen=True)
class FusedQ(Rule):
    """``attention.fused_q_proj``: per head ``einsum('dq,dk->kq', W_UQ_nope, W_UK)`` (the query
    in the latent space) followed by the head's rope rows; computed, not sliced."""

    def sources(self, ctx, reader):
        return [_q_src(ctx), ctx.name(_ATTN + "kv_b_proj.weight")]

    def source_shapes(self, ctx):
        return {**QB().source_shapes(ctx), **KVB().source_shapes(ctx)}

    def shape(self, ctx):
        s = ctx.spec
        return (s.num_heads // ctx.tp * (s.kv_lora_rank + s.qk_rope_head_dim), s.q_in)

    def chunks(self, ctx, reader) -> Iterator[Any]:
        import torch

        s = ctx.spec
        heads = _local_heads(ctx)
        qk, kvh = s.qk_head_dim, s.qk_nope_head_dim + s.v_head_dim
        q = reader.read(_q_src(ctx), (slice(heads.start * qk, heads.stop * qk),)).float()
        kv = reader.read(ctx.name(_ATTN + "kv_b_proj.weight"),
                         (slice(heads.start * kvh, heads.stop * kvh),)).float()
        q = q.view(len(heads), qk, s.q_in)
        kv = kv.view(len(heads), kvh, s.kv_lora_rank)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=1)
        k_nope = kv[:, :s.qk_nope_head_dim]
        absorbed = torch.einsum("hdq,hdk->hkq", q_nope, k_nope)
        yield torch.cat([absorbed, q_pe], dim=1).reshape(-1, s.q_in)

    def geometry(self, ctx, fused=False):
        raise UnsupportedError("attention.fused_q_proj is computed; it cannot be quantized "
                               "by slicing")
