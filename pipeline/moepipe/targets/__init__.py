"""Deployment targets, as a registry: target name -> its declaration (:class:`Target`).

Adding a target = one module of data here + one registry line, its templates under
``model_repo/targets/<name>/`` and its template values in ``moepipe.deploy.render.targets``.
The config's ``target`` choices are this registry's names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from moepipe.errors import ConfigError, UnsupportedError
from moepipe.targets import cpu, trtllm_engine, trtllm_pytorch
from moepipe.targets.base import Target

if TYPE_CHECKING:
    from moepipe.arch.family import Family
    from moepipe.arch.spec import ModelSpec

TARGETS: dict[str, Target] = {t.name: t for t in (cpu.TARGET, trtllm_engine.TARGET,
                                                  trtllm_pytorch.TARGET)}

if TYPE_CHECKING:
    TargetName = str
else:  # the config model's choices (and their error message) come from the registry
    TargetName = Literal[tuple(TARGETS)]


def get_target(name: str) -> Target:
    """The declaration of target ``name``; an unknown name lists the supported ones."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ConfigError(f"target '{name}' is unknown",
                          f"choose one of {', '.join(TARGETS)}") from None


def targets_where(has: Callable[[Target], bool]) -> list[str]:
    """Names of the targets for which ``has`` holds, in registry order."""
    return [t.name for t in TARGETS.values() if has(t)]


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    if not names:
        return "none"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def quantization_problem(target: str, fmt: str, kv_cache: str) -> str | None:
    """Why ``target`` cannot serve ``quantize.format`` / ``quantize.kv_cache`` (None: it can)."""
    t = get_target(target)
    if kv_cache not in t.kv_cache_formats:
        usable = [k for k in t.kv_cache_formats if k != "none"]
        return (f"quantize.kv_cache {kv_cache} is not served by the {t.served_by}; use "
                f"{_either(usable)} (or target "
                f"{_either(targets_where(lambda o: kv_cache in o.kv_cache_formats))})")
    if fmt not in t.quant_formats:
        usable = [f for f in t.quant_formats if f != "none"]
        return (f"quantize.format {fmt} is not served by the {t.served_by}, which takes "
                f"{_either(usable)} (target "
                f"{_either(targets_where(lambda o: fmt in o.quant_formats))} serves it)")
    return None


def check_family(family: Family, target: str, spec: ModelSpec | None = None) -> None:
    """Raise a one-line UnsupportedError when ``target`` cannot take ``family`` (or, given its
    ``spec``, this model of it); the hint names the targets that can. Called by the build's
    pre-flight (``stages.inspect`` for every target, ``stages.convert`` too)."""
    t = get_target(target)
    problem = t.family_problem(family, spec)
    if problem:
        able = targets_where(lambda o: o.family_problem(family, spec) is None)
        hint = "use " + " or ".join(f"target: {name} ({TARGETS[name].served_by})"
                                    for name in able)
        raise UnsupportedError(f"{family.hf_architecture} {t.refusal}: {problem}", hint)


__all__ = ["TARGETS", "Target", "TargetName", "check_family", "get_target",
           "quantization_problem", "targets_where"]
