"""moepipe `cpu` target: the reference runtime as Triton's ``tensorrt_llm`` model.

The tensor contract is TensorRT-LLM 1.2's (``moepipe.serving.contract``): a request of batch
size B becomes B rows (times ``num_return_sequences``), each answered with its own responses
(``batch_index`` when B > 1, ``sequence_index`` when several sequences), the last one flagged
FINAL; a ``stop`` request ends the running request with the same request id. ``execute`` only
parses and queues, in both transaction policies, and answers through response senders: the
engine thread runs in-flight batching; responses are built and sent, and cancellation polled,
on the outbox thread. Expert routing is exported as Prometheus counters
``moepipe_expert_tokens_total{model,layer,expert}``, tokens as ``moepipe_generated_tokens_total``
and ``moepipe_prompt_tokens_total``; latency, TTFT and queue-time histograms
and occupancy gauges by ``moepipe.serving.metrics``.
"""

import json
import queue
import sys
import threading
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.model import ReferenceModel
from moepipe.runtime.sampling import SamplingParams
from moepipe.serving import contract
from moepipe.serving.admission import QUEUE_TIMEOUT
from moepipe.serving.batcher import Batcher, Busy
from moepipe.serving.metrics import ServingMetrics
from moepipe.serving.request import GenerationRequest, RequestError
from moepipe.serving.trtllm_metrics import TrtllmMetrics, iteration_values

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Metrics are calls into the server: publish them at most this often, not every step.
METRICS_PERIOD_S = 0.5
LOGITS_DTYPES = {"TYPE_FP32": np.float32, "TYPE_FP16": np.float16}


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        self.name = args["model_name"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        torch.set_num_threads(int(params.get("cpu_threads") or 1))
        # The engine thread holds the GIL for most of a step; with Python's default 5 ms switch
        # interval, execute() and the outbox wait that long for every GIL hand-over, and
        # requests spend more time queued for the GIL than in the batch.
        sys.setswitchinterval(0.0002)
        # TensorRT-LLM's default when neither the request nor the parameter says: false.
        self.exclude_input = params.get("exclude_input_in_output", "false").lower() == "true"
        outputs = {o["name"]: o["data_type"] for o in cfg["output"]}
        self.logits_dtype = LOGITS_DTYPES[outputs["context_logits"]]
        model = ReferenceModel(load_checkpoint(params["checkpoint_dir"]))
        self.family = pb_utils.MetricFamily(
            name="moepipe_expert_tokens_total",
            description="Tokens routed to each expert of each MoE layer",
            kind=pb_utils.MetricFamily.COUNTER)
        self.expert_metrics = [[self.family.Metric(labels={"model": self.name, "layer": str(li),
                                                           "expert": str(e)})
                                for e in range(model.num_experts)]
                               for li in range(len(model.layers))]
        self.tokens_family = pb_utils.MetricFamily(
            name="moepipe_generated_tokens_total", description="Tokens generated",
            kind=pb_utils.MetricFamily.COUNTER)
        self.tokens_metric = self.tokens_family.Metric(labels={"model": self.name})
        # (the family must stay referenced: the backend deletes a collected family's metrics)
        self.prompt_family = pb_utils.MetricFamily(
            name="moepipe_prompt_tokens_total", description="Prompt tokens of admitted requests",
            kind=pb_utils.MetricFamily.COUNTER)
        self.prompt_metric = self.prompt_family.Metric(labels={"model": self.name})
        self.running_family = pb_utils.MetricFamily(
            name="moepipe_running_requests", description="Requests in the running batch",
            kind=pb_utils.MetricFamily.GAUGE)
        self.running_metric = self.running_family.Metric(labels={"model": self.name})
        self.serving_metrics = ServingMetrics(pb_utils, self.name, int(cfg["max_batch_size"]))
        # TensorRT-LLM's nv_trt_llm_request_metrics / nv_trt_llm_kv_cache_block_metrics.
        self.trtllm_metrics = TrtllmMetrics(pb_utils, self.name, str(args["model_version"]))
        self._last_counts = model.expert_tokens.clone()
        self._tokens = 0
        self._published = 0.0
        self.engine = Batcher(model, max_batch_size=int(cfg["max_batch_size"]),
                             max_seq_len=int(params["max_seq_len"]),
                             max_input_len=int(params["max_input_len"]), on_step=self._on_step,
                             max_queue_size=int(params.get("max_queue_size") or 0),
                             queue_timeout_s=int(params.get("queue_timeout_microseconds")
                                                 or 0) / 1e6)
        self.outbox = _Outbox()
        # request id -> the generation requests it runs (a `stop` request names them)
        self.live: dict[str, list[GenerationRequest]] = {}
        self.live_lock = threading.Lock()
        self.engine.start()

    def _on_step(self, model, force=False):
        now = time.monotonic()
        if not force and now - self._published < METRICS_PERIOD_S:
            return
        self._published = now
        counts = model.expert_tokens.clone()
        delta = (counts - self._last_counts).tolist()
        self._last_counts = counts
        tokens, self._tokens = self._tokens, 0
        # Numbers are taken here, on the engine thread; the calls into the server are made on
        # the outbox thread only (concurrent metric calls from two threads of one model can
        # crash the Python backend).
        self.outbox.put(self._publish_counts, delta, tokens, self.engine.active)
        self.outbox.put(self.serving_metrics.publish, self.engine.load())
        self.outbox.put(self.trtllm_metrics.publish, iteration_values(self.engine))

    def _publish_counts(self, delta, tokens, active):
        for li, row in enumerate(delta):
            for e, n in enumerate(row):
                if n:
                    self.expert_metrics[li][e].increment(n)
        if tokens:
            self.tokens_metric.increment(tokens)
        self.running_metric.set(active)

    def execute(self, requests):
        # Both policies answer through response senders (non-decoupled: exactly one response),
        # so execute never waits and a `stop` request is served while its target runs.
        for request in requests:
            sender = self.outbox.track(request.get_response_sender())
            try:
                self._submit(request, sender)
            except (RequestError, ValueError) as e:
                self._refuse(sender, str(e), pb_utils.TritonError.INVALID_ARG)
            except Busy as e:  # Triton's queue-full answer: UNAVAILABLE (HTTP 503)
                self._refuse(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
        return None

    def _refuse(self, sender, message, code):
        # Sent on the outbox thread like every response: sent from here, the FINAL response
        # raced the outbox's cancellation poll of the same sender, which then asked a released
        # response factory (tritonserver SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled,
        # seen under a burst of refusals).
        error = pb_utils.TritonError(message, code)
        self.outbox.put(sender.send, pb_utils.InferenceResponse(error=error), FINAL)

    def _submit(self, request, sender):
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        request_id = request.request_id()
        if contract.is_stop(inputs):
            self._stop(request_id, sender)
            return
        rows = contract.parse(inputs, decoupled=self.decoupled,
                              exclude_default=self.exclude_input)
        if not self.decoupled and rows[0].num_return_sequences > 1:
            raise RequestError("num_return_sequences > 1 sends one response per sequence, which "
                               "needs decoupled mode (deploy.decoupled: true)")
        group = _Group(self, sender, request_id, len(rows))
        reqs = [self._generation_request(row, seq, group, len(rows))
                for row in rows for seq in range(row.num_return_sequences)]
        group.pending = len(reqs)
        e = self.engine
        for req in reqs:  # all rows are checked before any runs
            req.validate(e.model.vocab_size, e.max_input_len, e.max_seq_len)
        if request_id:
            with self.live_lock:
                self.live.setdefault(request_id, []).extend(reqs)
        try:
            e.submit_all(reqs)
        except Busy:
            self._forget(request_id, reqs)
            raise
        self.outbox.put(self.prompt_metric.increment, sum(len(r.prompt) for r in reqs))

    def _stop(self, request_id, sender):
        """TensorRT-LLM's handleStopRequest: end the named request's rows with what they have
        generated; answer the stop request itself with one empty response."""
        if not request_id:
            raise RequestError(contract.ERR_STOP_WITHOUT_ID)
        with self.live_lock:
            for req in self.live.get(request_id, []):
                req.stop_requested = True
        self.outbox.put(sender.send, pb_utils.InferenceResponse(output_tensors=[]), FINAL)

    def _forget(self, request_id, reqs):
        if request_id:
            with self.live_lock:
                left = [r for r in self.live.get(request_id, []) if r not in reqs]
                if left:
                    self.live[request_id] = left
                else:
                    self.live.pop(request_id, None)

    def _generation_request(self, row, seq, group, batch_size):
        top_k, top_p = row.top_k, row.top_p
        seed = row.seed + seq  # each returned sequence samples its own stream
        temperature = 1.0 if row.temperature is None else row.temperature
        # TensorRT-LLM decodes greedily unless top_k > 1 or top_p > 0 asks for sampling;
        # temperature 0 or top_k 1 is greedy as well.
        sampling = SamplingParams(temperature=temperature, top_k=top_k,
                                  top_p=1.0 if top_p <= 0 else top_p,  # NaN: refused
                                  seed=seed)
        if top_k == 0 and top_p <= 0:
            sampling = SamplingParams(temperature=0.0, seed=seed)
        bias = row.embedding_bias
        req = GenerationRequest(
            prompt=row.prompt, max_new_tokens=row.max_new_tokens, end_id=row.end_id,
            sampling=sampling, min_tokens=row.min_tokens,
            repetition_penalty=row.repetition_penalty, presence_penalty=row.presence_penalty,
            frequency_penalty=row.frequency_penalty, stop_words=row.stop_words,
            bad_words=row.bad_words, return_log_probs=row.return_log_probs,
            streaming=row.streaming,
            embedding_bias=torch.from_numpy(bias.copy()) if bias is not None else None,
            is_cancelled=group.sender.cancelled,
            return_context_logits=row.return_context_logits,
            return_generation_logits=row.return_generation_logits)
        sent_first = []

        # Called on the engine thread: snapshot what the response needs, then build and send
        # it on the outbox thread so the engine never waits for the server.
        def on_tokens(tokens, log_probs, final):
            self._tokens += len(tokens) if req.streaming else len(req.generated)
            kept = len(req.generated)
            if final and req.end_id is not None and tokens and tokens[-1] == req.end_id:
                # TensorRT-LLM stops at end_id without returning it (nor its log prob)
                tokens, log_probs, kept = tokens[:-1], log_probs[:-1], kept - 1
            out = list(tokens) if (row.exclude_input or row.streaming) else row.prompt + tokens
            ctx = None
            if req.context_logits is not None and not sent_first:
                ctx = req.context_logits.float().numpy()
            sent_first.append(True)
            gen = None
            if req.return_generation_logits:
                steps = req.generation_logits[kept - len(tokens):kept]
                gen = (torch.stack(steps).float().numpy() if steps
                       else np.zeros((0, self.engine.model.vocab_size), np.float32))
            perf = _perf(req) if row.return_perf_metrics else None
            result = contract.Result(out, list(log_probs), float(sum(req.log_probs[:kept])), ctx,
                                     gen, perf)
            if final:
                self.serving_metrics.record(req)
            self.outbox.put(group.respond, row, result, seq, batch_size, final, req)

        def on_error(message):
            self.outbox.put(group.fail, message, req)

        req.on_tokens, req.on_error = on_tokens, on_error
        return req

    def finalize(self):
        self.engine.stop()
        self.outbox.stop()
        e = self.engine
        pb_utils.Logger.log_info(
            f"moepipe engine: {e.steps} steps, {e.stats['sequences'] / max(e.steps, 1):.1f} "
            f"sequences per step, {e.stats['prefills']} prefills, "
            f"{e.stats['forward_s']:.2f}s in forward")
        self.serving_metrics.close()
        self.trtllm_metrics.close()
        del self.expert_metrics, self.tokens_metric, self.running_metric


def _perf(req):
    """return_perf_metrics outputs. Times are CLOCK_MONOTONIC nanoseconds (TensorRT-LLM reports
    its steady clock). The cpu target's KV cache is one slot per request and reuses nothing,
    so the block counts count that slot; there is no speculative decoding."""
    return {"kv_cache_alloc_new_blocks": 1, "kv_cache_reused_blocks": 0,
            "kv_cache_alloc_total_blocks": 1, "arrival_time_ns": req.arrival_ns,
            "first_scheduled_time_ns": req.scheduled_ns,
            "first_token_time_ns": req.first_token_ns, "last_token_time_ns": req.last_token_ns,
            "acceptance_rate": 0.0, "total_accepted_draft_tokens": 0, "total_draft_tokens": 0}


class _Group:
    """The rows (x sequences) of one Triton request: the FINAL flag goes with the final
    response of the last one to finish (model_instance_state.cc WaitForResponse). Used on the
    outbox thread only."""

    def __init__(self, model, sender, request_id, pending):
        self.model, self.sender, self.request_id, self.pending = model, sender, request_id, pending
        self.finished = []

    def _flags(self, final, req):
        if not final:
            return 0
        self.pending -= 1
        self.finished.append(req)
        if self.pending:
            return 0
        self.model._forget(self.request_id, self.finished)
        return FINAL

    def respond(self, row, result, seq, batch_size, final, req):
        arrays = contract.response_arrays(row, result, batch_size=batch_size,
                                          sequence_index=seq,
                                          logits_dtype=self.model.logits_dtype)
        tensors = [pb_utils.Tensor(name, value) for name, value in arrays.items()]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                         flags=self._flags(final, req))

    def fail(self, message, req):
        code = (pb_utils.TritonError.UNAVAILABLE if message.startswith(QUEUE_TIMEOUT)
                else pb_utils.TritonError.INTERNAL)
        self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                         flags=self._flags(True, req))


