"""The tensorrt_llm contract against every target's adapter, in-process (``tests/triton_fake.py``
plays Triton's Python backend): the cpu model on the reference runtime (a tiny converted
checkpoint), the trtllm-pytorch model on the scripted stand-in LLM of ``test_pytorch_adapter``.
Both answer through the one serving core, so each rule below is asserted on both, with
upstream's texts where upstream has them (NVIDIA/TensorRT-LLM triton_backend/inflight_batcher_llm
/src/utils.cc ``createRequestsFromInputTensors``, src/model_instance_state.cc
``handleStopRequest``) and Triton's queue-policy words for busy (triton-inference-server/core
src/scheduler_utils.cc)."""

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import triton_fake
from test_pytorch_adapter import _tensorrt_llm
from triton_fake import FINAL, Request

from moepipe.conversion.write import convert
from moepipe.serving.core import errors

TARGETS = Path(__file__).parents[2] / "model_repo" / "targets"
SLOTS, QUEUE = 4, 1
PROMPT = [54, 260, 402, 305, 77]


@pytest.fixture(scope="module")
def checkpoint(examples, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters") / "ckpt"
    convert(examples["tiny-qwen2-moe"], out)
    return out


def _cpu(tmp_path, decoupled, checkpoint):
    return triton_fake.load_model(
        TARGETS / "cpu" / "model_repo" / "tensorrt_llm" / "1", tmp_path, triton_fake.module(),
        triton_fake.config(SLOTS, decoupled, checkpoint_dir=checkpoint, max_seq_len=256,
                           max_input_len=128, exclude_input_in_output="false", cpu_threads=1,
                           max_queue_size=QUEUE, queue_timeout_microseconds=0))


def _pytorch(tmp_path, decoupled, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", _tensorrt_llm())
    template = tmp_path / "template"
    template.mkdir()
    source = TARGETS / "trtllm-pytorch" / "model_repo" / "tensorrt_llm" / "1"
    (template / "model.py").write_text((source / "model.py").read_text())
    (template / "model.yaml").write_text(
        "model: ../../hf\n"
        f"triton_config: {{max_batch_size: {SLOTS}, decoupled: {str(decoupled).lower()}}}\n")
    return triton_fake.load_model(template, tmp_path, triton_fake.module(), triton_fake.config(
        SLOTS, decoupled, exclude_input_in_output="false", trtllm_container="c",
        trtllm_version="stand-in", max_queue_size=QUEUE), target="trtllm-pytorch")


@pytest.fixture(params=[("cpu", True), ("cpu", False), ("trtllm-pytorch", True),
                        ("trtllm-pytorch", False)],
                ids=["cpu-decoupled", "cpu", "pytorch-decoupled", "pytorch"])
def adapter(request, tmp_path, monkeypatch):
    target, decoupled = request.param
    switch, threads = sys.getswitchinterval(), torch.get_num_threads()  # the cpu model sets
    model = _cpu(tmp_path, decoupled, request.getfixturevalue("checkpoint")) \
        if target == "cpu" else _pytorch(tmp_path, decoupled, monkeypatch)
    model.target = target
    yield model
    model.finalize()
    sys.setswitchinterval(switch)
    torch.set_num_threads(threads)


def _inputs(rows, n, **extra):
    width = max(len(r) for r in rows)
    out = {"input_ids": np.array([r + [0] * (width - len(r)) for r in rows], np.int32),
           "input_lengths": np.array([[len(r)] for r in rows], np.int32),
           "request_output_len": np.full((len(rows), 1), n, np.int32)}
    out.update({k: v if isinstance(v, np.ndarray) else np.full((len(rows), 1), v)
                for k, v in extra.items()})
    return out


def _answer(model, request, timeout=30):
    model.execute([request])
    assert request.sender.done.wait(timeout), request.sender.sent
    return request.sender.sent


def _error(model, **inputs):
    sent = _answer(model, Request(**inputs))
    assert len(sent) == 1 and sent[0][1] == FINAL and sent[0][0].has_error(), sent
    return sent[0][0].error


def _tokens(response):
    return response.outputs["output_ids"][0][0].tolist()


def _held(model):
    return model.held if model.target == "trtllm-pytorch" else model.engine.admission.held


def test_a_batch_is_answered_row_by_row_with_one_final(adapter):
    inputs = _inputs([PROMPT, PROMPT[:2]], 3, exclude_input_in_output=True)
    if not adapter.decoupled:
        error = _error(adapter, **inputs)
        assert (error.message, error.code) == (errors.ERR_BATCH_NOT_DECOUPLED, "INVALID_ARG")
        return
    sent = _answer(adapter, Request(**inputs))
    rows = {int(r.outputs["batch_index"][0][0]): _tokens(r) for r, _ in sent if r}
    alone = {b: _tokens(_answer(adapter, Request(**_inputs([p], 3, exclude_input_in_output=True
                                                             )))[-1][0])
             for b, p in enumerate([PROMPT, PROMPT[:2]])}
    assert rows == alone and all(len(t) == 3 for t in rows.values())
    assert [flags for _, flags in sent].count(FINAL) == 1 and sent[-1][1] == FINAL


def test_streaming_is_one_token_per_response_and_needs_decoupled_mode(adapter):
    inputs = _inputs([PROMPT], 4, streaming=True)
    if not adapter.decoupled:
        error = _error(adapter, **inputs)
        assert (error.message, error.code) == (errors.ERR_STREAMING_NOT_DECOUPLED,
                                               "INVALID_ARG")
        return
    sent = _answer(adapter, Request(**inputs))
    streamed = [t for r, _ in sent if r for t in _tokens(r)]
    whole = _tokens(_answer(adapter, Request(**_inputs([PROMPT], 4)))[-1][0])
    assert whole == PROMPT + streamed  # the prompt is never streamed
    assert [flags for _, flags in sent].count(FINAL) == 1


def test_the_prompt_and_num_output_tokens(adapter):
    r = _answer(adapter, Request(**_inputs([PROMPT], 3, return_num_input_tokens=True,
                                           return_num_output_tokens=True)))[-1][0]
    assert _tokens(r)[:len(PROMPT)] == PROMPT and len(_tokens(r)) == len(PROMPT) + 3
    assert r.outputs["num_input_tokens"].tolist() == [[len(PROMPT)]]
    assert r.outputs["num_output_tokens"].tolist() == [[len(PROMPT) + 3]]  # every id shown
    assert "batch_index" not in r.outputs and "sequence_index" not in r.outputs


def test_stop_ends_the_request_with_the_same_id_in_both_modes(adapter):
    long = Request("r1", **_inputs([PROMPT[:1]], 250))
    adapter.execute([long])
    stop = Request("r1", **_inputs([[0]], 0), stop=True)
    assert _answer(adapter, stop) == [(stop.sender.sent[0][0], FINAL)]
    assert stop.sender.sent[0][0].outputs == {}
    assert long.sender.done.wait(30)
    finals = [r for r, flags in long.sender.sent if flags & FINAL]
    assert len(finals) == 1 and not finals[0].has_error()
    assert 1 <= len(_tokens(finals[0])) < 1 + 250


def test_stop_without_a_request_id_is_refused_in_upstream_words(adapter):
    error = _error(adapter, **_inputs([[0]], 0), stop=True)
    assert (error.message, error.code) == (errors.ERR_STOP_WITHOUT_ID, "INVALID_ARG")


@pytest.mark.parametrize("name,value,message", [
    ("temperature", np.float32("nan"), "temperature must be a finite number, got nan"),
    ("temperature", np.float32(-1), "temperature must be a finite number >= 0, got -1.0"),
    ("runtime_top_p", np.float32(1.5), "runtime_top_p must be in [0, 1], got 1.5"),
    ("runtime_top_k", np.int32(-2), "runtime_top_k must be >= 0, got -2"),
    ("repetition_penalty", np.float32(0), "repetition_penalty must be > 0, got 0.0"),
    ("request_output_len", np.int32(0), "max_tokens must be >= 1, got 0"),
])
def test_the_same_refusal_in_the_same_words_on_every_target(adapter, name, value, message):
    inputs = _inputs([PROMPT], 2)
    inputs[name] = np.full((1, 1), value)
    error = _error(adapter, **inputs)
    assert (error.message, error.code) == (message, "INVALID_ARG")
    assert not _answer(adapter, Request(**_inputs([PROMPT], 2)))[-1][0].has_error()


def test_a_feature_the_engine_lacks_is_refused_by_name(adapter):
    error = _error(adapter, **_inputs([PROMPT], 2, lora_task_id=np.array([[1]], np.uint64)))
    assert error.message == (f"lora_task_id is not supported by the {adapter.target} target: "
                             "it is for LoRA adapters (serve it on trtllm-engine)")


def test_beyond_the_slots_and_the_queue_bound_is_busy_then_served_again(adapter):
    """max_batch_size 4 + deploy.max_queue_size 1: a sixth generation is refused at once,
    UNAVAILABLE in Triton's queue-policy words; once the others end, requests are served."""
    held = [Request(f"h{i}", **_inputs([PROMPT[:1]], 250)) for i in range(SLOTS + QUEUE)]
    refused = Request(**_inputs([PROMPT], 1))
    adapter.execute([*held, refused])
    assert refused.sender.done.wait(10)
    (error, flags), = refused.sender.sent
    assert flags == FINAL and error.error.code == "UNAVAILABLE"
    assert error.error.message == (f"Exceeds maximum queue size: {QUEUE} requests are "
                                   f"waiting for one of {SLOTS} slots (deploy.max_queue_size "
                                   f"{QUEUE}); retry later")
    adapter.execute([Request(f"h{i}", **_inputs([[0]], 0), stop=True) for i in range(5)])
    for r in held:
        assert r.sender.done.wait(30)
    deadline = time.monotonic() + 10
    while _held(adapter) and time.monotonic() < deadline:  # left just after the final
        time.sleep(0.01)
    assert _held(adapter) == 0
    assert not _answer(adapter, Request(**_inputs([PROMPT], 2)))[-1][0].has_error()


# -- the text models around tensorrt_llm ------------------------------------------------------
COMMON = Path(__file__).parents[2] / "model_repo" / "common" / "model_repo"


class _Stub:
    """A composing model that answers every request with ``answer(request)``."""

    def __init__(self, pb, answer, decoupled):
        self.pb, self.answer, self.decoupled = pb, answer, decoupled

    def execute(self, requests):
        if not self.decoupled:
            return [self.answer(r) for r in requests]
        for r in requests:
            r.get_response_sender().send(self.answer(r), flags=FINAL)
        return None


@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "not-decoupled"])
def test_the_bls_passes_a_busy_refusal_on_as_unavailable(tmp_path, decoupled):
    """Issue 26 item 4: the Python backend hands a BLS model the tensorrt_llm model's
    UNAVAILABLE as INTERNAL (python_backend r24.10 src/request_executor.cc), which HTTP /infer
    answered with 500 and gRPC with INTERNAL; the BLS model restores UNAVAILABLE (503)."""
    pb = triton_fake.module()
    busy = ("Exceeds maximum queue size: 1 requests are waiting for one of 4 slots "
            "(deploy.max_queue_size 1); retry later")
    T = triton_fake.Tensor
    pb.models["preprocessing"] = _Stub(pb, lambda r: pb.InferenceResponse(output_tensors=[
        T("INPUT_ID", np.array([PROMPT], np.int32)), T("REQUEST_INPUT_LEN", [[len(PROMPT)]]),
        T("REQUEST_OUTPUT_LEN", [[4]]), T("OUT_END_ID", [[0]]), T("OUT_PAD_ID", [[0]]),
        T("STOP_WORDS_IDS", np.zeros((1, 2, 0))), T("BAD_WORDS_IDS", np.zeros((1, 2, 0))),
        T("EMBEDDING_BIAS", np.zeros((1, 0)))]), False)
    pb.models["tensorrt_llm"] = _Stub(pb, lambda r: pb.InferenceResponse(
        error=pb.TritonError(busy, pb.TritonError.UNAVAILABLE)), True)
    bls = triton_fake.load_model(COMMON / "tensorrt_llm_bls" / "1", tmp_path, pb,
                                 triton_fake.config(4, decoupled, accumulate_tokens="false",
                                                    fallback_model_name=""),
                                 name="tensorrt_llm_bls")
    request = Request(text_input=np.array([[b"hello"]], object),
                      max_tokens=np.array([[4]], np.int32))
    answered = bls.execute([request])
    if answered is not None:  # not decoupled: the one response
        request.sender.send(answered[0], FINAL)
    assert request.sender.done.wait(10)
    bls.finalize()
    error = request.sender.sent[-1][0].error
    assert (error.message, error.code) == (busy, "UNAVAILABLE")


