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
from typing import Any

import yaml

from moepipe.errors import ConfigError

KEYS = ("num_slots", "layer_updates_per_iter", "initial_global_assignments")


def check_load_balancer(block: dict[str, Any], moe_ep: int, where: str) -> None:
    """Raise ConfigError where TensorRT-LLM would reject ``block`` for ``moe_ep`` ranks."""
    extra = sorted(set(block) - set(KEYS))
    if extra:  # MoeLoadBalancerConfig is a strict pydantic model
        raise ConfigError(f"{where}: load_balancer has unknown key(s) {extra}",
                          f"TensorRT-LLM 1.2 accepts {', '.join(KEYS)}")
    slots = block.get("num_slots")
    if not isinstance(slots, int) or slots < 1 or slots % moe_ep:
        raise ConfigError(f"{where}: num_slots {slots!r} is not a multiple of moe_ep={moe_ep}",
                          "run `moepipe balance` again for this mapping")
    assignments = block.get("initial_global_assignments") or {}
    if not isinstance(assignments, dict) or not assignments:
        raise ConfigError(f"{where}: no initial_global_assignments")
    for layer, row in assignments.items():
        if not isinstance(layer, int) or not isinstance(row, list) \
                or not all(isinstance(e, int) for e in row):
            raise ConfigError(f"{where}: layer {layer!r} is not a list of expert indices")
        experts = max(row) + 1 if row else 0
        if len(row) != slots or set(row) != set(range(experts)) or experts > slots:
            raise ConfigError(f"{where}: layer {layer} does not place every expert in exactly "
                              f"{slots} slots", "run `moepipe balance` again")


def read_placement(path: Path, moe_ep: int) -> dict[str, Any]:
    """The ``load_balancer`` block of a placement file written by ``moepipe balance``, checked
    against ``moe_ep``."""
    try:
        data = yaml.safe_load(Path(path).read_text())
        block, placed_ep = data["load_balancer"], int(data["moe_ep"])
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})",
                          "write one with `moepipe balance`") from None
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
