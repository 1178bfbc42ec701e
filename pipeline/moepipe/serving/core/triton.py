"""What every Python model of a moepipe repository does the same way with Triton's Python
backend (``pb_utils``, passed in: this package imports nothing of the server).

Error codes and what each protocol makes of them (Triton 2.51, the server moepipe runs
locally; triton-inference-server/server ``src/http_server.cc`` ``HttpCodeFromError``, and
``src/grpc/``): INVALID_ARG -> HTTP 400 / gRPC INVALID_ARGUMENT, UNAVAILABLE -> 503 /
UNAVAILABLE, INTERNAL -> 500 / INTERNAL, on ``/v2/models/<m>/infer`` and unary ``ModelInfer``.
``/generate`` and ``/generate_stream`` answer 400 for every error a model sends, whatever its
code (``GenerateRequestClass::InferResponseComplete`` frees the error before it reads the
code); a gRPC stream carries only the error's text (``ModelStreamInferResponse.error_message``).
"""

from __future__ import annotations

import os

import numpy as np

from .errors import is_busy, triton_code

# The request parameter that pins a request to a staged (or the serving) weights version: what
# `moepipe deploy` validates a candidate with before traffic moves to it. The BLS model passes
# it on to tensorrt_llm.
VERSION_PARAMETER = "moepipe_version"


def parameters(model_config: dict) -> dict[str, str]:
    """The ``parameters`` of a parsed ``model_config`` (``json.loads(args["model_config"])``)."""
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


def request_parameters(request) -> dict:
    """A request's Triton parameters (``request.parameters()`` is a JSON object; {} when the
    request has none or the backend cannot say)."""
    import json

    try:
        value = json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def model_path(args: dict, value: str) -> str:
    """A path a model parameter names, as this server finds it: the renderer writes paths
    relative to the model's folder (``args["model_repository"]``, ``<repository>/<model>``), so
    a deployment moved or copied elsewhere still finds its files; an absolute path is kept."""
    if os.path.isabs(value):
        return value
    return os.path.normpath(os.path.join(args["model_repository"], value))


def flag(value: str | None, default: bool = False) -> bool:
    """A boolean model parameter as the templates render it (``true`` / ``false``)."""
    if value is None or not value.strip():
        return default
    return value.strip().lower() in ("1", "true", "yes")


def inputs_of(request) -> dict[str, np.ndarray]:
    """Every input tensor of a request, by name."""
    return {t.name(): t.as_numpy() for t in request.inputs()}


def error(pb_utils, failure: BaseException) -> object:
    """The ``pb_utils.TritonError`` an exception is answered with (``errors.triton_code``)."""
    return pb_utils.TritonError(str(failure), getattr(pb_utils.TritonError,
                                                      triton_code(failure)))


def error_response(pb_utils, failure: BaseException) -> object:
    return pb_utils.InferenceResponse(error=error(pb_utils, failure))


def restore_code(pb_utils, failure) -> object:
    """A composing model's error as a BLS model received it: the Python backend hands every
    such error over as INTERNAL (python_backend r24.10 ``src/request_executor.cc``: ``PbError
    (pb_exception.what())``); a busy refusal is UNAVAILABLE again."""
    if is_busy(failure.message()) and failure.code() != pb_utils.TritonError.UNAVAILABLE:
        return pb_utils.TritonError(failure.message(), pb_utils.TritonError.UNAVAILABLE)
    return failure