@pytest.fixture
def postprocessing(examples, tmp_path):
    return triton_fake.load_model(
        COMMON / "postprocessing" / "1", tmp_path, triton_fake.module(),
        triton_fake.config(4, False, tokenizer_dir=examples["tiny-mixtral"],
                           skip_special_tokens="true", vocab_size=512),
        name="postprocessing")


@pytest.mark.parametrize("ids,n,message", [
    ([5, -1], 2, "token id -1 is outside the vocabulary (0..511)"),
    ([5, 512], 2, "token id 512 is outside the vocabulary (0..511)"),
    ([5, 2**31 - 1], 2, "token id 2147483647 is outside the vocabulary (0..511)"),
    ([5, 6], 3, "SEQUENCE_LENGTH 3 is outside 0..2 (the length of TOKENS_BATCH)"),
])
def test_postprocessing_refuses_ids_outside_the_vocabulary(postprocessing, ids, n, message):
    """Issue 26 item 17: an out-of-vocabulary id was a 500 with a Python traceback (or, above
    the tokenizer's ids, silently dropped from the text); now INVALID_ARG in the words the
    tensorrt_llm model uses for a prompt's ids. The other requests of the batch are decoded."""
    good = Request(TOKENS_BATCH=np.array([[[5, 6, 7]]], np.int32),
                   SEQUENCE_LENGTH=np.array([[3]], np.int32))
    bad = Request(TOKENS_BATCH=np.array([[ids]], np.int32),
                  SEQUENCE_LENGTH=np.array([[n]], np.int32))
    ok, refused = postprocessing.execute([good, bad])
    assert (refused.error.message, refused.error.code) == (message, "INVALID_ARG")
    assert not ok.has_error() and ok.outputs["OUTPUT"].shape == (1,)


