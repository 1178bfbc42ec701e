"""One bad request must not take the server down (issue 9, case 1), against the shared real
tritonserver: degenerate sampling settings are refused at the edge (NaN) or sampled safely
(temperature 1e-45), and after more such requests than there are KV-cache slots the server
still answers everybody."""

import concurrent.futures

import numpy as np
import pytest

from moepipe.validate import client
from moepipe.validate.client import ClientError


def _llm_inputs(n=6, **extra):
    ids = [54, 260, 402, 305, 77]
    inputs = {"input_ids": np.array([ids], np.int32),
              "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[n]], np.int32)}
    inputs.update({k: np.array([[v]], np.float32 if isinstance(v, float) else np.int32)
                   for k, v in extra.items()})
    return inputs


def _tokens(ep, **kw):
    res = client.grpc_infer(ep.grpc, "tensorrt_llm", _llm_inputs(**kw),
                            ["output_ids", "sequence_length"])
    return [t for out in res.outputs for t in out["output_ids"].reshape(-1).tolist()]


@pytest.mark.parametrize("name", ["temperature", "runtime_top_p", "repetition_penalty"])
def test_nan_sampling_settings_are_invalid_argument(deployment, name):
    _, ep = deployment
    with pytest.raises(ClientError, match=f"{name.removeprefix('runtime_')} must be"):
        _tokens(ep, runtime_top_k=5, **{name: float("nan")})


def test_tiny_temperature_never_takes_the_server_down(deployment):
    cfg, ep = deployment
    greedy = _tokens(ep)
    payload = {"text_input": "Call me Ishmael.", "max_tokens": 6, "temperature": 1e-45,
               "top_k": 5}
    n = cfg.build.max_batch_size + 4  # more than there are KV-cache slots
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: client.generate(ep.http, "ensemble", payload),
                                range(n)))
    assert all(a["text_output"] == answers[0]["text_output"] for a in answers)
    assert _tokens(ep, temperature=1e-45, runtime_top_k=5) == greedy  # the greedy limit
    ep.get("/v2/health/ready")
    assert client.generate(ep.http, "ensemble", {"text_input": "ok", "max_tokens": 2})


def _post(ep, body, content_type):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{ep.http}/v2/models/ensemble/generate", body,
                                 {"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded",  # curl -d
                                          "application/json"])
def test_a_5mb_body_is_a_clean_error_and_the_server_lives(deployment, content_type):
    """Issue 9 case 2: Triton's HTTP frontend (libevhtp) parsed a form-encoded body into two
    stack arrays of its size and died of SIGSEGV at ~5 MB on 8 MiB thread stacks."""
    import json

    _, ep = deployment
    body = json.dumps({"text_input": "a " * (5 << 19), "max_tokens": 4}).encode()
    assert len(body) > 5 << 20
    code, text = _post(ep, body, content_type)
    # refused before tokenizing (5 MB of text would hold the preprocessing model for seconds)
    assert code == 400 and b"max_input_len" in text and b"before tokenizing" in text, text
    ep.get("/v2/health/ready")
    assert client.generate(ep.http, "ensemble", {"text_input": "ok", "max_tokens": 2})


def test_a_64mb_form_body_is_a_clean_error_and_the_server_lives(deployment):
    """Issue 9 case 2, further: with 64 MiB thread stacks a form-encoded body of 40 MB still
    killed Triton 2.51; the server's 1 GiB stacks take bodies to ~400 MB (measured; see
    deploy/tritonserver.py SERVER_STACK_BYTES). Not JSON, so Triton refuses it before any model."""
    _, ep = deployment
    small = _post(ep, b"x=a", "application/x-www-form-urlencoded")
    code, text = _post(ep, b"x=" + b"a" * (64 << 20), "application/x-www-form-urlencoded")
    # Triton's own answer to a body that is not JSON, whatever its size (500 on /generate)
    assert (code, text) == small and b"failed to parse the request JSON" in text, text
    ep.get("/v2/health/ready")
    assert client.generate(ep.http, "ensemble", {"text_input": "ok", "max_tokens": 2})


def _metric(ep, name):
    import urllib.request

    with urllib.request.urlopen(f"http://{ep.metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_a_client_gone_mid_stream_stops_generation(deployment, model="tensorrt_llm_bls"):
    """Issue 9 case 3: an HTTP generate_stream client that disconnects after the first chunk
    stops the model's generation (the BLS path)."""
    import http.client
    import json
    import time

    cfg, ep = deployment
    max_tokens = cfg.build.max_seq_len - 32
    before = _metric(ep, "moepipe_generated_tokens_total")
    host, port = ep.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", f"/v2/models/{model}/generate_stream",
                 json.dumps({"text_input": "Call me Ishmael.", "max_tokens": max_tokens,
                             "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data:")
    conn.sock.close()  # the client is gone
    conn.close()
    deadline = time.monotonic() + 30
    time.sleep(0.5)
    while _metric(ep, "moepipe_running_requests") and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    generated = _metric(ep, "moepipe_generated_tokens_total") - before
    assert 0 < generated < max_tokens, generated


@pytest.mark.parametrize("token", [-1, 512, 2**31 - 1])
def test_postprocessing_refuses_ids_outside_the_vocabulary_in_one_line(deployment, token):
    """Issue 26 item 17: a token id outside the vocabulary sent to postprocessing was HTTP 500
    with a Python traceback (file paths and all) as its body, or silently dropped from the
    text; now 400 in the words the tensorrt_llm model uses for a prompt's ids."""
    import json
    import urllib.error
    import urllib.request

    _, ep = deployment
    body = {"inputs": [
        {"name": "TOKENS_BATCH", "shape": [1, 1, 2], "datatype": "INT32", "data": [5, token]},
        {"name": "SEQUENCE_LENGTH", "shape": [1, 1], "datatype": "INT32", "data": [2]}]}
    req = urllib.request.Request(f"http://{ep.http}/v2/models/postprocessing/infer",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(req, timeout=60)
    text = answer.value.read().decode()
    assert answer.value.code == 400, text
    assert json.loads(text) == {"error": f"token id {token} is outside the vocabulary (0..511)"}
    assert client.generate(ep.http, "ensemble", {"text_input": "ok", "max_tokens": 2})
