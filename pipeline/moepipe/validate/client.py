"""Small Triton clients for moepipe deployments (used by validate, tests and benchmarks).

HTTP uses Triton's generate extension (``/generate``, ``/generate_stream``); gRPC uses the
stream API, which decoupled models require even for a single response.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from moepipe.utils.sse import SSEParser


class ClientError(RuntimeError):
    """The server answered with an error (message as the server gave it)."""


# An answer (or a whole event stream) moepipe reads: a generate response of a few thousand
# tokens is kilobytes; a server that sends more is broken.
RESPONSE_LIMIT = 64 << 20
EVENT_LINE_LIMIT = 1 << 20  # one line of an event stream (a token's event is ~100 bytes)


def _check_size(read: int) -> None:
    if read > RESPONSE_LIMIT:
        raise ClientError(f"the server answered more than {RESPONSE_LIMIT >> 20} MiB")


def _http_base(url: str) -> str:
    return url if url.startswith("http") else f"http://{url}"


def http_json(url: str, path: str, payload: dict | None = None, timeout: float = 60) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(_http_base(url) + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read(RESPONSE_LIMIT + 1)
            _check_size(len(body))
    except urllib.error.HTTPError as e:
        body = e.read(RESPONSE_LIMIT)
        try:
            raise ClientError(json.loads(body).get("error", body.decode())) from None
        except json.JSONDecodeError:
            raise ClientError(f"HTTP {e.code}: {body[:200]!r}") from None
    out = json.loads(body) if body else {}
    if isinstance(out, dict) and "error" in out:
        raise ClientError(out["error"])
    return out


def _with(payload: dict, parameters: dict | None) -> dict:
    """``payload`` with Triton request ``parameters`` (the generate extension's own key)."""
    if not parameters:
        return payload
    return {**payload, "parameters": {**payload.get("parameters", {}), **parameters}}


def generate(url: str, model: str, payload: dict, timeout: float = 60,
             parameters: dict | None = None) -> dict:
    """One ``/generate`` request; ``parameters``: Triton request parameters."""
    return http_json(url, f"/v2/models/{model}/generate", _with(payload, parameters), timeout)


def generate_stream(url: str, model: str, payload: dict, timeout: float = 60,
                    parameters: dict | None = None) -> list[dict]:
    """All SSE events of one ``/generate_stream`` request (errors in any chunk raise)."""
    req = urllib.request.Request(_http_base(url) + f"/v2/models/{model}/generate_stream",
                                 data=json.dumps(_with(payload, parameters)).encode(),
                                 headers={"Content-Type": "application/json"})
    events: list[dict] = []
    parser = SSEParser()

    def add(found: list) -> None:
        for event in found:
            data = json.loads(event.data)
            if "error" in data:
                raise ClientError(data["error"])
            events.append(data)

    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            # pieces as they arrive: the parser finds the events whatever their boundaries;
            # the stream and each of its lines are bounded (a server that never ends a line
            # would grow the parser's buffer, and copying it, without end)
            read = line = 0
            while piece := r.read1(1 << 16):
                read += len(piece)
                _check_size(read)
                cut = max(piece.rfind(b"\n"), piece.rfind(b"\r"))
                line = line + len(piece) if cut < 0 else len(piece) - cut - 1
                if line > EVENT_LINE_LIMIT:
                    raise ClientError(f"the server sent a line of more than "
                                      f"{EVENT_LINE_LIMIT >> 20} MiB in its event stream")
                add(parser.feed(piece))
            add(parser.close())
    except urllib.error.HTTPError as e:
        body = e.read(RESPONSE_LIMIT)
        add([*parser.feed(body), *parser.close()])  # an error event raises
        raise ClientError(f"HTTP {e.code}: {body[:200].decode(errors='replace')}") from None
    return events


@dataclass
class GrpcResult:
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)


_NP = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32",
       np.dtype(np.bool_): "BOOL", np.dtype(np.uint64): "UINT64", np.dtype(object): "BYTES"}


class GrpcStream:
    """A gRPC client with one open stream, for sequential requests (decoupled models need
    the stream API even for one response). Reuse it: opening a channel costs milliseconds."""

    def __init__(self, url: str, timeout: float = 60):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.timeout = timeout
        self._results: queue.Queue = queue.Queue()
        self._client = grpcclient.InferenceServerClient(url)
        self._client.start_stream(callback=self._callback)

    def _callback(self, result=None, error=None):
        self._results.put((result, error))

    def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str],
              parameters: dict | None = None) -> GrpcResult:
        """Send one request (``parameters``: Triton request parameters); collect every
        response until its final one."""
        g = self._grpc
        tensors = []
        for name, arr in inputs.items():
            t = g.InferInput(name, list(arr.shape), _NP[arr.dtype])
            t.set_data_from_numpy(arr)
            tensors.append(t)
        self._client.async_stream_infer(model, tensors,
                                        outputs=[g.InferRequestedOutput(o) for o in outputs],
                                        enable_empty_final_response=True,
                                        parameters=parameters)
        out = GrpcResult()
        while True:
            try:
                result, error = self._results.get(timeout=self.timeout)
            except queue.Empty:
                raise ClientError(f"no response from {model} within {self.timeout:.0f}s") \
                    from None
            if error is not None:
                raise ClientError(str(error))
            response = result.get_response()
            got = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if got:
                out.outputs.append(got)
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return out

    def close(self) -> None:
        self._client.stop_stream(cancel_requests=True)
        self._client.close()

    def __enter__(self) -> GrpcStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def grpc_infer(url: str, model: str, inputs: dict[str, np.ndarray], outputs: list[str],
               timeout: float = 60, parameters: dict | None = None) -> GrpcResult:
    """One request over a fresh gRPC stream; collects every response until the final one."""
    with GrpcStream(url, timeout) as stream:
        return stream.infer(model, inputs, outputs, parameters)


def text_inputs(prompt: str, max_tokens: int, **extra) -> dict[str, np.ndarray]:
    """Ensemble inputs for one prompt, shaped [1, ...] (batch of one)."""
    inputs = {"text_input": np.array([[prompt.encode()]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32)}
    for name, value in extra.items():
        dtype = {bool: np.bool_, int: np.int32, float: np.float32}[type(value)]
        inputs[name] = np.array([[value]], dtype=dtype)
    return inputs
