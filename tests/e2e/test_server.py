"""The cpu target behind a real tritonserver: Triton clients over HTTP and gRPC (plain,
streaming, concurrent) get exactly what Hugging Face transformers computes."""

import json
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from moepipe.commands.build import model_dir
from moepipe.validate import client
from moepipe.validate.client import ClientError

PROMPTS = ["The quick brown fox jumps over the lazy dog.",
           "Call me Ishmael.",
           "It was the best of times, it was the worst of times, it was the age of wisdom,",
           "A"]


@pytest.fixture(scope="module")
def reference(deployment):
    """prompt -> (prompt ids, HF greedy tokens, HF text) on the source checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, _ = deployment
    src = model_dir(cfg)
    tok = AutoTokenizer.from_pretrained(src)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        new = gen[0, len(ids):].tolist()
        if tok.eos_token_id in new:  # TensorRT-LLM's outputs stop before end_id
            new = new[:new.index(tok.eos_token_id)]
        out[prompt] = (ids, new, tok.decode(new, skip_special_tokens=True))
    return out


def _llm_inputs(ids, n=12, **extra):
    inputs = {"input_ids": np.array([ids], np.int32),
              "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[n]], np.int32),
              "end_id": np.array([[1]], np.int32)}
    extra.setdefault("exclude_input_in_output", True)  # generated tokens only
    for k, v in extra.items():
        inputs[k] = v if isinstance(v, np.ndarray) else \
            np.array([[v]], {bool: np.bool_, int: np.int32, float: np.float32}[type(v)])
    return inputs


def _tokens(result):
    """Every token of every response, in order."""
    return [t for out in result.outputs for t in out["output_ids"].reshape(-1).tolist()]


def test_http_generate_matches_transformers(deployment, reference):
    _, ep = deployment
    for prompt, (_, _, text) in reference.items():
        out = client.generate(ep.http, "ensemble", {"text_input": prompt, "max_tokens": 12,
                                                    "exclude_input_in_output": True})
        assert out["text_output"] == text
        full = client.generate(ep.http, "ensemble", {"text_input": prompt, "max_tokens": 12})
        assert full["text_output"] == prompt + text  # TensorRT-LLM's default: with the prompt


def test_bls_matches_ensemble(deployment, reference):
    _, ep = deployment
    for prompt, (_, _, text) in reference.items():
        out = client.generate(ep.http, "tensorrt_llm_bls", {"text_input": prompt,
                                                            "max_tokens": 12,
                                                            "exclude_input_in_output": True})
        assert out["text_output"] == text


def test_grpc_tokens_plain_and_streaming(deployment, reference):
    _, ep = deployment
    for ids, want, _ in reference.values():
        plain = client.grpc_infer(ep.grpc, "tensorrt_llm", _llm_inputs(ids),
                                  ["output_ids", "sequence_length"])
        assert len(plain.outputs) == 1 and _tokens(plain) == want
        stream = client.grpc_infer(ep.grpc, "tensorrt_llm", _llm_inputs(ids, streaming=True),
                                   ["output_ids"])
        assert len(stream.outputs) == len(want)  # one response per token
        assert _tokens(stream) == want


def test_streaming_text_over_grpc_and_http(deployment, reference):
    _, ep = deployment
    prompt = PROMPTS[0]
    _, want, text = reference[prompt]
    res = client.grpc_infer(ep.grpc, "ensemble", client.text_inputs(prompt, 12, stream=True),
                            ["text_output"])
    assert len(res.outputs) == len(want)
    events = client.generate_stream(ep.http, "tensorrt_llm_bls",
                                    {"text_input": prompt, "max_tokens": 12, "stream": True})
    assert len(events) == len(want)
    assert "".join(e["text_output"] for e in events) == text  # BLS accumulates tokens


def test_concurrent_ragged_requests_are_batched_and_exact(deployment, reference):
    """16 concurrent requests of different lengths: every one gets its own exact answer."""
    _, ep = deployment
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    results = [None] * len(jobs)

    def run(i):
        ids, _, _ = reference[jobs[i]]
        results[i] = _tokens(client.grpc_infer(ep.grpc, "tensorrt_llm", _llm_inputs(ids),
                                               ["output_ids", "sequence_length"]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [reference[p][1] for p in jobs]


def test_sampling_is_seeded_and_greedy_when_asked(deployment, reference):
    _, ep = deployment
    ids, want, _ = reference[PROMPTS[1]]

    def sample(**kw):
        return _tokens(client.grpc_infer(ep.grpc, "tensorrt_llm", _llm_inputs(ids, **kw),
                                         ["output_ids", "sequence_length"]))

    np_seed = {"seed": np.array([[7]], np.uint64)}
    a = sample(temperature=1.5, runtime_top_k=50, **np_seed)
    b = sample(temperature=1.5, runtime_top_k=50, **np_seed)
    c = sample(temperature=1.5, runtime_top_k=50, seed=np.array([[8]], np.uint64))
    assert a == b and a != c
    assert sample(temperature=0.0, runtime_top_k=50) == want
    assert sample(temperature=1.5, runtime_top_k=1) == want


def test_stop_words_and_exclude_input(deployment, reference):
    _, ep = deployment
    prompt = PROMPTS[0]
    ids, want, _ = reference[prompt]
    with_input = client.grpc_infer(ep.grpc, "tensorrt_llm",
                                   _llm_inputs(ids, exclude_input_in_output=False),
                                   ["output_ids", "sequence_length"])
    assert _tokens(with_input) == ids + want
    stop = np.array([[[want[2]], [1]]], np.int32)  # stop at the 3rd generated token
    res = client.grpc_infer(ep.grpc, "tensorrt_llm", {**_llm_inputs(ids),
                                                      "stop_words_list": stop},
                            ["output_ids", "sequence_length"])
    assert _tokens(res) == want[: want.index(want[2]) + 1]


def test_logits_are_the_models(deployment, reference):
    """return_context_logits / return_generation_logits give the model's real logits: those of
    transformers at every prompt position and at each generation step."""
    from transformers import AutoModelForCausalLM

    cfg, ep = deployment
    ids, want, _ = reference[PROMPTS[0]]
    res = client.grpc_infer(ep.grpc, "tensorrt_llm",
                            _llm_inputs(ids, n=3, return_context_logits=True,
                                        return_generation_logits=True),
                            ["output_ids", "context_logits", "generation_logits"])
    out = res.outputs[-1]
    hf = AutoModelForCausalLM.from_pretrained(model_dir(cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + want[:2]])).logits[0].numpy()
    assert out["context_logits"].dtype == np.float32  # build.logits_dtype
    np.testing.assert_allclose(out["context_logits"][0], logits[: len(ids)], atol=1e-3)
    np.testing.assert_allclose(out["generation_logits"][0, 0], logits[len(ids) - 1:],
                               atol=1e-3)


def _metrics(ep_metrics):
    with urllib.request.urlopen(f"http://{ep_metrics}/metrics") as r:
        text = r.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("moepipe_expert_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            layer = labels.split('layer="')[1].split('"')[0]
            counts[layer] = counts.get(layer, 0) + float(value)
    return counts, text


def _settled_metrics(ep_metrics, timeout=10.0):
    """Counters once the model has published everything: the model publishes per expert, so a
    scrape can land mid-publication (earlier tests' requests included). Settled means every
    layer has the same total (each token goes to top-k experts of every layer) and two scrapes
    a publication period apart agree."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        counts, _ = _metrics(ep_metrics)
        if counts == last and len(set(counts.values())) <= 1:
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"expert-load counters never settled: {counts}")
        last = counts
        time.sleep(0.6)  # > METRICS_PERIOD_S of the model


