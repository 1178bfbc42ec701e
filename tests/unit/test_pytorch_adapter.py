"""The trtllm-pytorch target's Triton model (TensorRT-LLM's LLM API behind the tensorrt_llm
contract) with stand-ins: TensorRT-LLM cannot be installed here, so a scripted ``LLM`` plays the
generator and ``triton_python_backend_utils`` is a minimal in-process copy. What is checked is
the adapter's own logic - rows of a batch, ``stop`` by request id, refusals - not TensorRT-LLM.
"""

import asyncio
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import triton_fake
from triton_fake import FINAL
from triton_fake import Request as _Request

TEMPLATE = (Path(__file__).parents[2] / "model_repo" / "targets" / "trtllm-pytorch"
            / "model_repo" / "tensorrt_llm" / "1")


class _Result:
    """A generate_async result: one token per step (prompt[-1] + 1, + 2, ...) until
    max_tokens or abort()."""

    def __init__(self, prompt, max_tokens):
        self.prompt, self.max_tokens, self.finished, self.aborted = prompt, max_tokens, False, False
        self.outputs = [types.SimpleNamespace(token_ids=[], logprobs=[], cumulative_logprob=0.0)]

    def abort(self):
        self.aborted = True

    def __aiter__(self):
        return self._steps()

    async def _steps(self):
        seq = self.outputs[0]
        while len(seq.token_ids) < self.max_tokens and not self.aborted:
            await asyncio.sleep(0.002)
            seq.token_ids.append(self.prompt[-1] + len(seq.token_ids) + 1)
            self.finished = len(seq.token_ids) == self.max_tokens
            yield self
        self.finished = True


def _tensorrt_llm():
    trt = types.ModuleType("tensorrt_llm")
    trt.__version__ = "stand-in"

    class LLM:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            self.tokenizer = types.SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))

        def generate_async(self, inputs, sampling_params, streaming):
            return _Result(inputs["prompt_token_ids"], sampling_params.max_tokens)

        def shutdown(self):
            pass

    trt.LLM, trt.SamplingParams = LLM, lambda **kw: types.SimpleNamespace(**kw)
    return trt


def _load(monkeypatch, tmp_path, decoupled, model_yaml="", **extra):
    """The model as Triton loads it: model.py and model.yaml in the version folder, beside
    them the serving core and the modules the renderer ships
    (moepipe.deploy.render.targets.SHIPPED)."""
    monkeypatch.setitem(sys.modules, "tensorrt_llm", _tensorrt_llm())
    monkeypatch.setattr(triton_fake.MetricFamily, "made", [])
    monkeypatch.delitem(sys.modules, "expert_statistic", raising=False)
    template = tmp_path / "template"
    template.mkdir()
    (template / "model.py").write_text((TEMPLATE / "model.py").read_text())
    (template / "model.yaml").write_text(
        "model: ../../hf\n"  # as rendered: relative to the model's folder
        f"triton_config: {{max_batch_size: 4, decoupled: {str(decoupled).lower()}}}\n"
        + model_yaml)
    return triton_fake.load_model(
        template, tmp_path, triton_fake.module(), triton_fake.config(
            4, decoupled, exclude_input_in_output="false", trtllm_container="c",
            trtllm_version="stand-in", max_queue_size="1", **extra),
        settings={"STATISTIC_POLL_S": 0.05}, target="trtllm-pytorch")


@pytest.fixture(params=[True, False], ids=["decoupled", "not-decoupled"])
def model(request, monkeypatch, tmp_path):
    instance = _load(monkeypatch, tmp_path, request.param)
    yield instance
    instance.finalize()


def _inputs(rows, n, **extra):
    width = max(len(r) for r in rows)
    out = {"input_ids": np.array([r + [0] * (width - len(r)) for r in rows], np.int32),
           "input_lengths": np.array([[len(r)] for r in rows], np.int32),
           "request_output_len": np.full((len(rows), 1), n, np.int32)}
    out.update({k: np.full((len(rows), 1), v) for k, v in extra.items()})
    return out


