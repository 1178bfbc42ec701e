"""Issue 26 item 4, against a real tritonserver: a busy refusal says "busy" in every status a
protocol carries. The session's build served once more with one KV-cache slot, one waiting
place (``deploy.max_queue_size: 1``) and ``deploy.decoupled: false`` (unary ``/infer`` and
``ModelInfer`` only exist there): two long generations hold the engine, and then every path
refuses at once with UNAVAILABLE - HTTP 503 on ``/infer`` through ``tensorrt_llm``, the ensemble
and ``tensorrt_llm_bls`` (the BLS path answered 500 before: the Python backend hands a BLS model
its composing models' errors as INTERNAL), gRPC ``UNAVAILABLE``.

``/generate`` stays 400: Triton 2.51's HTTP frontend frees the error before it reads the code
(triton-inference-server/server v2.51.0 ``src/http_server.cc``
``GenerateRequestClass::InferResponseComplete``: ``AddErrorJson(err)`` deletes ``err``, then
``HttpCodeFromError(err)``); pinned here so that a server which fixes it shows up."""

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from helpers import free_ports

tritonclient = pytest.importorskip("tritonclient.grpc")

PROMPT = [54, 260, 402, 305, 77]
BUSY = "Exceeds maximum queue size: 1 requests are waiting for one of 1 slots " \
       "(deploy.max_queue_size 1); retry later"


@pytest.fixture(scope="module")
def busy_server(deployment):
    """(config, http, grpc, metrics) of the session's build served with 1 slot + 1 waiting
    place, not decoupled; stopped by PID at the end of the module."""
    from moepipe.commands.deploy import artifacts
    from moepipe.deploy.local import lifecycle
    from moepipe.deploy.render.repository import render_deployment

    cfg, _ = deployment
    http, grpc, metrics, ranks = free_ports(4)
    busy = cfg.model_copy(deep=True)
    busy.build = busy.build.model_copy(update={"max_batch_size": 1})
    busy.deploy = busy.deploy.model_copy(update={
        "decoupled": False, "max_queue_size": 1, "output": cfg.workdir / "deploy-busy",
        "http_port": http, "grpc_port": grpc, "metrics_port": metrics, "rank_port": ranks})
    repo = render_deployment(busy, artifacts(cfg))  # the engine's slots are a serving setting
    state = cfg.workdir / "server-busy"
    lifecycle.start(repo, state, host="127.0.0.1", http_port=http, grpc_port=grpc,
                    metrics_port=metrics, timeout=busy.deploy.ready_timeout_s,
                    exit_timeout=busy.deploy.exit_timeout_s)
    try:
        yield busy, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}"
    finally:
        lifecycle.stop(state, grace=40)


def _tensor(name, value):
    value = np.asarray(value)
    dtype = "BYTES" if value.dtype == object else {np.int32: "INT32", np.bool_: "BOOL"}[
        value.dtype.type]
    data = [v.decode() if isinstance(v, bytes) else v for v in value.reshape(-1).tolist()]
    return {"name": name, "shape": list(value.shape), "datatype": dtype, "data": data}


def _llm(n, **extra):
    return {"input_ids": np.array([PROMPT], np.int32),
            "input_lengths": np.array([[len(PROMPT)]], np.int32),
            "request_output_len": np.array([[n]], np.int32), **extra}


def _text(n):
    return {"text_input": np.array([[b"Call me Ishmael."]], object),
            "max_tokens": np.array([[n]], np.int32)}


def _post(http, path, body, timeout=120):
    req = urllib.request.Request(f"http://{http}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _infer(http, model, inputs, request_id=""):
    body = {"inputs": [_tensor(k, v) for k, v in inputs.items()]}
    if request_id:
        body["id"] = request_id
    return _post(http, f"/v2/models/{model}/infer", body)


def _grpc(grpc, model, inputs):
    with tritonclient.InferenceServerClient(grpc) as client:
        tensors = []
        for name, value in inputs.items():
            t = tritonclient.InferInput(name, list(value.shape),
                                        "BYTES" if value.dtype == object else "INT32")
            t.set_data_from_numpy(value)
            tensors.append(t)
        try:
            client.infer(model, tensors)
        except tritonclient.InferenceServerException as e:
            return e.status(), e.message()
    return "OK", ""


def _active(metrics) -> float:
    """Requests the engine holds (TensorRT-LLM's active gauge: running + waiting)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("nv_trt_llm_request_metrics{")
               and 'request_type="active"' in line)


def test_busy_refusals_carry_unavailable_wherever_the_protocol_can(busy_server):
    cfg, http, grpc, metrics = busy_server
    longest = cfg.build.max_seq_len - len(PROMPT)
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        holders = [pool.submit(_infer, http, "tensorrt_llm", _llm(longest), f"hold-{i}")
                   for i in range(2)]  # the one slot and the one waiting place
        deadline = time.monotonic() + 60
        while _active(metrics) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        probes = {
            "tensorrt_llm /infer": pool.submit(_infer, http, "tensorrt_llm", _llm(1)),
            "ensemble /infer": pool.submit(_infer, http, "ensemble", _text(1)),
            "tensorrt_llm_bls /infer": pool.submit(_infer, http, "tensorrt_llm_bls", _text(1)),
            "ensemble gRPC": pool.submit(_grpc, grpc, "ensemble", _text(1)),
            "tensorrt_llm_bls gRPC": pool.submit(_grpc, grpc, "tensorrt_llm_bls", _text(1)),
            "ensemble /generate": pool.submit(_post, http, "/v2/models/ensemble/generate",
                                              {"text_input": "Call me Ishmael.",
                                               "max_tokens": 1})}
        answers = {path: f.result(timeout=120) for path, f in probes.items()}
        for i in range(2):  # done with them: stop both (a stop is answered at once)
            stop = _infer(http, "tensorrt_llm", _llm(1, stop=np.array([[True]])), f"hold-{i}")
            assert stop[0] == 200, stop
        held = [f.result(timeout=120) for f in holders]
    assert all(code == 200 for code, _ in held), held
    statuses = {path: code for path, (code, _) in answers.items()}
    assert statuses == {"tensorrt_llm /infer": 503, "ensemble /infer": 503,
                        "tensorrt_llm_bls /infer": 503,
                        "ensemble gRPC": "StatusCode.UNAVAILABLE",
                        "tensorrt_llm_bls gRPC": "StatusCode.UNAVAILABLE",
                        "ensemble /generate": 400}, answers
    for path, (_, text) in answers.items():
        assert BUSY in text, (path, text)
