"""Routing modes: TensorRT-LLM's ``moe.normalization_mode`` and moepipe's ``RoutingSpec``.

Every MoE family's router is one point in a small space of modes (``RoutingSpec``):

* ``score``: ``softmax`` (Mixtral, Qwen, OLMoE, DeepSeek-V2) or ``sigmoid`` (DeepSeek-V3);
* ``topk_first``: top-k of the logits, then a softmax over the k (TensorRT-LLM RENORMALIZE,
  Mixtral, GPT-OSS) instead of the score of every expert, then top-k;
* ``renormalize``: divide the k weights by their sum (``norm_topk_prob``);
* ``correction_bias``: a per-expert bias added to the scores for *selection only* (DeepSeek-V3
  ``e_score_correction_bias``; the weights stay unbiased);
* ``router_bias``: a per-expert bias of the router linear (GPT-OSS), added to the logits;
* ``n_group`` / ``topk_group`` / ``group_score``: group-limited selection - experts are split
  into ``n_group`` contiguous groups, each scored by its best (``max``, DeepSeek-V2) or its two
  best (``top2_sum``, DeepSeek-V3) selection keys; only the ``topk_group`` best groups compete;
* ``routed_scaling_factor``: the final weights are multiplied by it.

Selection is deterministic: equal keys go to the lower expert id (and the lower group id), and
the k experts come out in descending order of their selection key. The selection key is the
score (plus the correction bias) when there is a correction bias or groups are scored by a sum;
otherwise it is the logit itself (softmax and sigmoid are monotonic, so this selects the same
experts as the scores do, without ties made by rounding). ``moepipe.runtime.routing.route`` is
the reference implementation; the fused OpenAI Triton kernel in ``plugins/`` follows it exactly.
``HF_ROUTING`` maps a Hugging Face architecture to its router's spec (checked against each
transformers router in the tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import IntEnum

from moepipe.errors import UnsupportedError


class NormalizationMode(IntEnum):
    NONE = 0  # softmax over all experts, then top-k
    RENORMALIZE = 1  # top-k of the logits, then softmax over the k selected
    SPARSE_MIXER = 2
    DEVICE_LIMITED = 3  # DeepSeek-V2 group-limited greedy
    DEVICE_LIMITED_RENORM = 4

    @property
    def description(self) -> str:
        """What the mode computes, for people (inspect)."""
        return {0: "softmax -> top-k (NONE)", 1: "top-k -> softmax (RENORMALIZE)",
                2: "sparse mixer (SPARSE_MIXER)", 3: "group-limited (DEVICE_LIMITED)",
                4: "group-limited, renormalised (DEVICE_LIMITED_RENORM)"}[int(self)]


NONE, RENORMALIZE, SPARSE_MIXER, DEVICE_LIMITED, DEVICE_LIMITED_RENORM = NormalizationMode

SCORES = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class RoutingSpec:
    """One routing mode; see the module docstring for each field."""

    num_experts: int
    top_k: int
    score: str = "softmax"
    topk_first: bool = False
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    router_bias: bool = False

    def __post_init__(self):
        problems = []
        if self.score not in SCORES:
            problems.append(f"score {self.score!r} (valid: {', '.join(SCORES)})")
        if self.group_score not in GROUP_SCORES:
            problems.append(f"group_score {self.group_score!r} (valid: {', '.join(GROUP_SCORES)})")
        if not 1 <= self.top_k <= self.num_experts:
            problems.append(f"top_k {self.top_k} outside 1..num_experts ({self.num_experts})")
        if self.n_group < 1 or self.num_experts % self.n_group:
            problems.append(f"n_group {self.n_group} does not divide {self.num_experts} experts")
        elif not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group {self.topk_group} outside 1..n_group ({self.n_group})")
        elif self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            problems.append(f"topk_group {self.topk_group} groups of "
                            f"{self.num_experts // self.n_group} hold fewer than top_k "
                            f"{self.top_k} experts")
        if self.group_score == "top2_sum" and self.n_group > 1 \
                and self.num_experts // self.n_group < 2:
            problems.append("group_score top2_sum needs at least 2 experts per group")
        if self.topk_first and (self.score != "softmax" or self.correction_bias):
            problems.append("topk_first is a softmax over the selected logits (no sigmoid, "
                            "no correction bias)")
        if problems:
            raise UnsupportedError("routing: " + "; ".join(problems),
                                   "check the model's router settings")

    @property
    def group_size(self) -> int:
        return self.num_experts // self.n_group

    @property
    def selects_on_scores(self) -> bool:
        """Whether selection compares scores (+ correction bias) rather than logits."""
        return self.correction_bias or (self.n_group > 1 and self.group_score == "top2_sum")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RoutingSpec:
        """The inverse of :meth:`to_dict` (unknown keys are an error)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise UnsupportedError(f"routing: unknown keys {unknown}",
                                   f"known: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_trtllm(cls, moe: dict) -> RoutingSpec:
        """TensorRT-LLM 1.2 checkpoint ``config.json`` ``moe`` section (its engine semantics:
        ``tensorrt_llm/layers/moe.py`` ``MixtureOfExperts.forward``)."""
        e, k = int(moe["num_experts"]), int(moe["top_k"])
        try:
            mode = NormalizationMode(int(moe["normalization_mode"]))
        except ValueError:
            raise UnsupportedError(f"moe.normalization_mode {moe['normalization_mode']} is not "
                                   "a TensorRT-LLM routing mode") from None
        if mode == NONE:
            return cls(e, k)
        if mode == RENORMALIZE:
            return cls(e, k, topk_first=True)
        if mode in (DEVICE_LIMITED, DEVICE_LIMITED_RENORM):
            # group_limited_greedy: softmax, group max, scores * routed_scaling_factor, top-k;
            # DEVICE_LIMITED_RENORM divides by the sum afterwards, so the factor cancels.
            renorm = mode == DEVICE_LIMITED_RENORM
            return cls(e, k, renormalize=renorm,
                       n_group=int(moe.get("device_limited_n_group", 1) or 1),
                       topk_group=int(moe.get("device_limited_topk_group", 1) or 1),
                       routed_scaling_factor=1.0 if renorm else float(
                           moe.get("device_limited_routed_scaling_factor", 1.0)))
        raise UnsupportedError(f"moe.normalization_mode {mode} is not implemented by the "
                               "reference runtime",
                               "supported: 0 NONE, 1 RENORMALIZE, 3 DEVICE_LIMITED, "
                               "4 DEVICE_LIMITED_RENORM")

    @classmethod
    def from_checkpoint_config(cls, cfg: dict) -> RoutingSpec:
        """A converted checkpoint's routing: moepipe's own ``moepipe_routing`` section when the
        converter wrote one (modes TensorRT-LLM's ``moe`` section cannot express), else
        TensorRT-LLM's ``moe`` section."""
        if cfg.get("moepipe_routing"):
            return cls.from_dict(dict(cfg["moepipe_routing"]))
        return cls.from_trtllm(cfg["moe"])

    def trtllm_normalization_mode(self) -> NormalizationMode | None:
        """The TensorRT-LLM 1.2 ``normalization_mode`` that computes exactly this routing on
        the engine path, or None when only moepipe's routing plugin can."""
        if self.score != "softmax" or self.correction_bias or self.router_bias:
            return None
        if self.n_group == 1 and self.routed_scaling_factor == 1.0:
            if self.topk_first or self.renormalize:
                return RENORMALIZE
            return NONE
        if self.group_score == "max" and not self.topk_first:
            if self.renormalize:
                return DEVICE_LIMITED_RENORM if self.routed_scaling_factor == 1.0 else None
            return DEVICE_LIMITED
        return None


def _get(cfg: dict, *names, default=None):
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _softmax_topk(cfg: dict) -> RoutingSpec:
    # Qwen2-MoE, Qwen3-MoE, OLMoE: softmax, top-k, renormalise when norm_topk_prob
    return RoutingSpec(int(_get(cfg, "num_experts", "num_local_experts")),
                       int(cfg["num_experts_per_tok"]),
                       renormalize=bool(cfg.get("norm_topk_prob", False)))


def _mixtral(cfg: dict) -> RoutingSpec:
    return RoutingSpec(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                       topk_first=True)


def _gpt_oss(cfg: dict) -> RoutingSpec:
    # GptOssTopKRouter: logits = W x + b; top-k of the logits; softmax over the k
    return RoutingSpec(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                       topk_first=True, router_bias=True)


def _deepseek_v2(cfg: dict) -> RoutingSpec:
    # DeepseekV2TopkRouter: softmax; 'group_limited_greedy' keeps the topk_group groups with
    # the best max score; weights * routed_scaling_factor (norm_topk_prob is not read)
    grouped = cfg.get("topk_method") == "group_limited_greedy"
    return RoutingSpec(int(_get(cfg, "n_routed_experts", "num_experts")),
                       int(cfg["num_experts_per_tok"]),
                       n_group=int(cfg["n_group"]) if grouped else 1,
                       topk_group=int(cfg["topk_group"]) if grouped else 1,
                       routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))


