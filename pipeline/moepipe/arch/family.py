"""What a model family is: alias table, weight-mapping tables, TensorRT-LLM config fields.

Adding a MoE family = one module of data under ``moepipe.arch`` plus one line in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moepipe.arch.routing import NormalizationMode
from moepipe.arch.rules import Rule
from moepipe.arch.spec import DEFAULT_CONFIG_KEYS, ModelSpec, normalize
from moepipe.errors import UnsupportedError


@dataclass(frozen=True)
class Fixed:
    """A constant written into the TensorRT-LLM config (as opposed to a ModelSpec field name)."""

    value: Any


@dataclass(frozen=True)
class RuntimeFacts:
    """How TensorRT-LLM interprets a checkpoint ``config.json`` of this family: the facts the
    reference runtime needs that are not plain numbers in the file."""

    qk_norm: bool
    shared_expert_intermediate_size: int
    attn_bias: bool
    shared_expert_gate: bool = True  # False: the shared expert's output is added ungated
    # q/k RMSNorm over the whole projection (all heads: OLMoE), not per head (Qwen3)
    qk_norm_projection: bool = False
    dense_bias: bool = False  # attention.dense.bias, added once after the all-reduce (GPT-OSS)
    attention_sinks: bool = False  # attention.sinks: per-head softmax sink logits (GPT-OSS)
    mlp_bias: bool = False  # mlp.fc.bias / mlp.proj.bias of the routed experts (GPT-OSS)


@dataclass(frozen=True)
class Family:
    hf_architecture: str
    trtllm_architecture: str
    # TensorRT-LLM model class the architecture maps to (MODEL_MAP): decides config semantics.
    trtllm_class: str
    description: str
    layer_prefix: str  # HF prefix of decoder layer {layer}
    layer_rules: dict[str, Rule]  # TensorRT-LLM name (under transformer.layers.{i}.) -> rule
    model_rules: dict[str, tuple[str, Rule]]  # name -> ("first" | "last", rule)
    # 'renormalize' (topk -> softmax) or 'norm_topk_prob' (RENORMALIZE when the HF config sets
    # norm_topk_prob, else NONE = softmax -> topk).
    routing: str
    # Extra, family-specific TensorRT-LLM config fields: name -> ModelSpec attribute or Fixed.
    trtllm_fields: dict[str, str | Fixed]
    runtime_facts: Callable[[dict[str, Any]], RuntimeFacts]
    config_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    config_defaults: dict[str, Any] = field(default_factory=dict)
    # Names of an expert's (gate, up, down) linears in the HF checkpoint (quantize unfuses
    # transformers' fused experts into modules with these names).
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Alternative HF name of a source (template -> template), tried when the first is absent.
    source_aliases: dict[str, str] = field(default_factory=dict)
    # HF tensors that exist on disk but carry nothing TensorRT-LLM needs (regex on the full name).
    dropped: tuple[str, ...] = (r".*\.rotary_emb\.inv_freq\Z",)
    # Why TensorRT-LLM 1.2 cannot build an engine of this family (None: it can).
    no_engine: str | None = None
    # Why TensorRT-LLM 1.2's PyTorch backend cannot serve it (None: it can).
    no_pytorch: str | None = None
    quantizable: bool = True  # moepipe's quantize stage (modelopt) handles it

    def keys(self) -> dict[str, tuple[str, ...]]:
        return {**DEFAULT_CONFIG_KEYS, **self.config_keys}

    def spec(self, hf_config: dict[str, Any], where: str) -> ModelSpec:
        """Normalise an HF ``config.json`` of this family."""
        return normalize(hf_config, self.keys(), where, self.config_defaults)

    def rules_for(self, spec: ModelSpec, layer: int) -> dict[str, Rule]:
        """The rules of decoder layer ``layer`` (families with dense layers override)."""
        return self.layer_rules

    def engine_problem(self, spec: ModelSpec) -> str | None:
        """Why TensorRT-LLM 1.2's engine path cannot build this model (None: it can)."""
        return self.no_engine

    def dropped_for(self, spec: ModelSpec) -> tuple[str, ...]:
        """Patterns of HF tensors this model carries that TensorRT-LLM does not read."""
        return self.dropped

    def finish_config(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        """Family-specific edits of the TensorRT-LLM config.json (after the common keys)."""

    def normalization_mode(self, spec: ModelSpec) -> NormalizationMode:
        """TensorRT-LLM ``moe.normalization_mode`` of a model of this family."""
        if self.routing == "renormalize":
            return NormalizationMode.RENORMALIZE
        # TensorRT-LLM's own Qwen converter always writes NONE. That drops the renormalisation
        # Qwen3-MoE checkpoints ask for with norm_topk_prob=true (softmax -> topk -> divide by the
        # sum), so its engines disagree with Hugging Face. softmax->topk->renormalise is exactly
        # RENORMALIZE (topk on logits, then softmax over the k), so moepipe writes 1 there.
        return NormalizationMode.RENORMALIZE if spec.norm_topk_prob else NormalizationMode.NONE


def check_quantizable(family: Family, fmt: str) -> None:
    """Raise a one-line UnsupportedError when moepipe's quantize stage cannot take ``family``
    (``Family.quantizable``); called by the quantize pre-flight (every target) and convert's."""
    if fmt != "none" and not family.quantizable:
        raise UnsupportedError(f"quantize.format {fmt}: moepipe does not quantize "
                               f"{family.hf_architecture} yet", "use quantize.format: none")
