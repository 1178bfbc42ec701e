"""GPT-OSS (``GptOssForCausalLM``) -> a moepipe (TensorRT-LLM-style) checkpoint.

TensorRT-LLM 1.2 serves GPT-OSS on its PyTorch backend only (``tensorrt_llm/_torch/models/
modeling_gpt_oss.py``; ``tensorrt_llm/models/__init__.py`` ``MODEL_MAP`` has no engine model):
``trtllm-pytorch`` loads the Hugging Face checkpoint, ``trtllm-engine`` refuses it, and the
converter writes this layout for moepipe's reference runtime (the ``cpu`` target).

What the layout carries beyond a Mixtral-style checkpoint (transformers
``models/gpt_oss/modeling_gpt_oss.py``):

* router with a bias (``mlp.router.bias`` [E], float32): top-k of ``W x + b``, softmax over
  the k (``moepipe_routing``: ``router_bias``);
* attention: q/k/v and o biases (``attention.qkv.bias``, ``attention.dense.bias`` added once
  after the all-reduce), learned per-head sinks (``attention.sinks`` [heads / tp], float32: one
  more logit in each head's softmax denominator), sliding-window attention on the layers
  ``layer_types`` marks ``sliding_attention`` (config keys ``sliding_window``, ``layer_types``);
* experts with biases (``mlp.fc.bias`` [E_local, 2I/moe_tp], ``mlp.proj.bias`` [E_local, H],
  added by moe_tp rank 0) and the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(a * g)``,
  ``g = min(gate, l)`` (``swiglu_alpha`` a = 1.702, ``swiglu_limit`` l = 7);
* Hugging Face stores an expert's ``gate_up_proj`` as ``[H, 2I]`` with gate and up interleaved
  (columns 0, 2, 4, ... gate; 1, 3, 5, ... up) and ``down_proj`` as ``[I, H]``: the converter
  transposes and de-interleaves them into TensorRT-LLM's ``[up | gate]`` rows (``mlp.fc``) and
  ``[H, I]`` (``mlp.proj``);
* YaRN rope (``rotary_scaling`` type yarn, ``truncate`` false as published).

bf16 / fp16 / fp32 checkpoints are converted, and the published MXFP4 ones: their experts are read
dequantized (``checkpoints.mxfp4``), exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from moepipe.arch.common import ATTENTION, MODEL_RULES
from moepipe.arch.family import Family, Fixed, RuntimeFacts
from moepipe.arch.geometry import COLUMN, Geometry, Part, chunk
from moepipe.arch.routing import spec_from_hf
from moepipe.arch.rules import Replicated, Router, Rule
from moepipe.arch.spec import ModelSpec
from moepipe.errors import UnsupportedError

_ATTN = "model.layers.{layer}.self_attn."
_MLP = "model.layers.{layer}.mlp."
_EXPERTS = _MLP + "experts."


@dataclass(frozen=True)
class GptOssSpec(ModelSpec):
    """A GPT-OSS model: the common fields plus its attention pattern and activation."""

    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope_scaling: dict | None = None  # TensorRT-LLM ``rotary_scaling`` (yarn) or None
    routing: dict = field(default_factory=dict)  # RoutingSpec.to_dict() of the HF router


@dataclass(frozen=True)
class HeadSplit(Rule):
    """A per-head vector ``[num_heads]`` split with the heads (attention sinks)."""

    src: str
    float32: bool = field(default=True, kw_only=True)

    def sources(self, ctx, reader):
        return [ctx.name(self.src)]

    def source_shapes(self, ctx):
        return {ctx.name(self.src): (ctx.spec.num_heads,)}

    def shape(self, ctx):
        return (ctx.spec.num_heads // ctx.tp,)

    def geometry(self, ctx, fused=False):
        src = ctx.name(self.src)
        rows = chunk(ctx.spec.num_heads, ctx.tp, ctx.tp_rank)
        return Geometry(COLUMN, ((Part(src, rows=rows),),), (src,))


@dataclass(frozen=True)
class _FusedExperts(Rule):
    """A rule over GPT-OSS's fused expert tensors (``[E, ...]``): its output is computed per
    local expert (transposed / de-interleaved), not sliced, so it has no plain geometry."""

    src: str  # {layer} template of the [E, ...] source

    def sources(self, ctx, reader):
        return [ctx.name(self.src)]

    def source_shapes(self, ctx):
        return {ctx.name(self.src): self.full(ctx.spec)}

    def full(self, spec: ModelSpec) -> tuple[int, ...]:
        raise NotImplementedError

    def local(self, ctx) -> range:
        return ctx.mapping.ep_experts(ctx.spec.num_experts, ctx.rank)

    def inter_rows(self, ctx) -> slice:
        m = ctx.mapping
        return chunk(ctx.spec.expert_intermediate_size, m.moe_tp, m.moe_tp_rank(ctx.rank))

    def geometry(self, ctx, fused=False):
        raise UnsupportedError("GPT-OSS experts are not quantized by moepipe",
                               "use quantize.format: none")

    def chunks(self, ctx, reader) -> Iterator[Any]:
        for x in self.local(ctx):
            yield self.expert(reader.read(ctx.name(self.src), (x,)), ctx)

    def expert(self, t, ctx):
        raise NotImplementedError


def _up_gate(t, rows: slice):
    """``[up_r; gate_r]`` (dim 0) from Hugging Face's interleaved rows (even: gate, odd: up)."""
    import torch

    gate, up = t[0::2], t[1::2]
    return torch.cat([up[rows], gate[rows]], dim=0)


