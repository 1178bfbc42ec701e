"""Which deployment targets can serve which families: one check, used by the build's
pre-flight (``stages.inspect`` for every target, ``stages.convert`` for the engine path).

The ``cpu`` target runs moepipe's reference runtime and serves every registered family. The GPU
targets serve what the pinned TensorRT-LLM (1.2) serves: the engine path builds the
architectures of ``tensorrt_llm/models/__init__.py`` ``MODEL_MAP`` (``Family.no_engine`` says
why a family is not among them); the PyTorch backend loads the Hugging Face checkpoint of the
architectures in ``tensorrt_llm/_torch/models`` (support matrix:
``docs/source/models/supported-models.md``; ``Family.no_pytorch`` says why one is not).
"""

from __future__ import annotations

from moepipe.arch.family import Family
from moepipe.arch.spec import ModelSpec
from moepipe.errors import UnsupportedError


def check_target(family: Family, target: str, spec: ModelSpec | None = None) -> None:
    """Raise a one-line UnsupportedError when ``target`` cannot serve ``family`` (or, given its
    ``spec``, this model of it: ``Family.engine_problem``)."""
    arch = family.hf_architecture
    no_engine = family.no_engine if spec is None else family.engine_problem(spec)
    if target == "trtllm-engine" and no_engine:
        hint = ("use target: trtllm-pytorch (serves the Hugging Face checkpoint) or target: cpu"
                if not family.no_pytorch else "use target: cpu (moepipe's reference runtime)")
        raise UnsupportedError(f"{arch} cannot be built for target trtllm-engine: "
                               f"{no_engine}", hint)
    if target == "trtllm-pytorch" and family.no_pytorch:
        raise UnsupportedError(f"{arch} cannot be served by target trtllm-pytorch: "
                               f"{family.no_pytorch}",
                               "use target: cpu (moepipe's reference runtime)"
                               + ("" if family.no_engine else " or target: trtllm-engine"))


def check_quantizable(family: Family, fmt: str) -> None:
    """Raise a one-line UnsupportedError when moepipe's quantize stage cannot take ``family``
    (``Family.quantizable``); called by the quantize pre-flight (every target) and convert's."""
    if fmt != "none" and not family.quantizable:
        raise UnsupportedError(f"quantize.format {fmt}: moepipe does not quantize "
                               f"{family.hf_architecture} yet", "use quantize.format: none")