def _run(model, request):
    result = model.execute([request])
    if result is not None:  # not decoupled: the one response
        request.sender.sent.append((result[0], FINAL))
        request.sender.done.set()
    assert request.sender.done.wait(10)
    return request.sender.sent


def test_the_checkpoint_is_found_relative_to_the_model_folder(model, tmp_path):
    """model.yaml names the checkpoint relative to <repository>/tensorrt_llm (issue 25 item
    1: the deployment may have moved); TensorRT-LLM gets it resolved against the folder the
    Python backend passes as args["model_repository"], not against the server's cwd."""
    assert model.llm.kwargs["model"] == str(tmp_path / "hf")


def test_every_row_of_a_batch_is_served(model):
    request = _Request(**_inputs([[10, 11], [20]], 3, exclude_input_in_output=True))
    sent = _run(model, request)
    if not model.decoupled:  # TensorRT-LLM's backend refuses it the same way
        assert "Batch size > 1 requires" in sent[0][0].error.message
        return
    rows = {int(r.outputs["batch_index"][0][0]): r.outputs["output_ids"][0][0].tolist()
            for r, _ in sent if r is not None}
    assert rows == {0: [12, 13, 14], 1: [21, 22, 23]}
    assert [flags for _, flags in sent].count(FINAL) == 1 and sent[-1][1] == FINAL


def test_output_includes_the_prompt_by_default(model):
    sent = _run(model, _Request(**_inputs([[10, 11]], 2)))
    assert sent[-1][0].outputs["output_ids"][0][0].tolist() == [10, 11, 12, 13]
    assert "batch_index" not in sent[-1][0].outputs  # only when the batch has > 1 row


def test_stop_ends_the_request_with_the_same_id(model):
    if not model.decoupled:
        pytest.skip("non-decoupled execute() waits for its request (documented)")
    long = _Request("r1", **_inputs([[5]], 100000))
    model.execute([long])
    time.sleep(0.05)
    stop = _Request("r1", **_inputs([[0]], 0), stop=True)
    model.execute([stop])
    assert stop.sender.sent == [(stop.sender.sent[0][0], FINAL)]
    assert stop.sender.sent[0][0].outputs == {}
    assert long.sender.done.wait(10)
    tokens = long.sender.sent[-1][0].outputs["output_ids"][0][0].tolist()
    assert 1 < len(tokens) < 100000


def test_stop_without_a_request_id_and_unserved_features_are_refused(model):
    sent = _run(model, _Request(**_inputs([[5]], 1), stop=True))
    assert "request ID is not provided" in sent[0][0].error.message
    sent = _run(model, _Request(**_inputs([[5]], 1), return_context_logits=True))
    assert "return_context_logits is not supported" in sent[0][0].error.message


@pytest.mark.parametrize("name,value", [("temperature", float("nan")), ("temperature", -1.0),
                                        ("runtime_top_p", float("inf")), ("runtime_top_p", 1.5),
                                        ("runtime_top_k", -2), ("repetition_penalty", 0.0),
                                        ("presence_penalty", float("nan"))])
def test_degenerate_sampling_settings_are_refused_and_others_served(model, name, value):
    """Issue 9 case 1 on this target: refused at the edge with the setting's name; the next
    request is served."""
    dtype = np.int32 if name == "runtime_top_k" else np.float32
    sent = _run(model, _Request(**_inputs([[5]], 2, **{name: dtype(value)})))
    assert sent[0][0].error is not None and name in sent[0][0].error.message
    assert _run(model, _Request(**_inputs([[5]], 2)))[-1][0].outputs["output_ids"][0][0].size


