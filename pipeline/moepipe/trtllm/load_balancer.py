"""TensorRT-LLM's static MoE load balancer: the ``moe_config.load_balancer`` block of the LLM
API (``MoeLoadBalancerConfig`` in ``tensorrt_llm/llmapi/llm_args.py``, 1.2):

* ``num_slots``: expert slots per MoE layer, split evenly over the EP ranks (rank r holds slots
  ``[r*S, (r+1)*S)``, ``S = num_slots / moe_ep``); at least the number of experts;
* ``initial_global_assignments``: ``{layer_idx: [expert of every slot]}`` for every MoE layer,
  each list ``num_slots`` long and holding every expert at least once; ``layer_idx`` is the
  decoder layer's index, dense layers left out (upstream's EPLB example for DeepSeek-R1, whose
  first 3 layers are dense, writes keys 3..60: examples/wide_ep/ep_load_balancer/README.md);
* ``layer_updates_per_iter``: 0 keeps the placement static.

The fused MoE modules assert these at load (``_torch/modules/fused_moe/fused_moe_wide_ep.py``:
length, ``num_slots >= num_experts``, ``set(assignments) == set(range(num_experts))``) and run
the balancer only with attention data parallelism and EP > 1 (``WideEPMoE``: "Attention DP
should be used with WideEP"). Without a balancer, rank r holds experts
``[r*E/ep, (r+1)*E/ep)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeGuard

import yaml

from moepipe.arch.bounds import MAX_EXPERTS, MAX_LAYERS
from moepipe.errors import ConfigError
from moepipe.utils.bounded import decode_utf8, read_file, refuse_pickle

KEYS = ("num_slots", "layer_updates_per_iter", "initial_global_assignments")
# Slots of one layer: every expert of the largest model moepipe plans, copied on up to 16 ranks.
MAX_SLOTS = 16 * MAX_EXPERTS
PLACEMENT_LIMIT = 16 << 20  # bytes of a placement file (DeepSeek-V3's is ~100 KB)


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_load_balancer(block: dict[str, Any], moe_ep: int, where: str) -> None:
    """Raise ConfigError where TensorRT-LLM would reject ``block`` for ``moe_ep`` ranks."""
    extra = sorted(set(block) - set(KEYS))
    if extra:  # MoeLoadBalancerConfig is a strict pydantic model
        raise ConfigError(f"{where}: load_balancer has unknown key(s) {extra}",
                          f"TensorRT-LLM 1.2 accepts {', '.join(KEYS)}")
    slots = block.get("num_slots")
    if not _int(slots) or not 1 <= slots <= MAX_SLOTS or slots % moe_ep:
        raise ConfigError(f"{where}: num_slots {str(slots)[:40]} is not a multiple of "
                          f"moe_ep={moe_ep} in 1..{MAX_SLOTS}",
                          "run `moepipe balance` again for this mapping")
    assignments = block.get("initial_global_assignments") or {}
    if not isinstance(assignments, dict) or not assignments:
        raise ConfigError(f"{where}: no initial_global_assignments")
    for layer, row in assignments.items():
        if not _int(layer) or not 0 <= layer < MAX_LAYERS:
            raise ConfigError(f"{where}: layer {str(layer)[:40]} is not a decoder layer index "
                              f"in 0..{MAX_LAYERS - 1}", "run `moepipe balance` again")
        if not isinstance(row, list) or not all(_int(e) and e >= 0 for e in row):
            raise ConfigError(f"{where}: layer {layer!r} is not a list of expert indices")
        experts = max(row) + 1 if row else 0
        # experts > slots first: set(range(experts)) of a huge index would not fit in memory
        if len(row) != slots or experts > slots or set(row) != set(range(experts)):
            raise ConfigError(f"{where}: layer {layer} does not place every expert in exactly "
                              f"{slots} slots", "run `moepipe balance` again")


def read_placement(path: Path, moe_ep: int) -> dict[str, Any]:
    """The ``load_balancer`` block of a placement file written by ``moepipe balance``, checked
    against ``moe_ep``."""
    raw = read_file(path, PLACEMENT_LIMIT, "placement file")
    refuse_pickle(raw, str(path))
    try:
        data = yaml.safe_load(decode_utf8(raw, str(path)))
        block, placed_ep = data["load_balancer"], data["moe_ep"]
        if not _int(placed_ep):
            raise TypeError
    except (yaml.YAMLError, KeyError, TypeError, ValueError):
        raise ConfigError(f"{path}: not a placement written by `moepipe balance`",
                          "write one with `moepipe balance`") from None
    if placed_ep != moe_ep:
        raise ConfigError(f"{path} places experts for moe_ep={placed_ep}, the config has "
                          f"moe_ep={moe_ep}", "run `moepipe balance` again for this mapping")
    if not isinstance(block, dict):
        raise ConfigError(f"{path}: load_balancer is not a mapping")
    check_load_balancer(block, moe_ep, str(path))
    return block
