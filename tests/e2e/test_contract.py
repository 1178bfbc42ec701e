"""The Triton contract of TensorRT-LLM 1.2's backend, checked against a live deployment.

Clients written for TensorRT-LLM's Triton backend (its ``inflight_batcher_llm/client`` examples)
must work unchanged on every moepipe target. These tests talk to a deployment exactly as those
clients do (tritonclient gRPC: the stream API with ``request_id`` in decoupled mode, unary
``infer`` otherwise) and check the tensors against TensorRT-LLM's own rules
(``tests/upstream_contract.py`` cites the upstream files).

By default they run against the cpu target, deployed twice (``deploy.decoupled`` true and
false; one server each, shared by all tests). To check another deployment, point them at it:

    MOEPIPE_CONTRACT_GRPC=host:8001 pytest tests/e2e/test_contract.py

Where a behaviour differs between targets by necessity, the test names it (``CPU_ONLY``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest
import upstream_contract as upstream

tritonclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

PROMPTS = [[5, 17, 42, 9, 33, 12], [7, 8], [100, 3, 64, 21]]
LONG = 400  # tokens asked of a request that a `stop` ends early


@dataclass
class Target:
    grpc: str
    decoupled: bool
    kind: str  # cpu | trtllm-engine | trtllm-pytorch
    logits_type: str

    def client(self):
        return tritonclient.InferenceServerClient(self.grpc)


def _kind(config) -> str:
    if config.backend == "tensorrtllm":
        return "trtllm-engine"
    return "cpu" if "checkpoint_dir" in config.parameters else "trtllm-pytorch"


def _describe(grpc_url: str) -> Target:
    with tritonclient.InferenceServerClient(grpc_url) as c:
        cfg = c.get_model_config("tensorrt_llm").config
    logits = {o.name: o.data_type for o in cfg.output}["context_logits"]
    from tritonclient.grpc import model_config_pb2

    return Target(grpc_url, cfg.model_transaction_policy.decoupled, _kind(cfg),
                  model_config_pb2.DataType.Name(logits))


@pytest.fixture(scope="session", params=["decoupled", "not-decoupled"])
def target(request):
    external = os.environ.get("MOEPIPE_CONTRACT_GRPC")
    if external:
        if request.param != "decoupled":
            pytest.skip("an external deployment runs once (its own decoupled setting)")
        return _describe(external)
    fixture = "deployment" if request.param == "decoupled" else "deployment_not_decoupled"
    _, ep = request.getfixturevalue(fixture)
    return _describe(ep.grpc)


# -- clients written like TensorRT-LLM's example clients ---------------------------------------
def prepare_tensor(name, value):
    t = tritonclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


def _u64(value):
    return np.array([[value]], np.uint64)


def llm_inputs(ids, n=8, **extra):
    """tensorrt_llm inputs of one row, shaped [1, ...] as inflight_batcher_llm_client.py does."""
    inputs = {"input_ids": np.array([ids], np.int32),
              "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[n]], np.int32)}
    for key, value in extra.items():
        inputs[key] = value if isinstance(value, np.ndarray) else np.array(
            [[value]], {bool: bool, int: np.int32, float: np.float32}[type(value)])
    return inputs


def text_inputs(prompts, n=8, **extra):
    """ensemble / BLS inputs, rows stacked as end_to_end_grpc_client.py --batch-inputs does."""
    inputs = {"text_input": np.array([[p] for p in prompts], dtype=object),
              "max_tokens": np.full((len(prompts), 1), n, np.int32)}
    for key, value in extra.items():
        dtype = {bool: bool, int: np.int32, float: np.float32}[type(value)]
        inputs[key] = np.full((len(prompts), 1), value, dtype)
    return inputs


def batched_llm_inputs(rows, n=8, **extra):
    width = max(len(r) for r in rows)
    inputs = {"input_ids": np.array([r + [0] * (width - len(r)) for r in rows], np.int32),
              "input_lengths": np.array([[len(r)] for r in rows], np.int32),
              "request_output_len": np.full((len(rows), 1), n, np.int32)}
    for key, value in extra.items():
        dtype = {bool: bool, int: np.int32, float: np.float32}[type(value)]
        inputs[key] = np.full((len(rows), 1), value, dtype)
    return inputs


def call(t: Target, model: str, inputs: dict, request_id: str = "", outputs=None):
    """Every response of one request (stream API when decoupled, unary infer otherwise);
    an error response raises InferenceServerException."""
    tensors = [prepare_tensor(k, v) for k, v in inputs.items()]
    wanted = [tritonclient.InferRequestedOutput(o) for o in outputs] if outputs else None
    with t.client() as client:
        if not t.decoupled:
            return [client.infer(model, tensors, request_id=request_id, outputs=wanted)]
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put(error or result))
        client.async_stream_infer(model, tensors, request_id=request_id, outputs=wanted)
        client.stop_stream()  # waits until the server has sent every response
    got = []
    while not results.empty():
        item = results.get()
        if isinstance(item, InferenceServerException):
            raise item
        got.append(item)
    return got


def tokens_of(result) -> list[int]:
    ids = result.as_numpy("output_ids")
    return ids[0][0][: int(result.as_numpy("sequence_length")[0][0])].tolist()


def greedy(t: Target, ids, n=8) -> list[int]:
    """Generated tokens of a plain greedy request (prompt excluded)."""
    res = call(t, "tensorrt_llm", llm_inputs(ids, n, exclude_input_in_output=True))
    return [tok for r in res for tok in tokens_of(r)]


# -- the tensors every model declares --------------------------------------------------------
@pytest.mark.parametrize("model", sorted(upstream.CONTRACT))
def test_models_declare_the_upstream_tensors(target, model):
    from tritonclient.grpc import model_config_pb2

    with target.client() as c:
        cfg = c.get_model_config(model).config
    name = model_config_pb2.DataType.Name
    inputs = {i.name: (name(i.data_type), list(i.dims), i.optional) for i in cfg.input}
    outputs = {o.name: (name(o.data_type), list(o.dims)) for o in cfg.output}
    want_in, want_out = upstream.CONTRACT[model]

    def resolve(dtype):  # upstream's type placeholders as a deployment renders them
        return target.logits_type if dtype == upstream.LOGITS else \
            "TYPE_FP16" if dtype.startswith("${") else dtype

    want_in = {k: (resolve(d), dims, opt) for k, (d, dims, opt) in want_in.items()}
    want_out = {k: (resolve(d), dims) for k, (d, dims) in want_out.items()}
    want_out |= upstream.MOEPIPE_OUTPUTS.get(model, {})  # moepipe's documented additions
    assert target.logits_type in ("TYPE_FP32", "TYPE_FP16")
    if model == "tensorrt_llm" and target.kind != "cpu":
        # trtllm-engine is TensorRT-LLM's own backend: a subset of its tensors, as declared.
        assert {k: inputs[k] for k in inputs} == {k: want_in[k] for k in inputs}
        return
    assert inputs == want_in
    assert outputs == want_out


# -- text_output ------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_text_output_is_one_string_per_beam(target, model):
    res = call(target, model, text_inputs(["Call me Ishmael."], 6))
    text = res[-1].as_numpy("text_output")
    assert text.shape == (1,)
    assert isinstance(text[0].decode("utf-8"), str)  # result.as_numpy(...)[0].decode()


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_text_output_includes_the_prompt_unless_excluded(target, model):
    prompt = "It was the best of times,"
    full = call(target, model, text_inputs([prompt], 6))[-1].as_numpy("text_output")[0].decode()
    new = call(target, model, text_inputs([prompt], 6, exclude_input_in_output=True))[-1] \
        .as_numpy("text_output")[0].decode()
    assert full.startswith(prompt) and full.endswith(new) and len(full) > len(prompt)


# -- exclude_input_in_output ------------------------------------------------------------------
def test_output_ids_include_the_prompt_by_default(target):
    ids = PROMPTS[0]
    new = greedy(target, ids)
    res = call(target, "tensorrt_llm", llm_inputs(ids))
    assert len(res) == 1 and tokens_of(res[0]) == ids + new  # TensorRT-LLM's default: false
    res = call(target, "tensorrt_llm", llm_inputs(ids, exclude_input_in_output=False))
    assert tokens_of(res[0]) == ids + new


# -- streaming --------------------------------------------------------------------------------
def test_streaming_sends_one_token_per_response(target):
    ids = PROMPTS[0]
    if not target.decoupled:
        with pytest.raises(InferenceServerException, match="decoupled"):
            call(target, "tensorrt_llm", llm_inputs(ids, streaming=True))
        return
    res = call(target, "tensorrt_llm", llm_inputs(ids, streaming=True))
    streamed = [tok for r in res for tok in tokens_of(r)]
    assert streamed == greedy(target, ids)  # the prompt never streams
    assert all(r.as_numpy("output_ids").shape[:2] == (1, 1) for r in res)


# -- batches ----------------------------------------------------------------------------------
def test_batch_of_three_serves_every_row(target):
    inputs = batched_llm_inputs(PROMPTS, exclude_input_in_output=True)
    if not target.decoupled:  # TensorRT-LLM refuses batch > 1 without decoupled mode
        with pytest.raises(InferenceServerException, match="Batch size > 1 requires"):
            call(target, "tensorrt_llm", inputs)
        return
    res = call(target, "tensorrt_llm", inputs)
    by_row = {int(r.as_numpy("batch_index")[0][0]): tokens_of(r) for r in res}
    assert by_row == {b: greedy(target, ids) for b, ids in enumerate(PROMPTS)}


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_batched_prompts_get_their_own_text(target, model):
    prompts = ["Call me Ishmael.", "The quick brown fox", "A"]
    if not target.decoupled:
        with pytest.raises(InferenceServerException, match="Batch size > 1 requires"):
            call(target, model, text_inputs(prompts, 5))
        return
    res = call(target, model, text_inputs(prompts, 5), outputs=["text_output", "batch_index"])
    texts = {int(r.as_numpy("batch_index")[0][0]): r.as_numpy("text_output")[0].decode()
             for r in res}
    single = {b: call(target, model, text_inputs([p], 5))[-1].as_numpy("text_output")[0]
              .decode() for b, p in enumerate(prompts)}
    assert texts == single


# -- stop / cancellation ---------------------------------------------------------------------
def _stop_inputs():
    """The stop request of inflight_batcher_llm_client.py (--stop-after-ms)."""
    return {"input_ids": np.empty([1, 1], dtype=np.int32),
            "input_lengths": np.zeros([1, 1], dtype=np.int32),
            "request_output_len": np.array([[0]], dtype=np.int32),
            "stop": np.array([[True]], dtype="bool")}


def test_stop_ends_the_request_with_the_same_id(target):
    ids, rid = PROMPTS[0], f"stop-me-{time.monotonic_ns()}"
    stop = [prepare_tensor(k, v) for k, v in _stop_inputs().items()]
    with target.client() as client:
        if target.decoupled:
            results: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: results.put(error or result))
            client.async_stream_infer("tensorrt_llm", [prepare_tensor(k, v) for k, v in
                                                       llm_inputs(ids, LONG, streaming=True)
                                                       .items()], request_id=rid)
            # Right behind it on the same stream (a tiny model could finish before a timer
            # fires): Triton hands the model the two in order.
            client.async_stream_infer("tensorrt_llm", stop, request_id=rid)
            client.stop_stream()
            got = [results.get() for _ in range(results.qsize())]
        else:
            done: queue.Queue = queue.Queue()
            client.async_infer("tensorrt_llm", [prepare_tensor(k, v) for k, v in
                                                llm_inputs(ids, LONG).items()],
                               partial(lambda q, result, error: q.put(error or result), done),
                               request_id=rid)
            got, stops = [], 0
            while done.empty():  # the stop may arrive before the request is queued: repeat
                stops += 1
                reply = client.infer("tensorrt_llm", stop, request_id=rid)
                assert reply.get_response().outputs == []
                time.sleep(0.05)
            got = [done.get()]
    errors = [g for g in got if isinstance(g, InferenceServerException)]
    assert not errors, errors
    replies = [g for g in got if g.get_response().outputs]
    stop_replies = [g for g in got if not g.get_response().outputs]
    generated = sum(len(tokens_of(r)) for r in replies) - (0 if target.decoupled else len(ids))
    assert 0 <= generated < LONG
    if target.decoupled:
        assert len(stop_replies) == 1  # the stop request's own, empty response


def test_stop_without_request_id_is_refused(target):
    with pytest.raises(InferenceServerException, match="request ID is not provided"):
        call(target, "tensorrt_llm", _stop_inputs())


# -- logits, log probs, token counts, perf metrics -----------------------------------------
def test_context_and_generation_logits(target):
    ids, n = PROMPTS[0], 5
    res = call(target, "tensorrt_llm", llm_inputs(ids, n, exclude_input_in_output=True,
                                                  return_context_logits=True,
                                                  return_generation_logits=True))
    r = res[-1]
    ctx, gen = r.as_numpy("context_logits"), r.as_numpy("generation_logits")
    want = {"TYPE_FP32": np.float32, "TYPE_FP16": np.float16}[target.logits_type]
    assert ctx.dtype == want and gen.dtype == want
    assert ctx.shape[:2] == (1, len(ids)) and gen.shape[:3] == (1, 1, n)
    new = tokens_of(r)
    assert gen[0, 0].argmax(-1).tolist() == new  # greedy: each token is its step's argmax
    assert int(ctx[0, -1].argmax()) == new[0]  # the prompt's last position predicts token 1


def test_log_probs_and_token_counts(target):
    ids, n = PROMPTS[1], 4
    r = call(target, "tensorrt_llm", llm_inputs(ids, n, return_log_probs=True,
                                                return_num_input_tokens=True,
                                                return_num_output_tokens=True))[-1]
    out = tokens_of(r)
    lp = r.as_numpy("output_log_probs")
    assert lp.shape == (1, 1, n) and np.all(lp <= 0)
    assert np.isclose(r.as_numpy("cum_log_probs")[0][0], lp.sum(), atol=1e-4)
    assert r.as_numpy("num_input_tokens")[0][0] == len(ids)
    assert r.as_numpy("num_output_tokens")[0][0] == len(out)  # every id in output_ids


def test_perf_metrics(target):
    r = call(target, "tensorrt_llm", llm_inputs(PROMPTS[0], 4, return_perf_metrics=True))[-1]
    for name, (dtype, _) in upstream.TENSORRT_LLM_OUTPUTS.items():
        if name in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                    "last_token_time_ns", "kv_cache_alloc_new_blocks", "acceptance_rate"):
            value = r.as_numpy(name)
            assert value.shape == (1, 1), name
            assert value.dtype == {"TYPE_INT64": np.int64, "TYPE_INT32": np.int32,
                                   "TYPE_FP32": np.float32}[dtype]
    times = [int(r.as_numpy(k)[0][0]) for k in ("arrival_time_ns", "first_scheduled_time_ns",
                                                 "first_token_time_ns", "last_token_time_ns")]
    assert times == sorted(times) and times[0] > 0


# -- sampling, end_id, num_return_sequences, beams -----------------------------------------
def test_sampling_is_reproducible_by_seed(target):
    ids = PROMPTS[2]
    kw = {"runtime_top_k": 20, "temperature": 1.0, "exclude_input_in_output": True}
    a = tokens_of(call(target, "tensorrt_llm", llm_inputs(ids, 8, seed=_u64(7), **kw))[-1])
    b = tokens_of(call(target, "tensorrt_llm", llm_inputs(ids, 8, seed=_u64(7), **kw))[-1])
    assert a == b


def test_end_id_ends_generation(target):
    ids = PROMPTS[0]
    new = greedy(target, ids, 8)
    stop_at = new[3]
    r = call(target, "tensorrt_llm", llm_inputs(ids, 8, end_id=stop_at, pad_id=0,
                                                exclude_input_in_output=True))[-1]
    assert tokens_of(r) == new[: new.index(stop_at)]  # stops there, end_id not returned


def test_num_return_sequences(target):
    inputs = llm_inputs(PROMPTS[2], 6, num_return_sequences=2, runtime_top_k=50, seed=_u64(3),
                        exclude_input_in_output=True)
    if not target.decoupled:
        with pytest.raises(InferenceServerException, match="decoupled"):
            call(target, "tensorrt_llm", inputs)
        return
    res = call(target, "tensorrt_llm", inputs)
    assert sorted(int(r.as_numpy("sequence_index")[0][0]) for r in res) == [0, 1]
    assert all(len(tokens_of(r)) == 6 for r in res)


def test_beam_search(target):
    if target.kind != "cpu":
        pytest.skip("beam search runs on trtllm-engine (build.max_beam_width)")
    # CPU_ONLY: the reference runtime has no beam search; it says so instead of ignoring it.
    with pytest.raises(InferenceServerException, match="beam"):
        call(target, "tensorrt_llm", llm_inputs(PROMPTS[0], 4, beam_width=2))


# -- errors -------------------------------------------------------------------------------------
def test_bad_requests_are_refused_with_a_reason(target):
    with pytest.raises(InferenceServerException, match="max_tokens"):
        call(target, "tensorrt_llm", llm_inputs(PROMPTS[0], 0))
    with pytest.raises(InferenceServerException, match="empty"):
        call(target, "ensemble", text_inputs([""], 4))
    if target.kind == "cpu":  # CPU_ONLY: features TensorRT-LLM has and the cpu target lacks
        with pytest.raises(InferenceServerException, match="LoRA"):
            call(target, "tensorrt_llm", llm_inputs(PROMPTS[0], 4,
                                                    lora_task_id=np.array([[1]], np.uint64)))
    assert greedy(target, PROMPTS[0])  # and the server keeps serving


def test_concurrent_requests_with_ids_do_not_mix(target):
    outs = {}

    def run(i):
        outs[i] = tokens_of(call(target, "tensorrt_llm",
                                 llm_inputs(PROMPTS[i], 6, exclude_input_in_output=True),
                                 request_id=f"r{i}")[-1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert outs == {i: greedy(target, p, 6) for i, p in enumerate(PROMPTS)}
