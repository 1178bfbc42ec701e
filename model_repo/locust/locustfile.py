"""Locust load test of a moepipe deployment; ``moepipe deploy`` writes it into
``<deploy>/locust/`` with ``locust.conf`` (this deployment's addresses) and ``prompts.json``.

    cd <deploy>/locust && locust                    # web UI on http://127.0.0.1:8089
    cd <deploy>/locust && locust --headless -u 8 -r 8 --run-time 2m --csv stats

Two user classes, both streaming, each reporting two rows: the whole request, and its time to
first token (TTFT: until the first response that carries text - not the response headers, not
the first byte; one network piece is not one event and one event is not one token). The size
column of the request rows counts output tokens, as the server counted them
(``num_output_tokens``), not bytes.

* ``GenerateStreamUser``: HTTP ``POST /v2/models/<model>/generate_stream``, server-sent events
  read by ``sse_events.py`` (beside this file: the WHATWG parser moepipe's own load driver
  uses);
* ``GrpcStreamUser``: Triton's gRPC stream API (``ModelStreamInfer``), made cooperative for
  Locust's gevent by ``grpc.experimental.gevent``.

Options (command line or locust.conf): ``--grpc-host``, ``--model``, ``--max-tokens``,
``--prompts`` (a JSON list of strings), ``--request-timeout``. Needs locust, requests, grpcio
and tritonclient (for the gRPC messages); moepipe itself need not be installed.
"""

import itertools
import json
import struct
import threading
import time
from pathlib import Path

import grpc
import grpc.experimental.gevent as grpc_gevent
import requests
from locust import User, constant, events, task
from sse_events import SSEParser
from tritonclient.grpc import service_pb2, service_pb2_grpc

grpc_gevent.init_gevent()  # gRPC's blocking calls yield to the other users

HERE = Path(__file__).parent


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--grpc-host", default="127.0.0.1:8001", help="Triton gRPC host:port.")
    parser.add_argument("--model", default="ensemble", help="The model to call.")
    parser.add_argument("--max-tokens", type=int, default=16, help="Tokens per request.")
    parser.add_argument("--prompts", default=str(HERE / "prompts.json"),
                        help="A JSON file with a list of prompts, sent in turn.")
    parser.add_argument("--request-timeout", type=float, default=60.0,
                        help="Seconds a request may take.")


class _Streaming(User):
    abstract = True
    wait_time = constant(0)  # closed loop: a user sends its next request when one ends
    kind = ""

    def on_start(self):
        opts = self.environment.parsed_options
        self.opts = opts
        self.prompts = itertools.cycle(json.loads(Path(opts.prompts).read_text()))

    def _report(self, name, start, tokens=0, error=None):
        self.environment.events.request.fire(
            request_type=self.kind, name=name, response_time=(time.perf_counter() - start) * 1e3,
            response_length=tokens, exception=error, context={})


class GenerateStreamUser(_Streaming):
    """Triton's generate extension over HTTP, streaming (server-sent events)."""

    kind = "HTTP"

    def on_start(self):
        super().on_start()
        self.session = requests.Session()

    def on_stop(self):
        self.session.close()

    @task
    def generate_stream(self):
        name = "generate_stream"
        url = f"{self.host.rstrip('/')}/v2/models/{self.opts.model}/generate_stream"
        body = {"text_input": next(self.prompts), "max_tokens": self.opts.max_tokens,
                "stream": True, "return_num_output_tokens": True}
        start, first, tokens = time.perf_counter(), False, 0
        try:
            with self.session.post(url, json=body, stream=True,
                                   timeout=self.opts.request_timeout) as answer:
                if answer.status_code != 200:
                    raise RuntimeError(f"HTTP {answer.status_code}: {answer.text[:200]}")
                parser = SSEParser()
                pieces = itertools.chain(answer.iter_content(chunk_size=None), [None])
                for piece in pieces:
                    for event in parser.feed(piece) if piece is not None else parser.close():
                        data = json.loads(event.data)
                        if "error" in data:
                            raise RuntimeError(data["error"])
                        if data.get("text_output") and not first:
                            first = True
                            self._report(f"{name} TTFT", start)
                        n = data.get("num_output_tokens")
                        tokens += int((n[0] if isinstance(n, list) else n) or 0)
        except Exception as e:  # a failed request is a row of the report, not a crash
            self._report(name, start, tokens, e)
            return
        self._report(name, start, tokens, None if first else RuntimeError("no text streamed"))


def _tensor(request, name, datatype, raw):
    t = request.inputs.add()
    t.name, t.datatype = name, datatype
    t.shape.extend([1, 1])
    request.raw_input_contents.append(raw)


class GrpcStreamUser(_Streaming):
    """Triton's gRPC stream API, one stream per request (decoupled models answer there)."""

    kind = "gRPC"

    def on_start(self):
        super().on_start()
        self.channel = grpc.insecure_channel(self.opts.grpc_host)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.ids = itertools.count()

    def on_stop(self):
        self.channel.close()

    def _request(self):
        text = next(self.prompts).encode()
        req = service_pb2.ModelInferRequest(model_name=self.opts.model,
                                            id=f"locust-{next(self.ids)}")
        _tensor(req, "text_input", "BYTES", struct.pack("<I", len(text)) + text)
        _tensor(req, "max_tokens", "INT32", struct.pack("<i", self.opts.max_tokens))
        _tensor(req, "stream", "BOOL", b"\x01")
        _tensor(req, "return_num_output_tokens", "BOOL", b"\x01")
        for output in ("text_output", "num_output_tokens"):
            req.outputs.add().name = output
        # a decoupled model may end with an empty response that only carries the final flag
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        return req

    @task
    def stream_infer(self):
        name = "ModelStreamInfer"
        req, ended = self._request(), threading.Event()

        def send():
            yield req
            ended.wait()  # the stream stays open until the final response came

        start, first, tokens, final = time.perf_counter(), False, 0, False
        call = self.stub.ModelStreamInfer(send(), timeout=self.opts.request_timeout)
        try:
            for message in call:
                if message.error_message:
                    raise RuntimeError(message.error_message)
                response = message.infer_response
                for i, out in enumerate(response.outputs):
                    raw = response.raw_output_contents[i]
                    if out.name == "text_output" and len(raw) > 4 and not first:
                        first = True
                        self._report(f"{name} TTFT", start)
                    elif out.name == "num_output_tokens" and len(raw) >= 4:
                        tokens += struct.unpack("<i", raw[:4])[0]
                flag = response.parameters.get("triton_final_response")
                if flag is not None and flag.bool_param:
                    final = True
                    break
            if not final:
                raise RuntimeError("the stream ended without a final response")
        except Exception as e:  # a failed request is a row of the report, not a crash
            self._report(name, start, tokens, e)
            return
        finally:
            ended.set()
            call.cancel()
        self._report(name, start, tokens, None if first else RuntimeError("no text streamed"))
