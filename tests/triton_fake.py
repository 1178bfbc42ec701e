"""One stand-in for Triton's Python backend module (``triton_python_backend_utils``), for the
tests that run a repository's Python models in-process (no server).

It does what the Python backend of Triton 2.51 (triton-inference-server/python_backend r24.10)
does where a model can tell: response senders flag FINAL with ``TRITONSERVER_RESPONSE_
COMPLETE_FINAL`` (1); ``TritonError`` codes are its class attributes; a BLS request
(``InferenceRequest(...).exec()``) runs the named model of ``models`` and hands every error of
its responses over as INTERNAL, whatever its code (``src/request_executor.cc``: ``PbError(
pb_exception.what())``). Load a model with :func:`load_model`, which ships the serving core
beside it as the renderer does.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import types
import weakref
from pathlib import Path

import numpy as np

from moepipe.deploy.render.repository import SERVING_CORE, ship_serving_core
from moepipe.deploy.render.targets import SHIPPED

FINAL = 1


class Tensor:
    def __init__(self, name, value):
        self._name, self._value = name, np.asarray(value)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value


class _Text(str):
    """A string that is also its own getter: ``error.message`` reads well in an assertion,
    ``error.message()`` is pb_utils' API (the models call it)."""

    def __call__(self):
        return str(self)


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG = "UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG"
    UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS = "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"

    def __init__(self, message, code="INTERNAL"):
        self.message, self.code = _Text(message), _Text(code)

    def __call__(self):  # response.error() as pb_utils spells it; response.error reads too
        return self


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error

    def has_error(self):
        return self.error is not None

    def output_tensors(self):
        return [Tensor(k, v) for k, v in self.outputs.items()]


class Sender:
    """A response sender that records ``(response, flags)``; ``done`` is set by FINAL."""

    def __init__(self):
        self.sent, self.done, self.cancelled = [], threading.Event(), False

    def is_cancelled(self):
        return self.cancelled

    def send(self, response=None, flags=0):
        if self.done.is_set():
            raise RuntimeError("a response after the final one")  # the real backend refuses
        self.sent.append((response, flags))
        if flags & FINAL:
            self.done.set()

    def responses(self):
        return [r for r, _ in self.sent if r is not None]


class Request:
    def __init__(self, request_id="", **inputs):
        self._inputs = [Tensor(k, v) for k, v in inputs.items()]
        self._id, self.sender = request_id, Sender()

    def inputs(self):
        return self._inputs

    def request_id(self):
        return self._id

    def get_response_sender(self):
        return self.sender


class _Metric:
    def __init__(self, labels, buckets=None):
        self.labels, self.value, self.observed = labels, 0.0, []
        self.thread = None  # the thread of the last increment

    def increment(self, n):
        self.value += n
        self.thread = threading.current_thread().name

    def set(self, value):
        self.value = value

    def observe(self, value):
        self.observed.append(value)


class MetricFamily:
    """As in the Python backend, a family that is garbage-collected takes its metrics with it:
    :func:`families` sees only the families still referenced (weak references)."""

    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"
    made: list = []

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        MetricFamily.made.append(weakref.ref(self))

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
        metric = _Metric(labels, buckets)
        self.metrics.append(metric)
        return metric


def families() -> list[MetricFamily]:
    """The metric families alive now."""
    return [f for ref in MetricFamily.made if (f := ref()) is not None]


def samples(name: str) -> dict[tuple, float]:
    """sorted labels -> value of every live metric named ``name``."""
    return {tuple(sorted(m.labels.items())): m.value for f in families()
            if f.name == name for m in f.metrics}


def _input(request, name):
    return next((t for t in request.inputs() if t.name() == name), None)


def module(models: dict | None = None) -> types.ModuleType:
    """A fresh ``triton_python_backend_utils``; ``models``: name -> loaded model instance, for
    BLS requests (added to later as ``module.models``)."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.Tensor, pb.TritonError, pb.InferenceResponse = Tensor, TritonError, InferenceResponse
    pb.MetricFamily = MetricFamily
    pb.TritonModelException = RuntimeError
    pb.models = dict(models or {})
    pb.get_input_tensor_by_name = _input
    pb.get_output_tensor_by_name = lambda response, name: (
        Tensor(name, response.outputs[name]) if name in response.outputs else None)
    pb.using_decoupled_model_transaction_policy = \
        lambda cfg: cfg["model_transaction_policy"]["decoupled"]
    pb.Logger = types.SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None,
                                      log_error=lambda m: None, log_verbose=lambda m: None)

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names=(), request_id=""):
            self.model, self.request = model_name, Request(request_id)
            self.request._inputs = list(inputs)

        def exec(self, decoupled=False):
            answer = pb.models[self.model].execute([self.request])
            if answer is not None:  # a model that answers in execute
                got = [answer[0]]
            else:
                if not self.request.sender.done.wait(60):
                    raise TimeoutError(f"{self.model} sent no final response")
                got = self.request.sender.responses()
            got = [InferenceResponse(error=TritonError(r.error().message()))
                   if r.has_error() else r for r in got]
            return iter(got) if decoupled else got[-1]

    pb.InferenceRequest = InferenceRequest
    return pb


def load_model(template: Path, tmp: Path, pb: types.ModuleType, config: dict,
               name: str = "tensorrt_llm", version: str = "1", settings: dict | None = None,
               target: str | None = None):
    """``template``'s version folder (``<model>/1``) copied into ``tmp`` with the serving core
    beside it, imported with ``pb`` as ``triton_python_backend_utils``, initialized with
    ``config`` (a model_config as the server passes it); ``settings``: module globals set
    before it initializes; ``target``: the modules the renderer ships beside that target's
    models are copied too. Returns the model instance."""
    folder = tmp / "repo" / name / "1"
    folder.mkdir(parents=True)
    for path in template.iterdir():
        if path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())
    for rel, module_name in SHIPPED.get(target or "", {}).items():  # as the renderer ships
        if Path(rel).parent.parts[-2:] == (name, version):
            source = importlib.import_module(module_name).__file__
            (folder / Path(rel).name).write_bytes(Path(source).read_bytes())
    ship_serving_core(tmp / "repo")
    saved_path, saved_pb = list(sys.path), sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = pb
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_model_{id(folder)}",
                                                      folder / "model.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:  # each model has its own copy of the core, as each runs in its own process
        sys.path[:] = saved_path
        for key in [k for k in sys.modules if k.split(".")[0] == SERVING_CORE]:
            del sys.modules[key]
        if saved_pb is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved_pb
    for key, value in (settings or {}).items():
        setattr(mod, key, value)
    instance = mod.TritonPythonModel()
    instance.initialize({"model_config": json.dumps(config), "model_name": name,
                         "model_version": version, "model_repository": str(folder.parent)})
    pb.models[name] = instance
    return instance


def config(max_batch_size: int, decoupled: bool, outputs=("context_logits",),
           **parameters) -> dict:
    """A model_config as Triton passes it to ``initialize`` (parameters as strings)."""
    return {"max_batch_size": max_batch_size,
            "model_transaction_policy": {"decoupled": decoupled},
            "output": [{"name": o, "data_type": "TYPE_FP32"} for o in outputs],
            "parameters": {k: {"string_value": str(v)} for k, v in parameters.items()}}
