"""OLMoE (``OlmoeForCausalLM``) -> a moepipe (TensorRT-LLM-style) checkpoint.

TensorRT-LLM 1.2 has no OLMoE model: ``tensorrt_llm/models/__init__.py`` ``MODEL_MAP`` has no
entry for it (no engine path) and the PyTorch backend's support matrix
(``docs/source/models/supported-models.md``) does not list it. moepipe converts it for its own
reference runtime (the ``cpu`` target); the GPU targets refuse it (``no_engine``,
``no_pytorch``, checked by ``moepipe.targets``).

What differs from Qwen3-MoE (transformers ``models/olmoe/modeling_olmoe.py``):

* q/k RMSNorm over the *whole* projection (``q_norm`` [heads * head_dim], ``k_norm``
  [kv_heads * head_dim]), before the heads are split - not per head. Under tensor parallelism
  each rank keeps its heads' slice of the norm weight and the mean square is taken over all
  ranks (vLLM all-gathers q/k for the same reason);
* softmax over all experts, then top-k, weights not renormalised (``norm_topk_prob`` false in
  the published configs: TensorRT-LLM ``normalization_mode`` 0);
* no shared expert, no attention biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moepipe.arch.common import ATTENTION, MLP_EXPERTS, MODEL_RULES
from moepipe.arch.family import Family, Fixed, RuntimeFacts
from moepipe.arch.geometry import COLUMN, Geometry, Part, chunk
from moepipe.arch.rules import (
    ExpertsDown,
    ExpertsGatedPair,
    Router,
    Rule,
    kv_rows,
)
from moepipe.arch.spec import ModelSpec
from moepipe.errors import UnsupportedError

_ATTN = "model.layers.{layer}.self_attn."
_MLP = "model.layers.{layer}.mlp."


@dataclass(frozen=True)
class ProjectionNorm(Rule):
    """The weight of an RMSNorm over a whole q (``which="q"``) or k projection, split with the
    heads it scales: rank r keeps the entries of its own q heads / KV heads."""

    src: str
    which: str  # "q" or "k"

    def _width(self, spec: ModelSpec) -> int:
        heads = spec.num_heads if self.which == "q" else spec.num_kv_heads
        return heads * spec.head_dim

    def sources(self, ctx, reader):
        return [ctx.name(self.src)]

    def source_shapes(self, ctx):
        return {ctx.name(self.src): (self._width(ctx.spec),)}

    def _rows(self, ctx) -> slice:
        if self.which == "q":
            return chunk(self._width(ctx.spec), ctx.tp, ctx.tp_rank)
        return kv_rows(ctx)

    def shape(self, ctx):
        rows = self._rows(ctx)
        return (rows.stop - rows.start,)

    def geometry(self, ctx, fused=False):
        src = ctx.name(self.src)
        return Geometry(COLUMN, ((Part(src, rows=self._rows(ctx)),),), (src,))


_EXPERTS = MLP_EXPERTS


def olmoe_runtime_facts(cfg: dict[str, Any]) -> RuntimeFacts:
    """OLMoE: q/k norms over the whole projection, no shared expert."""
    return RuntimeFacts(qk_norm=True, shared_expert_intermediate_size=0,
                        attn_bias=bool(cfg.get("attn_bias", False)), qk_norm_projection=True)


class OlmoeFamily(Family):
    """OLMoE refuses what the converter and runtime do not implement (``clip_qkv``)."""

    def spec(self, hf_config: dict[str, Any], where: str) -> ModelSpec:
        if hf_config.get("clip_qkv") is not None:
            raise UnsupportedError(f"{where}: clip_qkv {hf_config['clip_qkv']} is not supported",
                                   "moepipe converts OLMoE checkpoints with clip_qkv: null (as "
                                   "published)")
        return super().spec(hf_config, where)


OLMOE = OlmoeFamily(
    hf_architecture="OlmoeForCausalLM",
    trtllm_architecture="OlmoeForCausalLM",
    trtllm_class="",  # not in TensorRT-LLM 1.2's MODEL_MAP
    description="OLMoE: softmax -> top-k routing without renormalisation, q/k RMSNorm over "
                "the whole projection",
    layer_prefix="model.layers.{layer}.",
    layer_rules={
        **ATTENTION,
        "attention.q_layernorm.weight": ProjectionNorm(_ATTN + "q_norm.weight", "q"),
        "attention.k_layernorm.weight": ProjectionNorm(_ATTN + "k_norm.weight", "k"),
        "mlp.router.weight": Router(_MLP + "gate.weight"),
        "mlp.fc.weight": ExpertsGatedPair(_EXPERTS),
        "mlp.proj.weight": ExpertsDown(_EXPERTS),
    },
    model_rules=MODEL_RULES,
    routing="norm_topk_prob",
    config_keys={"expert_intermediate_size": ("intermediate_size",),
                 "dense_intermediate_size": ("intermediate_size",)},
    trtllm_fields={
        "mlp_bias": Fixed(False),
        "attn_bias": "attention_bias",
        "rotary_base": "rope_theta",
        "rotary_scaling": Fixed(None),
        "tie_word_embeddings": "tie_word_embeddings",
        # moepipe's own key (TensorRT-LLM has no OLMoE): q/k norms span all heads
        "qk_layernorm_scope": Fixed("projection"),
    },
    runtime_facts=olmoe_runtime_facts,
    no_engine="TensorRT-LLM 1.2 has no OLMoE model (not in tensorrt_llm/models MODEL_MAP)",
    no_pytorch="TensorRT-LLM 1.2's PyTorch backend has no OLMoE model "
               "(not in tensorrt_llm/_torch/models)",
    # modelopt 0.x exports OLMoE's experts under Mixtral's w1/w2/w3 names (hf_export_handlers
    # get_expert_linear_names), which the quantize stage's unfused experts do not have
    quantizable=False,
)
