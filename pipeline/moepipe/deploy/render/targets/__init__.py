"""Each target's template values: target name -> ``values(cfg, artifacts, paths)`` (``paths``:
where the served deployment finds its files, :class:`moepipe.deploy.serve_paths.ServePaths`).

What a target needs and supports is declared in :mod:`moepipe.targets`; here is only how its
templates (``model_repo/targets/<name>/``) are filled. A declared target without a module here
cannot be rendered (a unit test keeps the two registries equal).
``SHIPPED``: plain moepipe modules a target's Python models import from beside them (NVIDIA's
container has no moepipe), by path in the deployment folder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from moepipe.deploy.render.targets import cpu, trtllm_engine, trtllm_pytorch
from moepipe.deploy.render.targets.base import Artifacts
from moepipe.deploy.serve_paths import ServePaths
from moepipe.errors import MoepipeError

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig

Values = Callable[["MoepipeConfig", Artifacts, ServePaths], dict[str, str]]

VALUES: dict[str, Values] = {
    "cpu": cpu.values,
    "trtllm-engine": trtllm_engine.values,
    "trtllm-pytorch": trtllm_pytorch.values,
}


def values_of(target: str) -> Values:
    """The template values of ``target``."""
    try:
        return VALUES[target]
    except KeyError:
        raise MoepipeError(f"target '{target}' cannot be rendered yet",
                           f"renderable: {', '.join(VALUES)}") from None


SHIPPED: dict[str, dict[str, str]] = {
    "trtllm-pytorch": {"model_repo/tensorrt_llm/1/expert_statistic.py":
                       "moepipe.trtllm.expert_statistic"},
}

__all__ = ["SHIPPED", "VALUES", "Artifacts", "Values", "values_of"]
