"""Every weight of a MoE model, and what one GPU holds of it: the one sizing model.

A :class:`ModelShape` is built from arch's normalised :class:`~moepipe.arch.spec.ModelSpec`
(:func:`shape_of`; :func:`model_shape` from a ``config.json`` alone, published configs plan
without weights), and :meth:`ModelShape.layer_tensors` lists every tensor of a decoder layer as
TensorRT-LLM's checkpoint holds it (q/k/v fused, experts stacked ``[E, 2I, H]`` with up|gate
fused, DeepSeek's MLA projections and dense first layers), each with the rule that shards it.
The per-rank bytes equal the converter's plan exactly (tests compare them for every legal
mapping); the planner, the engine's GPU estimate and the pods' host memory all count with it.

Sharding (TensorRT-LLM 1.2, ``tensorrt_llm/mapping.py`` and the model's ``convert.py``):

* attention heads split by ``tp`` (KV heads duplicated when fewer than tp); attention data
  parallelism (``enable_attention_dp``, trtllm-pytorch) replicates attention instead;
* routed experts: ``E / moe_ep`` per rank, each ``I / moe_tp`` wide; the router replicated;
* shared experts and dense MLPs split by ``tp``;
* embedding replicated on the first pipeline stage, ``lm_head`` (vocab padded to a multiple of
  tp) split by tp on the last, with the final norm.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.arch import get_family
from moepipe.arch.mla import DeepseekSpec
from moepipe.arch.rules import RankContext
from moepipe.checkpoints.dtypes import BY_TORCH_NAME, itemsize
from moepipe.errors import CheckpointError
from moepipe.mapping import Mapping
from moepipe.utils.fs import read_json

if TYPE_CHECKING:
    from moepipe.arch.spec import ModelSpec


@dataclass(frozen=True)
class Tensor:
    """One tensor of a layer (or of the model) and how ranks share it.

    ``split``: ``None`` replicated; ``"heads_rows"`` / ``"heads_cols"`` split by attention tp;
    ``"qkv_rows"`` q heads split by tp, then K and V rows of ``kv_heads`` heads of
    ``head_dim``, ceil(kv/tp) heads each per rank (duplicated when fewer than tp);
    ``"tp_rows"`` / ``"tp_cols"`` split by the full tp; ``"vocab"`` rows padded to a multiple of
    tp, then split; ``"expert_rows"`` / ``"expert_cols"`` a stack of ``experts`` matrices split
    by moe_ep (the stack) and moe_tp (the given dim).
    ``linear``: a GEMM weight that a quantization format stores in its own type.
    ``float32``: stored in float32 whatever the model dtype (routing bias; ``router``: the
    router, float32 in TensorRT-LLM's checkpoint, the model dtype in Hugging Face's).
    ``derived``: only in TensorRT-LLM's checkpoint, computed from other weights (DeepSeek's
    absorbed ``fused_q_proj``): no bytes in the Hugging Face layout, not a parameter.
    """

    name: str
    shape: tuple[int, ...]
    split: str | None = None
    linear: bool = False
    float32: bool = False
    router: bool = False
    experts: int = 1
    kv_heads: int = 0
    head_dim: int = 0
    derived: bool = False


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a MoE decoder that decide its weights, KV cache and traffic."""

    name: str
    architecture: str
    dtype: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    qk_norm: bool = False
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank == 0 means GQA.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    routing_bias: bool = False
    max_position_embeddings: int = 4096
    published_quant: str | None = None  # e.g. "fp8_block" for DeepSeek's own checkpoint
    qk_norm_projection: bool = False  # q/k norms over the whole projection (OLMoE)
    attention_sinks: bool = False  # per-head sink logits (GPT-OSS)
    dense_bias: bool = False  # attention output bias (GPT-OSS)
    expert_bias: bool = False  # routed experts' fc / proj biases (GPT-OSS)
    router_bias: bool = False  # the router's own bias (GPT-OSS)
    # The spec it was made from (the family's own checks read it).
    spec: ModelSpec | None = field(default=None, compare=False, repr=False)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layers)

    @property
    def attn_width(self) -> int:
        """Width of the attention output (heads x value head dim)."""
        return self.num_heads * (self.v_head_dim if self.mla else self.head_dim)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    # -- tensors ---------------------------------------------------------------------------
    def layer_tensors(self, layer: int) -> Iterator[Tensor]:
        """The tensors of decoder layer ``layer`` (TensorRT-LLM checkpoint granularity)."""
        h = self.hidden_size
        yield Tensor("input_layernorm.weight", (h,))
        yield Tensor("post_layernorm.weight", (h,))
        yield from self._attention()
        if not self.is_moe_layer(layer):
            i = self.dense_intermediate_size
            yield Tensor("mlp.fc.weight", (2 * i, h), "tp_rows", linear=True)
            yield Tensor("mlp.proj.weight", (h, i), "tp_cols", linear=True)
            return
        e, i = self.num_experts, self.expert_intermediate_size
        yield Tensor("mlp.router.weight", (e, h), float32=True, router=True)
        if self.router_bias:
            yield Tensor("mlp.router.bias", (e,), float32=True, router=True)
        if self.expert_bias:
            yield Tensor("mlp.fc.bias", (2 * i,), "expert_rows", experts=e)
            yield Tensor("mlp.proj.bias", (h,), "experts", experts=e)
        if self.routing_bias:
            yield Tensor("mlp.e_score_correction_bias", (e,), float32=True)
        yield Tensor("mlp.fc.weight", (2 * i, h), "expert_rows", linear=True, experts=e)
        yield Tensor("mlp.proj.weight", (h, i), "expert_cols", linear=True, experts=e)
        if self.shared_expert_intermediate_size:
            s = self.shared_expert_intermediate_size
            yield Tensor("mlp.shared_expert.fc.weight", (2 * s, h), "tp_rows", linear=True)
            yield Tensor("mlp.shared_expert.proj.weight", (h, s), "tp_cols", linear=True)
            if self.shared_expert_gate:
                yield Tensor("mlp.shared_expert_gate.weight", (1, h))

    def _attention(self) -> Iterator[Tensor]:
        h, n = self.hidden_size, self.num_heads
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            a_rows = a_rows_q = self.kv_lora_rank + self.qk_rope_head_dim
            if self.q_lora_rank:
                a_rows += self.q_lora_rank
                yield Tensor("attention.q_a_layernorm.weight", (self.q_lora_rank,))
                yield Tensor("attention.q_b_proj.weight", (n * qk, self.q_lora_rank),
                             "heads_rows", linear=True)
            else:
                yield Tensor("attention.q_proj.weight", (n * qk, h), "heads_rows", linear=True)
            # q_a and kv_a fused, replicated (TensorRT-LLM DeepseekV2 fused_a).
            yield Tensor("attention.fused_a.weight", (a_rows, h), linear=True)
            yield Tensor("attention.kv_a_layernorm.weight", (self.kv_lora_rank,))
            # the absorbed query W_UK^T W_UQ + rope rows (deepseek_v2/convert.py fused_q_proj)
            yield Tensor("attention.fused_q_proj", (n * a_rows_q, self.q_lora_rank or h),
                         "heads_rows", derived=True)
            yield Tensor("attention.kv_b_proj.weight",
                         (n * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                         "heads_rows", linear=True)
            yield Tensor("attention.dense.weight", (h, n * self.v_head_dim), "heads_cols",
                         linear=True)
            return
        d, kv = self.head_dim, self.num_kv_heads
        yield Tensor("attention.qkv.weight", ((n + 2 * kv) * d, h), "qkv_rows", linear=True,
                     kv_heads=kv, head_dim=d)
        if self.attention_bias:
            yield Tensor("attention.qkv.bias", ((n + 2 * kv) * d,), "qkv_rows", kv_heads=kv,
                         head_dim=d)
        yield Tensor("attention.dense.weight", (h, n * d), "heads_cols", linear=True)
        if self.dense_bias:
            yield Tensor("attention.dense.bias", (h,))
        if self.attention_sinks:
            yield Tensor("attention.sinks", (n,), "heads_rows", float32=True, router=True)
        if self.qk_norm and self.qk_norm_projection:
            yield Tensor("attention.q_layernorm.weight", (n * d,), "heads_rows")
            yield Tensor("attention.k_layernorm.weight", (kv * d,), "kv_rows", kv_heads=kv,
                         head_dim=d)
        elif self.qk_norm:
            yield Tensor("attention.q_layernorm.weight", (d,))
            yield Tensor("attention.k_layernorm.weight", (d,))

    def model_tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        """(first-stage, last-stage) tensors outside the decoder layers."""
        v, h = self.vocab_size, self.hidden_size
        first = [Tensor("transformer.vocab_embedding.weight", (v, h))]
        last = [Tensor("transformer.ln_f.weight", (h,))]
        if not self.tie_word_embeddings:
            last.append(Tensor("lm_head.weight", (v, h), "vocab"))
        return first, last

    def all_tensors(self) -> Iterator[Tensor]:
        first, last = self.model_tensors()
        yield from first
        for layer in range(self.num_layers):
            yield from self.layer_tensors(layer)
        yield from last

    def parameters(self) -> int:
        """Parameters of the Hugging Face model (all layers, experts and the routing bias;
        DeepSeek's multi-token-prediction layer excluded, as transformers loads it)."""
        return _parameters(self)

    def largest_layer_parameters(self) -> int:
        """Parameters of the largest decoder layer, as its Hugging Face checkpoint counts them
        (what layer-by-layer quantization holds at once: :mod:`moepipe.quant.memory`)."""
        return max(sum(math.prod(t.shape) * t.experts for t in self.layer_tensors(i)
                       if not t.derived) for i in range(self.num_layers))

    def active_parameters(self) -> int:
        """Parameters one token passes through: top_k of the routed experts."""
        per_expert = 3 * self.hidden_size * self.expert_intermediate_size
        return self.parameters() - self.moe_layers * (self.num_experts - self.top_k) * per_expert

    def dense(self) -> ModelShape:
        """The dense model of the same parameters: one expert as wide as all of them, which
        every token passes through (the router's ``E x hidden`` weights aside)."""
        return dataclasses.replace(
            self, name=f"{self.name} (dense)", num_experts=1, top_k=1,
            expert_intermediate_size=self.num_experts * self.expert_intermediate_size,
            routing_bias=False, router_bias=False)

    def largest_tensor_bytes(self) -> int:
        """Largest single tensor of the Hugging Face checkpoint (per expert matrix)."""
        b = itemsize(self.dtype)
        return max(math.prod(t.shape) for t in self.all_tensors()) * b


@functools.lru_cache(maxsize=64)
def _parameters(model: ModelShape) -> int:
    return sum(math.prod(t.shape) * t.experts for t in model.all_tensors() if not t.derived)


# -- from arch's ModelSpec ------------------------------------------------------------------

# The tensors of a decoder layer that decide ModelShape's flags, by their TensorRT-LLM names (the
# family's rules, enabled for the model: what the converter writes).
_FLAGS = {
    "attention_bias": "attention.qkv.bias",
    "dense_bias": "attention.dense.bias",
    "attention_sinks": "attention.sinks",
    "qk_norm": "attention.q_layernorm.weight",
    "router_bias": "mlp.router.bias",
    "expert_bias": "mlp.fc.bias",
    "routing_bias": "mlp.e_score_correction_bias",
    "shared_expert_gate": "mlp.shared_expert_gate.weight",
}


def shape_of(spec: ModelSpec, name: str | None = None, published_quant: str | None = None
             ) -> ModelShape:
    """The :class:`ModelShape` of a normalised model: its numbers from ``spec``, which tensors
    a layer has from its family's weight rules (one family table: :mod:`moepipe.arch`)."""
    family = get_family(spec.architecture)
    dense = range(spec.first_k_dense_replace if isinstance(spec, DeepseekSpec) else 0)
    moe_layer = len(dense) if len(dense) < spec.num_layers else 0
    rules = {n: r for n, r in family.rules_for(spec, moe_layer).items() if r.enabled(spec)}
    flags = {flag: tensor in rules for flag, tensor in _FLAGS.items()}
    q_norm = rules.get(_FLAGS["qk_norm"])
    if q_norm is not None:  # a norm over the whole projection (OLMoE), not per head
        ctx = RankContext(spec, Mapping.create(tp=1), 0, moe_layer,
                          BY_TORCH_NAME[spec.torch_dtype])
        flags["qk_norm_projection"] = q_norm.shape(ctx) != (spec.head_dim,)
    common: dict[str, Any] = dict(
        name=name or spec.architecture, architecture=spec.architecture, dtype=spec.torch_dtype,
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
        num_heads=spec.num_heads, num_experts=spec.num_experts, top_k=spec.top_k,
        expert_intermediate_size=spec.expert_intermediate_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        dense_layers=tuple(dense), dense_intermediate_size=spec.dense_intermediate_size,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
        published_quant=published_quant, spec=spec, **flags)
    if isinstance(spec, DeepseekSpec):  # MLA: one latent of kv_lora_rank + rope dims per token
        return ModelShape(**common, num_kv_heads=1,
                          head_dim=spec.kv_lora_rank + spec.qk_rope_head_dim,
                          q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                          qk_nope_head_dim=spec.qk_nope_head_dim,
                          qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim)
    return ModelShape(**common, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)


def model_shape(cfg: dict[str, Any], name: str, where: str = "config.json") -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dict, normalised by its
    family (an architecture moepipe has no family for lists the supported ones)."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise CheckpointError(f"{where}: no 'architectures' entry",
                              "is this a complete Hugging Face config.json of a MoE model?")
    spec = get_family(str(archs[0])).spec(cfg, where)
    quant = cfg.get("quantization_config") or {}
    published = ("fp8_block" if quant.get("quant_method") == "fp8"
                 and quant.get("weight_block_size") else None)
    return shape_of(spec, name, published)


def load_shape(source: str | Path) -> ModelShape | None:
    """The shape of a checkpoint folder, a ``config.json`` file or a built-in example (None:
    ``source`` is none of them)."""
    from moepipe.examples import EXAMPLES

    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if os.path.lexists(path):  # a device or fifo is refused by the bounded read
        cfg = read_json(path, "a Hugging Face checkpoint folder")  # bounded, one-line errors
        return model_shape(cfg, path.parent.name if path.name == "config.json" else path.stem,
                           str(path))
    if str(source) in EXAMPLES:
        ex = EXAMPLES[str(source)]
        arch = ex.config_class.removesuffix("Config") + "ForCausalLM"
        return model_shape({"architectures": [arch], "torch_dtype": "float32", **ex.config},
                           str(source), f"example {source}")
    return None
