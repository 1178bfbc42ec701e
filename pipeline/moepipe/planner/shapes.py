"""Every weight of a MoE model from its ``config.json`` alone, and what one GPU holds of it.

The planner needs exact bytes for models moepipe may not convert yet (DeepSeek-V3's MLA, dense
first layers, sigmoid-routing bias), so it reads the published ``config.json`` itself: one
:class:`ModelShape` per model, and :meth:`ModelShape.tensors` lists every tensor of a decoder
layer as TensorRT-LLM's checkpoint holds it (q/k/v fused, experts stacked ``[E, 2I, H]`` with
up|gate fused), each with the rule that shards it. For the families moepipe converts the
per-rank bytes equal the converter's plan exactly (tests compare them for every legal mapping).

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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from moepipe.arch.bounds import check_shape
from moepipe.errors import CheckpointError, UnsupportedError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


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
        b = DTYPE_BYTES[self.dtype]
        return max(math.prod(t.shape) for t in self.all_tensors()) * b


@functools.lru_cache(maxsize=64)
def _parameters(model: ModelShape) -> int:
    return sum(math.prod(t.shape) * t.experts for t in model.all_tensors() if not t.derived)


# -- reading config.json --------------------------------------------------------------------

def _get(cfg: dict[str, Any], where: str, *keys: str, default: Any = KeyError) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is KeyError:
        raise CheckpointError(f"{where}: missing '{keys[0]}'",
                              "is this a complete Hugging Face config.json of a MoE model?")
    return default


def _dtype(cfg: dict[str, Any]) -> str:
    d = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return d if d in DTYPE_BYTES else "bfloat16"


def _numbers(cfg: dict[str, Any], where: str, keys: dict[str, tuple[str, ...]],
             required: tuple[str, ...]) -> dict[str, Any]:
    """Normalised name -> the first of ``keys[name]`` the config gives (None when none),
    checked once by :func:`moepipe.arch.bounds.check_shape` (the check every stage shares)."""
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    for name, candidates in keys.items():
        values[name] = _get(cfg, where, *candidates,
                            default=KeyError if name in required else None)
        names[name] = next((k for k in candidates if cfg.get(k) is not None), candidates[0])
    return check_shape(values, where, names)


_GQA_KEYS = {"num_layers": ("num_hidden_layers",), "hidden_size": ("hidden_size",),
             "num_heads": ("num_attention_heads",), "num_kv_heads": ("num_key_value_heads",),
             "head_dim": ("head_dim",), "vocab_size": ("vocab_size",),
             "num_experts": ("num_local_experts", "num_experts"),
             "top_k": ("num_experts_per_tok",),
             "max_position_embeddings": ("max_position_embeddings",),
             "decoder_sparse_step": ("decoder_sparse_step",),
             "mlp_only_layers": ("mlp_only_layers",)}
_GQA_REQUIRED = ("num_layers", "hidden_size", "num_heads", "vocab_size", "num_experts", "top_k")


def _gqa(cfg: dict[str, Any], where: str, name: str, arch: str, expert_key: str,
         shared_key: str | None = None, **extra: Any) -> ModelShape:
    keys = {**_GQA_KEYS, "expert_intermediate_size": (expert_key,),
            "dense_intermediate_size": ("intermediate_size",)}
    if shared_key:
        keys["shared_expert_intermediate_size"] = (shared_key,)
    n = _numbers(cfg, where, keys, (*_GQA_REQUIRED, "expert_intermediate_size"))
    heads, h, layers = n["num_heads"], n["hidden_size"], n["num_layers"]
    sparse_step = n["decoder_sparse_step"] or 1
    dense = tuple(sorted(set(n["mlp_only_layers"] or []) | {
        layer for layer in range(layers) if (layer + 1) % sparse_step}))
    shared = n.get("shared_expert_intermediate_size") or 0
    if shared_key:
        extra.update(shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared))
    return ModelShape(
        name=name, architecture=arch, dtype=_dtype(cfg),
        vocab_size=n["vocab_size"], hidden_size=h, num_layers=layers,
        num_heads=heads, num_kv_heads=n["num_kv_heads"] or heads,
        head_dim=n["head_dim"] or h // heads,
        num_experts=n["num_experts"], top_k=n["top_k"],
        expert_intermediate_size=n["expert_intermediate_size"],
        dense_layers=dense, dense_intermediate_size=n["dense_intermediate_size"] or 0,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=n["max_position_embeddings"] or 4096, **extra)


def _mixtral(cfg, where, name):
    return _gqa(cfg, where, name, "MixtralForCausalLM", "intermediate_size")


def _qwen2(cfg, where, name):
    return _gqa(cfg, where, name, "Qwen2MoeForCausalLM", "moe_intermediate_size",
                "shared_expert_intermediate_size",
                attention_bias=bool(cfg.get("qkv_bias", cfg.get("attention_bias", True))))


def _qwen3(cfg, where, name):
    return _gqa(cfg, where, name, "Qwen3MoeForCausalLM", "moe_intermediate_size",
                qk_norm=True, attention_bias=bool(cfg.get("attention_bias", False)))


def _olmoe(cfg, where, name):
    return _gqa(cfg, where, name, "OlmoeForCausalLM", "intermediate_size",
                qk_norm=True, qk_norm_projection=True,
                attention_bias=bool(cfg.get("attention_bias", False)))


def _gpt_oss(cfg, where, name):
    bias = bool(cfg.get("attention_bias", True))
    return _gqa(cfg, where, name, "GptOssForCausalLM", "intermediate_size",
                attention_bias=bias, dense_bias=bias, attention_sinks=True, expert_bias=True,
                router_bias=True)


_DEEPSEEK_KEYS = {**_GQA_KEYS, "num_experts": ("n_routed_experts",),
                  "head_dim": ("qk_rope_head_dim",),  # MLA: heads as wide as their dims say
                  "expert_intermediate_size": ("moe_intermediate_size",),
                  "dense_intermediate_size": ("intermediate_size",),
                  **{k: (k,) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                       "qk_rope_head_dim", "v_head_dim", "n_shared_experts",
                                       "first_k_dense_replace", "moe_layer_freq")}}


def _deepseek(cfg, where, name):
    arch = cfg["architectures"][0]
    n = _numbers(cfg, where, _DEEPSEEK_KEYS,
                 (*_GQA_REQUIRED, "expert_intermediate_size", "dense_intermediate_size",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    layers = n["num_layers"]
    first_dense, freq = n["first_k_dense_replace"] or 0, n["moe_layer_freq"] or 1
    dense = tuple(layer for layer in range(layers)
                  if layer < first_dense or layer % freq)
    moe_inter = n["expert_intermediate_size"]
    quant = cfg.get("quantization_config") or {}
    published = ("fp8_block" if isinstance(quant, dict) and quant.get("quant_method") == "fp8"
                 and quant.get("weight_block_size") else None)
    return ModelShape(
        name=name, architecture=arch, dtype=_dtype(cfg),
        vocab_size=n["vocab_size"], hidden_size=n["hidden_size"],
        num_layers=layers, num_heads=n["num_heads"], num_kv_heads=1,
        head_dim=n["kv_lora_rank"] + n["qk_rope_head_dim"],
        num_experts=n["num_experts"], top_k=n["top_k"], expert_intermediate_size=moe_inter,
        shared_expert_intermediate_size=moe_inter * (n["n_shared_experts"] or 0),
        dense_layers=dense, dense_intermediate_size=n["dense_intermediate_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        q_lora_rank=n["q_lora_rank"] or 0, kv_lora_rank=n["kv_lora_rank"],
        qk_nope_head_dim=n["qk_nope_head_dim"], qk_rope_head_dim=n["qk_rope_head_dim"],
        v_head_dim=n["v_head_dim"],
        # transformers' DeepSeek-V3 router always has the bias (its config.json may not say
        # topk_method); the Hub's remote-code configs say noaux_tc
        routing_bias=cfg.get("topk_method") == "noaux_tc" or (
            arch == "DeepseekV3ForCausalLM" and cfg.get("topk_method") is None),
        max_position_embeddings=n["max_position_embeddings"] or 4096,
        published_quant=published)


# HF architectures[0] -> reader. The planner knows more families than the converter: a plan
# says what a model needs before moepipe can build it.
READERS = {
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2,
    "Qwen3MoeForCausalLM": _qwen3,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
    "OlmoeForCausalLM": _olmoe,
    "GptOssForCausalLM": _gpt_oss,
}


def model_shape(cfg: dict[str, Any], name: str, where: str = "config.json") -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dict."""
    archs = cfg.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    reader = READERS.get(arch)
    if reader is None:
        raise UnsupportedError(f"{where}: architecture {arch!r} cannot be planned",
                               f"supported: {', '.join(sorted(READERS))}")
    return reader(cfg, where, name)