@dataclass(frozen=True)
class ExpertsFc(_FusedExperts):
    """``mlp.fc.weight`` [E_local, 2I/moe_tp, H] from ``gate_up_proj`` [E, H, 2I]."""

    def full(self, spec):
        return (spec.num_experts, spec.hidden_size, 2 * spec.expert_intermediate_size)

    def shape(self, ctx):
        s, m = ctx.spec, ctx.mapping
        return (s.num_experts // m.moe_ep, 2 * s.expert_intermediate_size // m.moe_tp,
                s.hidden_size)

    def expert(self, t, ctx):
        return _up_gate(t.T, self.inter_rows(ctx))


@dataclass(frozen=True)
class ExpertsFcBias(_FusedExperts):
    """``mlp.fc.bias`` [E_local, 2I/moe_tp] from ``gate_up_proj_bias`` [E, 2I]."""

    def full(self, spec):
        return (spec.num_experts, 2 * spec.expert_intermediate_size)

    def shape(self, ctx):
        s, m = ctx.spec, ctx.mapping
        return (s.num_experts // m.moe_ep, 2 * s.expert_intermediate_size // m.moe_tp)

    def expert(self, t, ctx):
        return _up_gate(t, self.inter_rows(ctx))


@dataclass(frozen=True)
class ExpertsProj(_FusedExperts):
    """``mlp.proj.weight`` [E_local, H, I/moe_tp] from ``down_proj`` [E, I, H]."""

    def full(self, spec):
        return (spec.num_experts, spec.expert_intermediate_size, spec.hidden_size)

    def shape(self, ctx):
        s, m = ctx.spec, ctx.mapping
        return (s.num_experts // m.moe_ep, s.hidden_size, s.expert_intermediate_size // m.moe_tp)

    def expert(self, t, ctx):
        return t[self.inter_rows(ctx)].T


@dataclass(frozen=True)
class ExpertsProjBias(_FusedExperts):
    """``mlp.proj.bias`` [E_local, H] from ``down_proj_bias`` [E, H] (every moe_tp rank holds
    it; the runtime adds it on moe_tp rank 0, after the row-parallel projection)."""

    def full(self, spec):
        return (spec.num_experts, spec.hidden_size)

    def shape(self, ctx):
        return (ctx.spec.num_experts // ctx.mapping.moe_ep, ctx.spec.hidden_size)

    def expert(self, t, ctx):
        return t


def gpt_oss_runtime_facts(cfg: dict[str, Any]) -> RuntimeFacts:
    """GPT-OSS: attention and expert biases, sinks; no q/k norm, no shared expert."""
    return RuntimeFacts(qk_norm=False, shared_expert_intermediate_size=0,
                        attn_bias=bool(cfg.get("attn_bias", True)),
                        dense_bias=bool(cfg.get("attn_bias", True)), attention_sinks=True,
                        mlp_bias=bool(cfg.get("mlp_bias", True)))


def _yarn(cfg: dict[str, Any], where: str) -> dict[str, Any] | None:
    """GPT-OSS's YaRN as ``rotary_scaling`` (None for plain RoPE)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise UnsupportedError(f"{where}: rope scaling {kind!r} is not supported for GPT-OSS",
                               "GPT-OSS uses yarn (or plain RoPE)")
    if rope.get("attention_factor") is not None or rope.get("mscale") is not None:
        raise UnsupportedError(f"{where}: yarn with attention_factor / mscale is not supported "
                               "for GPT-OSS", "the published configs have neither")
    if rope.get("original_max_position_embeddings") is None or rope.get("factor") is None:
        raise UnsupportedError(f"{where}: yarn without factor / original_max_position_embeddings",
                               "the checkpoint's rope scaling is incomplete")
    return {"type": "yarn", "factor": float(rope["factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32),
            "beta_slow": float(rope.get("beta_slow") or 1),
            "truncate": bool(rope.get("truncate", True))}


class GptOssFamily(Family):
    """GPT-OSS: the spec carries the attention pattern, the activation and the yarn rope."""

    def spec(self, hf_config: dict[str, Any], where: str) -> ModelSpec:
        rope_scaling = _yarn(hf_config, where)
        plain = dict(hf_config)
        if rope_scaling is not None:  # the generic checks refuse rope scaling: yarn is ours
            plain.pop("rope_scaling", None)
            plain["rope_parameters"] = {**(hf_config.get("rope_parameters") or {}),
                                        "rope_type": "default"}
        base = super().spec(plain, where)
        n = base.num_layers
        layer_types = tuple(hf_config.get("layer_types") or
                            ["sliding_attention" if (i + 1) % 2 else "full_attention"
                             for i in range(n)])
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if len(layer_types) != n or unknown:
            raise UnsupportedError(f"{where}: layer_types must name {n} layers as "
                                   f"sliding_attention / full_attention", f"got {layer_types}")
        window = int(hf_config.get("sliding_window") or 0)
        if "sliding_attention" in layer_types and window < 1:
            raise UnsupportedError(f"{where}: sliding_attention layers without a sliding_window",
                                   "set sliding_window")
        values = {f.name: getattr(base, f.name) for f in fields(ModelSpec)}
        return GptOssSpec(**values, sliding_window=window, layer_types=layer_types,
                          swiglu_alpha=float(hf_config.get("swiglu_alpha", 1.702)),
                          swiglu_limit=float(hf_config.get("swiglu_limit", 7.0)),
                          rope_scaling=rope_scaling,
                          routing=spec_from_hf(self.hf_architecture, hf_config).to_dict())

    def finish_config(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        """The keys the runtime reads beyond TensorRT-LLM's (named as in the HF config)."""
        if not isinstance(spec, GptOssSpec):
            return
        cfg.update({
            "rotary_scaling": spec.rope_scaling,
            "sliding_window": spec.sliding_window,
            "layer_types": list(spec.layer_types),
            "swiglu_alpha": spec.swiglu_alpha,
            "swiglu_limit": spec.swiglu_limit,
            "moepipe_routing": spec.routing,  # router_bias: TensorRT-LLM's moe cannot say it
        })


_BIASED_ATTENTION = {
    **ATTENTION,
    "attention.dense.bias": Replicated(_ATTN + "o_proj.bias", when="attention_bias"),
    "attention.sinks": HeadSplit(_ATTN + "sinks"),
}

GPT_OSS = GptOssFamily(
    hf_architecture="GptOssForCausalLM",
    trtllm_architecture="GptOssForCausalLM",
    trtllm_class="",  # PyTorch backend only (tensorrt_llm/_torch/models/modeling_gpt_oss.py)
    description="GPT-OSS: biased router (top-k -> softmax), attention sinks, alternating "
                "sliding-window / full attention, biased experts with a clamped SwiGLU",
    layer_prefix="model.layers.{layer}.",
    layer_rules={
        **_BIASED_ATTENTION,
        "mlp.router.weight": Router(_MLP + "router.weight"),
        "mlp.router.bias": Replicated(_MLP + "router.bias", dims=("num_experts",),
                                      float32=True),
        "mlp.fc.weight": ExpertsFc(_EXPERTS + "gate_up_proj"),
        "mlp.fc.bias": ExpertsFcBias(_EXPERTS + "gate_up_proj_bias"),
        "mlp.proj.weight": ExpertsProj(_EXPERTS + "down_proj"),
        "mlp.proj.bias": ExpertsProjBias(_EXPERTS + "down_proj_bias"),
    },
    model_rules=MODEL_RULES,
    routing="renormalize",  # top-k of the (biased) logits, softmax over the k
    config_keys={"expert_intermediate_size": ("intermediate_size",),
                 "dense_intermediate_size": ("intermediate_size",)},
    config_defaults={"attention_bias": True},
    trtllm_fields={
        "mlp_bias": Fixed(True),
        "attn_bias": "attention_bias",
        "rotary_base": "rope_theta",
        "tie_word_embeddings": "tie_word_embeddings",
    },
    runtime_facts=gpt_oss_runtime_facts,
    no_engine="TensorRT-LLM 1.2 serves GPT-OSS on its PyTorch backend only (no engine model in "
              "tensorrt_llm/models MODEL_MAP)",
    quantizable=False,
)