def _deepseek_v3(cfg: dict) -> RoutingSpec:
    # DeepseekV3TopkRouter (noaux_tc): sigmoid; selection on sigmoid + e_score_correction_bias;
    # groups scored by their two best; weights unbiased, renormalised, * routed_scaling_factor
    return RoutingSpec(int(_get(cfg, "n_routed_experts", "num_local_experts")),
                       int(cfg["num_experts_per_tok"]), score="sigmoid",
                       renormalize=bool(cfg.get("norm_topk_prob", False)),
                       n_group=int(cfg.get("n_group") or 1),
                       topk_group=int(cfg.get("topk_group") or 1), group_score="top2_sum",
                       routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                       correction_bias=True)


# Hugging Face ``architectures[0]`` -> its router as a RoutingSpec (from the HF config.json).
HF_ROUTING: dict[str, Callable[[dict], RoutingSpec]] = {
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _softmax_topk,
    "Qwen3MoeForCausalLM": _softmax_topk,
    "OlmoeForCausalLM": _softmax_topk,
    "GptOssForCausalLM": _gpt_oss,
    "DeepseekV2ForCausalLM": _deepseek_v2,
    "DeepseekV3ForCausalLM": _deepseek_v3,
}


def spec_from_hf(architecture: str, cfg: dict) -> RoutingSpec:
    """The routing of a Hugging Face checkpoint (``architectures[0]`` and its config.json)."""
    if architecture not in HF_ROUTING:
        raise UnsupportedError(f"no routing known for architecture {architecture!r}",
                               f"known: {', '.join(sorted(HF_ROUTING))}")
    return HF_ROUTING[architecture](cfg)