def test_generations_beyond_the_slots_and_the_queue_bound_are_refused_as_busy(model):
    """max_batch_size 4 + deploy.max_queue_size 1: a sixth generation is refused at once,
    UNAVAILABLE in Triton's queue-policy words; once they end, requests are served again."""
    if not model.decoupled:
        pytest.skip("non-decoupled execute() waits for its request (documented)")
    held = [_Request(f"r{i}", **_inputs([[5]], 100000)) for i in range(5)]
    model.execute(held)
    sent = _run(model, _Request(**_inputs([[5]], 1)))
    error = sent[0][0].error
    assert error.code == "UNAVAILABLE"
    assert error.message == ("Exceeds maximum queue size: 1 requests are waiting for one of 4 "
                             "slots (deploy.max_queue_size 1); retry later")
    time.sleep(0.05)  # the generations have started (a stop finds only started ones)
    model.execute([_Request(f"r{i}", **_inputs([[0]], 0), stop=True) for i in range(5)])
    for r in held:
        assert r.sender.done.wait(10)
    for _ in range(500):  # a generation leaves the bound just after its final response
        if not model.held:
            break
        time.sleep(0.01)
    sent = _run(model, _Request(**_inputs([[10, 11]], 2)))
    assert sent[-1][0].outputs["output_ids"][0][0].tolist() == [10, 11, 12, 13]


def test_generated_and_prompt_tokens_are_counted(model):
    _run(model, _Request(**_inputs([[10, 11]], 3)))
    _run(model, _Request(**_inputs([[7]], 2)))
    key = (("model", "tensorrt_llm"),)
    for _ in range(200):  # counted when the generation's coroutine ends
        if triton_fake.samples("moepipe_generated_tokens_total").get(key) == 5:
            break
        time.sleep(0.01)
    assert triton_fake.samples("moepipe_generated_tokens_total") == {key: 5}
    assert triton_fake.samples("moepipe_prompt_tokens_total") == {key: 3}


def test_expert_statistics_are_exported_once_tensorrt_llm_writes_them(monkeypatch, tmp_path):
    """deploy.trtllm.expert_statistic: model.py gives TensorRT-LLM the window and folder where
    the server's environment lacks them, waits for this run's dump (upstream's format, as
    tests/unit/trtllm_dump.py writes it), combines the ranks (attention DP here) and exports
    moepipe_expert_tokens_total from the request loop's thread."""
    import os

    from trtllm_dump import simulate

    for key in ("EXPERT_STATISTIC_ITER_RANGE", "EXPERT_STATISTIC_PATH"):
        monkeypatch.delenv(key, raising=False)
    folder = tmp_path / "stats"
    model = _load(monkeypatch, tmp_path, True,
                  "tensor_parallel_size: 2\npipeline_parallel_size: 1\n"
                  "enable_attention_dp: true\nmoe_config: {load_balancer: null}\n",
                  expert_statistic_iters="2-5", expert_statistic_path=str(folder))
    try:
        assert os.environ["EXPERT_STATISTIC_ITER_RANGE"] == "2-5"
        assert os.environ["EXPERT_STATISTIC_PATH"] == str(folder)
        time.sleep(0.2)
        assert not triton_fake.samples("moepipe_expert_tokens_total")  # nothing written yet
        truth = simulate(folder, tp=2, pp=1, attention_dp=True, layers=[1, 2], experts=4,
                         top_k=2, span="2-5")
        for _ in range(200):
            if triton_fake.samples("moepipe_expert_tokens_total"):
                break
            time.sleep(0.02)
        got = triton_fake.samples("moepipe_expert_tokens_total")
        assert got == {(("expert", str(e)), ("layer", str(layer)), ("model", "tensorrt_llm"),
                        ("window", "2-5")): int(truth[layer][e])
                       for layer in (1, 2) for e in range(4)}
        threads = {m.thread for f in triton_fake.families() for m in f.metrics
                   if f.name == "moepipe_expert_tokens_total"}
        assert threads == {"moepipe-trtllm-requests"}
    finally:
        model.finalize()
