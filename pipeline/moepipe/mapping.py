"""Tensor / pipeline / expert parallel mapping, with TensorRT-LLM's rank rules.

The ground floor of the rank arithmetic: it imports nothing of moepipe but its errors, so the
architecture rules, the config, the converter, the runtime and the planner all share one
:class:`Mapping` and one :func:`stage_layers` (as TensorRT-LLM's own ``tensorrt_llm/mapping.py``).
The config resolves its ``parallel`` section to a Mapping in one place,
:meth:`moepipe.config.ParallelSection.to_mapping`.

Rules (TensorRT-LLM ``tensorrt_llm/mapping.py``, 1.2.x):

* ``world_size = tp * pp`` (no context parallelism here);
* ``moe_tp * moe_ep = tp``; unset MoE sizes: none given -> ``moe_tp = tp``, one given -> the other
  is derived;
* ``tp_rank = rank % tp``, ``pp_rank = rank // tp``;
* inside a TP group, expert parallelism varies fastest: ``moe_ep_rank = tp_rank % moe_ep``,
  ``moe_tp_rank = tp_rank // moe_ep``;
* experts of an EP rank are a contiguous range; pipeline stages get contiguous layer ranges, the
  first stages taking the extra layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from moepipe.errors import MappingError


@dataclass(frozen=True)
class Mapping:
    tp: int = 1
    pp: int = 1
    moe_tp: int = 1
    moe_ep: int = 1

    @classmethod
    def create(cls, tp: int = 1, pp: int = 1, moe_tp: int | None = None,
               moe_ep: int | None = None) -> Mapping:
        """Resolve unset MoE sizes the way TensorRT-LLM does and check the products."""
        for name, value in (("tp", tp), ("pp", pp), ("moe_tp", moe_tp), ("moe_ep", moe_ep)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise MappingError(f"{name} must be a positive integer, got {value!r}")
        if moe_tp is None and moe_ep is None:
            moe_tp, moe_ep = tp, 1
        elif moe_tp is None and moe_ep is not None:
            if tp % moe_ep:
                raise MappingError(f"moe_ep={moe_ep} does not divide tp={tp}",
                                   "moe_tp * moe_ep must equal tp")
            moe_tp = tp // moe_ep
        elif moe_ep is None and moe_tp is not None:
            if tp % moe_tp:
                raise MappingError(f"moe_tp={moe_tp} does not divide tp={tp}",
                                   "moe_tp * moe_ep must equal tp")
            moe_ep = tp // moe_tp
        if moe_tp is None or moe_ep is None or moe_tp * moe_ep != tp:
            raise MappingError(f"moe_tp={moe_tp} x moe_ep={moe_ep} != tp={tp}",
                               "expert parallelism splits the tensor-parallel group: "
                               "moe_tp * moe_ep must equal tp")
        return cls(tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp

    def moe_ep_rank(self, rank: int) -> int:
        return self.tp_rank(rank) % self.moe_ep

    def moe_tp_rank(self, rank: int) -> int:
        return self.tp_rank(rank) // self.moe_ep

    def ep_experts(self, num_experts: int, rank: int) -> range:
        per = num_experts // self.moe_ep
        start = self.moe_ep_rank(rank) * per
        return range(start, start + per)

    def pp_layers(self, num_layers: int, rank: int) -> range:
        """Contiguous layer range of this rank's pipeline stage (first stages get the extra)."""
        return stage_layers(num_layers, self.pp, self.pp_rank(rank))

    def is_first_stage(self, rank: int) -> bool:
        return self.pp_rank(rank) == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.pp_rank(rank) == self.pp - 1

    def to_trtllm(self) -> dict:
        """The ``mapping`` block of a TensorRT-LLM 1.2 checkpoint ``config.json``: exactly what
        1.2's ``MappingBase.to_dict()`` writes, less ``rank`` (``tensorrt_llm/mapping.py``;
        ``PretrainedConfig`` rebuilds it with ``Mapping(**mapping)``, so any other key - such as
        0.x's ``auto_parallel`` - fails ``trtllm-build`` with a TypeError)."""
        return {
            "world_size": self.world_size,
            "gpus_per_node": 8,
            "cp_size": 1,
            "tp_size": self.tp,
            "pp_size": self.pp,
            "moe_tp_size": self.moe_tp,
            "moe_cluster_size": 1,
            "moe_ep_size": self.moe_ep,
            "attn_tp_size": self.tp,  # tp x cp, as 1.2 resolves -1 (ulysses)
            "attn_cp_size": 1,
            "cp_config": {},
            "enable_attention_dp": False,
            "enable_lm_head_tp_in_adp": False,
        }

    @classmethod
    def from_trtllm(cls, block: dict) -> Mapping:
        if block.get("cp_size", 1) != 1:
            raise MappingError("context parallelism (cp_size > 1) is not supported")
        if block.get("moe_cluster_size", 1) not in (1, -1):
            raise MappingError("moe_cluster_size > 1 is not supported")
        return cls.create(tp=block.get("tp_size", 1), pp=block.get("pp_size", 1),
                          moe_tp=block.get("moe_tp_size"), moe_ep=block.get("moe_ep_size"))

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} moe_tp={self.moe_tp} moe_ep={self.moe_ep}"


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layers of pipeline stage ``stage`` of ``pp``: contiguous, the first stages taking the
    extra layer (TensorRT-LLM's ``Mapping.pp_layers``)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class Shardable(Protocol):
    """What the sharding rules read of a model: arch's ``ModelSpec``, or the planner's
    ``ModelShape`` of a family moepipe does not convert yet."""

    @property
    def architecture(self) -> str: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def expert_intermediate_size(self) -> int: ...
    @property
    def shared_expert_intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...


def mapping_problems(spec: Shardable, m: Mapping) -> list[str]:
    """Why ``m`` cannot shard ``spec`` (empty when it can)."""
    problems = []
    if spec.num_heads % m.tp:
        problems.append(f"num_attention_heads {spec.num_heads} is not divisible by tp={m.tp}")
    if spec.num_kv_heads % m.tp and m.tp % spec.num_kv_heads:
        problems.append(f"num_key_value_heads {spec.num_kv_heads} neither divides nor is divisible "
                        f"by tp={m.tp}")
    if spec.num_experts % m.moe_ep:
        problems.append(f"num_experts {spec.num_experts} is not divisible by moe_ep={m.moe_ep}")
    if spec.expert_intermediate_size % m.moe_tp:
        problems.append(f"expert intermediate size {spec.expert_intermediate_size} is not "
                        f"divisible by moe_tp={m.moe_tp}")
    if spec.shared_expert_intermediate_size % m.tp:
        problems.append(f"shared expert intermediate size {spec.shared_expert_intermediate_size} "
                        f"is not divisible by tp={m.tp}")
    if m.pp > spec.num_layers:
        problems.append(f"pp={m.pp} exceeds the number of layers ({spec.num_layers})")
    # dense layers (DeepSeek's first_k_dense_replace; the planner's dense_layers) split by tp
    dense = getattr(spec, "first_k_dense_replace", 0) or len(getattr(spec, "dense_layers", ()))
    inter = int(getattr(spec, "dense_intermediate_size", 0) or 0)
    if dense and inter % m.tp:
        problems.append(f"dense intermediate size {inter} is not divisible by tp={m.tp}")
    return problems


def check_mapping(spec: Shardable, m: Mapping) -> None:
    """Refuse a mapping that cannot shard ``spec``, naming every reason."""
    problems = mapping_problems(spec, m)
    if problems:
        raise MappingError(f"cannot shard {spec.architecture} with {m.describe()}: "
                           + "; ".join(problems),
                           "`moepipe inspect MODEL` lists the legal mappings")


def legal_mappings(spec: Shardable, max_world_size: int = 8) -> list[Mapping]:
    """Every mapping (powers of two, world size <= ``max_world_size``) that can shard ``spec``."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= max_world_size]
    out = []
    for tp in sizes:
        for pp in sizes:
            if tp * pp > max_world_size:
                continue
            for moe_ep in sizes:
                if tp % moe_ep:
                    continue
                m = Mapping.create(tp=tp, pp=pp, moe_ep=moe_ep)
                if not mapping_problems(spec, m):
                    out.append(m)
    return out