class _Tracked:
    """A request's response sender, as the outbox thread sees it."""

    def __init__(self, sender):
        self.sender = sender
        self.is_cancelled_flag = False
        self.done = False

    def cancelled(self):
        return self.is_cancelled_flag

    def send(self, response=None, flags=0):
        if self.done:  # the request already ended (e.g. an error of another row)
            return
        self.sender.send(response, flags=flags)
        if flags & FINAL:
            self.done = True


class _Outbox:
    """Sends responses and polls cancellation on its own thread: both are round trips to the
    server, and the engine should not wait for them between steps."""

    POLL_S = 0.25

    def __init__(self):
        self._queue = queue.Queue()
        self._live = []
        self._thread = threading.Thread(target=self._run, name="moepipe-outbox", daemon=True)
        self._thread.start()

    def track(self, sender):
        tracked = _Tracked(sender)
        self._queue.put((self._live.append, (tracked,)))
        return tracked

    def put(self, fn, *args):
        self._queue.put((fn, args))

    def stop(self):
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self):
        polled = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                fn, args = item
                try:
                    fn(*args)
                except Exception as e:  # a client gone away must not stop the others
                    pb_utils.Logger.log_warn(f"sending a response failed: {e}")
            if time.monotonic() - polled >= self.POLL_S:
                polled = time.monotonic()
                self._live = [t for t in self._live if not t.done]
                for t in self._live:
                    if not t.is_cancelled_flag and t.sender.is_cancelled():
                        t.is_cancelled_flag = True