@pytest.mark.parametrize("beam,streaming,message", [
    (0, False, "beam_width must be >= 1, got 0"),
    (2, False, {"cpu": "beam_width 2: beam search is not supported by the cpu target (it is on "
                       "trtllm-engine, build.max_beam_width)"}),
    (2, True, {"trtllm-pytorch": "streaming with beam_width 2 is not supported by the "
                                 "trtllm-pytorch target"})])
def test_beams_each_target_refuses(adapter, beam, streaming, message):
    """What the engine behind each adapter cannot do with beams (contract.Features)."""
    if isinstance(message, dict):
        if adapter.target not in message:
            return
        message = message[adapter.target]
    if streaming and not adapter.decoupled:
        return  # refused for needing decoupled mode first
    error = _error(adapter, **_inputs([PROMPT], 2, beam_width=np.int32(beam),
                                      streaming=streaming))
    assert (error.message, error.code) == (message, "INVALID_ARG")


def test_a_lost_rank_group_is_a_retry_later_answer_of_the_serving_core():
    """The serving core imports nothing of moepipe, so it carries the rank group's text
    itself: a generation ended by a lost rank is answered UNAVAILABLE, like a busy refusal."""
    from moepipe.ranks.errors import RANK_GROUP_LOST, RankGroupLost
    from moepipe.serving.core import errors

    assert errors.RANK_GROUP_LOST == RANK_GROUP_LOST
    assert errors.is_busy(str(RankGroupLost("rank 1 exited")))
    assert errors.triton_code(RankGroupLost("rank 1 exited")) == "UNAVAILABLE"