def test_expert_load_metrics(deployment, reference):
    cfg, ep = deployment
    metrics = f"{cfg.deploy.host}:{cfg.deploy.metrics_port}"
    before = _settled_metrics(metrics)
    ids, want, _ = reference[PROMPTS[0]]
    client.grpc_infer(ep.grpc, "tensorrt_llm", _llm_inputs(ids), ["output_ids"])
    # every token the model processed (prompt + all generated but the last) went to top-2
    processed = len(ids) + len(want) - 1
    after = _settled_metrics(metrics)  # the model publishes when its engine goes idle
    _, text = _metrics(metrics)
    assert set(after) == {"0", "1", "2", "3"}
    for layer in after:
        assert after[layer] - before.get(layer, 0) == 2 * processed
    assert 'moepipe_expert_tokens_total{expert="0",layer="0",model="tensorrt_llm"}' in text
    assert "nv_inference_request_summary_us" in text  # latency quantiles are on


@pytest.mark.parametrize("payload,needle", [
    ({"text_input": "", "max_tokens": 4}, "prompt (text_input) is empty"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"text_input": "hi", "max_tokens": 100000}, "exceeds max_seq_len=512"),
    ({"text_input": "hi", "max_tokens": 4, "beam_width": 2}, "beam search is not supported"),
    ({"text_input": "hi"}, "max_tokens"),
])
def test_bad_requests_get_errors_and_the_server_stays_up(deployment, payload, needle):
    _, ep = deployment
    with pytest.raises(ClientError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        client.generate(ep.http, "ensemble", payload)
    assert client.generate(ep.http, "ensemble", {"text_input": "ok", "max_tokens": 2})


def test_wrong_dtype_is_rejected_by_triton(deployment):
    _, ep = deployment
    inputs = client.text_inputs("hello", 4)
    inputs["max_tokens"] = np.array([[4.0]], np.float32)
    with pytest.raises(ClientError, match="data-type is 'FP32'"):
        client.grpc_infer(ep.grpc, "ensemble", inputs, ["text_output"])
    ep.get("/v2/health/ready")


def test_validate_command_passes_with_reports(deployment):
    cfg, _ = deployment
    proc = subprocess.run([sys.executable, "-m", "moepipe", "validate", "-c",
                           str(cfg.workdir / "moepipe.yaml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((cfg.workdir / "reports" / "validate.json").read_text())
    assert report["passed"] and [j["job"] for j in report["jobs"]] == ["smoke", "accuracy"]
    import xml.etree.ElementTree as ET

    root = ET.parse(cfg.workdir / "reports" / "validate.junit.xml").getroot()
    assert root.get("failures") == "0" and int(root.get("tests")) >= 10


def test_status_and_second_deploy_refused(deployment):
    from moepipe.commands.deploy import run_deploy

    cfg, _ = deployment
    proc = subprocess.run([sys.executable, "-m", "moepipe", "status", "--json", "-c",
                           str(cfg.workdir / "moepipe.yaml")], capture_output=True, text=True)
    info = json.loads(proc.stdout)
    assert info["running"] and info["http"] == f"127.0.0.1:{cfg.deploy.http_port}"
    assert isinstance(info["pid"], int) and info["metrics"].endswith(str(cfg.deploy.metrics_port))
    # a second deploy of the same build starts no second server: the serving version stays
    # (a new build would be a live update, issue 23)
    said: list[str] = []
    assert run_deploy(cfg, echo=said.append)["updated"] is False
    assert any("serving already; nothing to update" in line for line in said), said
    again = json.loads(subprocess.run([sys.executable, "-m", "moepipe", "status", "--json", "-c",
                                       str(cfg.workdir / "moepipe.yaml")],
                                      capture_output=True, text=True).stdout)
    assert again["pid"] == info["pid"]
