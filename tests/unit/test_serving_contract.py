"""TensorRT-LLM 1.2's request/response rules for the tensorrt_llm model (pure numpy, no server):
rows of a batch, exclude_input_in_output's default, stop requests, the refusals and the shapes
of every response tensor. Upstream: NVIDIA/TensorRT-LLM triton_backend/inflight_batcher_llm/src/
utils.cc (createRequestsFromInputTensors), model_instance_state.cc (handleStopRequest,
fillTritonResponse)."""

import numpy as np
import pytest

from moepipe.serving.core import contract
from moepipe.serving.core.errors import RequestError


def _inputs(rows, n=4, **extra):
    width = max(len(r) for r in rows)
    out = {"input_ids": np.array([r + [0] * (width - len(r)) for r in rows], np.int32),
           "input_lengths": np.array([len(r) for r in rows], np.int32),
           "request_output_len": np.full(len(rows), n, np.int32)}
    for k, v in extra.items():
        out[k] = v if isinstance(v, np.ndarray) else np.full(len(rows), v)
    return out


def test_one_row_per_batch_entry_trimmed_by_input_lengths():
    rows = contract.parse(_inputs([[1, 2, 3], [4]]), decoupled=True, exclude_default=False)
    assert [(r.batch_index, r.prompt) for r in rows] == [(0, [1, 2, 3]), (1, [4])]


def test_exclude_input_in_output_default_is_false_and_the_request_wins():
    one = _inputs([[1, 2]])
    assert contract.parse(one, decoupled=True, exclude_default=False)[0].exclude_input is False
    assert contract.parse(one, decoupled=True, exclude_default=True)[0].exclude_input is True
    one["exclude_input_in_output"] = np.array([False])
    assert contract.parse(one, decoupled=True, exclude_default=True)[0].exclude_input is False


def test_batch_and_streaming_need_decoupled_mode():
    with pytest.raises(RequestError, match="^" + contract.ERR_BATCH_NOT_DECOUPLED):
        contract.parse(_inputs([[1], [2]]), decoupled=False, exclude_default=False)
    with pytest.raises(RequestError, match="decoupled mode"):
        contract.parse(_inputs([[1]], streaming=True), decoupled=False, exclude_default=False)


def test_rows_must_agree_on_batch_size():
    bad = _inputs([[1], [2]])
    bad["end_id"] = np.array([5], np.int32)
    with pytest.raises(RequestError, match="Expected 2 got 1"):
        contract.parse(bad, decoupled=True, exclude_default=False)


def test_stop_requests():
    assert contract.is_stop({"stop": np.array([True])})
    assert not contract.is_stop({"stop": np.array([False])})
    assert not contract.is_stop(_inputs([[1]]))


@pytest.mark.parametrize("name", sorted(contract.UNSUPPORTED))
def test_features_the_cpu_target_lacks_are_refused_by_name(name):
    inputs = _inputs([[1, 2]])
    inputs[name] = np.ones((1, 1), np.float32)
    with pytest.raises(RequestError, match=name):
        contract.parse(inputs, decoupled=True, exclude_default=False)


def test_beam_search_is_refused_and_empty_tensors_are_absent():
    with pytest.raises(RequestError, match="beam search"):
        contract.parse(_inputs([[1]], beam_width=2), decoupled=True, exclude_default=False)
    inputs = _inputs([[1]])
    inputs["lora_weights"] = np.zeros((1, 0, 0), np.float16)  # what an ensemble passes along
    inputs["embedding_bias"] = np.zeros((1, 0), np.float32)
    row = contract.parse(inputs, decoupled=True, exclude_default=False)[0]
    assert row.embedding_bias is None


def test_word_lists():
    words = np.array([[[5, 6, 7, 0], [2, 3, -1, -1]]], np.int32)  # "5 6" and "7"
    row = contract.parse(_inputs([[1]], stop_words_list=words), decoupled=True,
                         exclude_default=False)[0]
    assert row.stop_words == [[5, 6], [7]]


def test_response_shapes_follow_fill_triton_response():
    row = contract.parse(_inputs([[1, 2]], return_log_probs=True, return_num_input_tokens=True,
                                 return_num_output_tokens=True, return_perf_metrics=True),
                         decoupled=True, exclude_default=False)[0]
    perf = dict.fromkeys(contract.PERF_OUTPUTS, 1)
    res = contract.Result([1, 2, 9, 8], [-0.5, -0.25], -0.75, np.zeros((2, 11)),
                          np.zeros((2, 11)), perf)
    out = contract.response_arrays(row, res, batch_size=1, sequence_index=0,
                                   logits_dtype=np.float16)
    assert out["output_ids"].shape == (1, 1, 4) and out["output_ids"].dtype == np.int32
    assert out["sequence_length"].tolist() == [[4]]
    assert out["output_log_probs"].shape == (1, 1, 2) and out["cum_log_probs"].shape == (1, 1)
    assert out["context_logits"].shape == (1, 2, 11)
    assert out["generation_logits"].shape == (1, 1, 2, 11)
    assert out["context_logits"].dtype == np.float16
    assert out["num_input_tokens"].tolist() == [[2]] and out["num_output_tokens"].tolist() == [[4]]
    assert "batch_index" not in out and "sequence_index" not in out  # only when > 1
    assert out["arrival_time_ns"].dtype == np.int64 and out["acceptance_rate"].dtype == np.float32
    batched = contract.response_arrays(row, res, batch_size=3, sequence_index=0)
    assert batched["batch_index"].tolist() == [[0]]
