"""The deploy targets, as a registry: target name -> the values its templates need.

Each target is one module with a ``values(cfg, artifacts, out)`` function; its templates live in
``model_repo/targets/<name>/``. Adding a target = one module + one line here. ``SHIPPED``: plain
moepipe modules a target's Python models import from beside them (NVIDIA's container has no
moepipe), by path in the deployment folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from moepipe.deploy.render.targets import cpu, trtllm_engine, trtllm_pytorch
from moepipe.deploy.render.targets.base import Artifacts

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig

Values = Callable[["MoepipeConfig", Artifacts, Path], dict[str, str]]

TARGETS: dict[str, Values] = {
    "cpu": cpu.values,
    "trtllm-engine": trtllm_engine.values,
    "trtllm-pytorch": trtllm_pytorch.values,
}

SHIPPED: dict[str, dict[str, str]] = {
    "trtllm-pytorch": {"model_repo/tensorrt_llm/1/expert_statistic.py":
                       "moepipe.trtllm.expert_statistic"},
}

__all__ = ["SHIPPED", "TARGETS", "Artifacts", "Values"]
