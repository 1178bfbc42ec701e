"""moepipe `cpu` target: the reference runtime as Triton's ``tensorrt_llm`` model.

``execute`` only parses and queues requests; the engine thread runs in-flight batching and
answers through each request's response sender (decoupled mode: one response per token when
streaming, one response otherwise). In non-decoupled mode ``execute`` waits for its requests,
which the engine still batches together. Expert routing is exported as Prometheus counters
``moepipe_expert_tokens_total{model,layer,expert}``.
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
from moepipe.serving.batcher import Batcher
from moepipe.serving.request import GenerationRequest, RequestError

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Metrics are calls into the server: publish them at most this often, not every step.
METRICS_PERIOD_S = 0.5


def _opt(request, name, default, kind=float):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    value = t.as_numpy().reshape(-1)
    return kind(value[0]) if value.size else default


def _words(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return []
    arr = t.as_numpy().reshape(2, -1) if t.as_numpy().size else np.zeros((2, 0), np.int32)
    ids, offsets = arr[0].tolist(), [o for o in arr[1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        words.append(ids[start:end])
        start = end
    return [w for w in words if w]


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
        self.exclude_input = params.get("exclude_input_in_output", "true").lower() == "true"
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
        self.running_family = pb_utils.MetricFamily(
            name="moepipe_running_requests", description="Requests in the running batch",
            kind=pb_utils.MetricFamily.GAUGE)
        self.running_metric = self.running_family.Metric(labels={"model": self.name})
        self._last_counts = model.expert_tokens.clone()
        self._tokens = 0
        self._published = 0.0
        self.engine = Batcher(model, max_batch_size=int(cfg["max_batch_size"]),
                             max_seq_len=int(params["max_seq_len"]),
                             max_input_len=int(params["max_input_len"]), on_step=self._on_step)
        self.outbox = _Outbox()
        self.engine.start()

    def _on_step(self, model, force=False):
        now = time.monotonic()
        if not force and now - self._published < METRICS_PERIOD_S:
            return
        self._published = now
        counts = model.expert_tokens.clone()
        delta = (counts - self._last_counts).tolist()
        self._last_counts = counts
        for li, row in enumerate(delta):
            for e, n in enumerate(row):
                if n:
                    self.expert_metrics[li][e].increment(n)
        tokens, self._tokens = self._tokens, 0
        if tokens:
            self.tokens_metric.increment(tokens)
        self.running_metric.set(self.engine.active)

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self._submit(request, self.outbox.track(request.get_response_sender()))
            return None
        done = [threading.Event() for _ in requests]
        slots = [None] * len(requests)
        for i, request in enumerate(requests):
            self._submit(request, _Collector(slots, i, done[i]))
        for event in done:
            event.wait()
        return slots

    def _submit(self, request, sender):
        try:
            req = self._parse(request, sender)
            if req.streaming and not self.decoupled:
                raise RequestError("streaming needs the model deployed in decoupled mode "
                                   "(deploy.decoupled: true)")
            self.engine.submit(req)
        except (RequestError, ValueError) as e:
            error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def _parse(self, request, sender):
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids is None:
            raise RequestError("input_ids is required")
        prompt = ids.as_numpy().reshape(-1).tolist()
        length = _opt(request, "input_lengths", len(prompt), int)
        prompt = prompt[:length]
        if _opt(request, "beam_width", 1, int) != 1:
            raise RequestError("beam_width > 1 is not supported by the cpu target")
        if _opt(request, "num_return_sequences", 1, int) != 1:
            raise RequestError("num_return_sequences > 1 is not supported by the cpu target")
        seed = _opt(request, "seed", 0, int)
        top_k = _opt(request, "runtime_top_k", 0, int)
        top_p = _opt(request, "runtime_top_p", 0.0)
        # TensorRT-LLM decodes greedily unless top_k > 1 or top_p > 0 asks for sampling;
        # temperature 0 or top_k 1 is greedy as well.
        sampling = SamplingParams(temperature=_opt(request, "temperature", 1.0), top_k=top_k,
                                  top_p=top_p if top_p > 0 else 1.0, seed=seed)
        if top_k == 0 and top_p <= 0:
            sampling = SamplingParams(temperature=0.0, seed=seed)
        exclude = bool(_opt(request, "exclude_input_in_output", self.exclude_input, bool))
        bias = pb_utils.get_input_tensor_by_name(request, "embedding_bias")
        bias = bias.as_numpy().reshape(-1) if bias is not None else None
        req = GenerationRequest(
            prompt=prompt,
            max_new_tokens=_opt(request, "request_output_len", 0, int),
            end_id=_opt(request, "end_id", None, int),
            sampling=sampling,
            min_tokens=_opt(request, "min_tokens", 0, int),
            repetition_penalty=_opt(request, "repetition_penalty", 1.0),
            presence_penalty=_opt(request, "presence_penalty", 0.0),
            frequency_penalty=_opt(request, "frequency_penalty", 0.0),
            stop_words=_words(request, "stop_words_list"),
            bad_words=_words(request, "bad_words_list"),
            return_log_probs=bool(_opt(request, "return_log_probs", False, bool)),
            streaming=bool(_opt(request, "streaming", False, bool)),
            embedding_bias=torch.from_numpy(bias.copy()) if bias is not None and bias.size
            else None,
            is_cancelled=getattr(sender, "cancelled", lambda: False))
        want_in = bool(_opt(request, "return_num_input_tokens", False, bool))
        want_out = bool(_opt(request, "return_num_output_tokens", False, bool))

        def respond(tokens, log_probs, final, cum_log_prob, generated):
            out = tokens if (exclude or req.streaming) else prompt + tokens
            tensors = [pb_utils.Tensor("output_ids", np.array([[out]], dtype=np.int32)),
                       pb_utils.Tensor("sequence_length", np.array([[len(out)]], np.int32)),
                       pb_utils.Tensor("batch_index", np.array([[0]], np.int32)),
                       pb_utils.Tensor("sequence_index", np.array([[0]], np.int32))]
            if req.return_log_probs:
                tensors += [pb_utils.Tensor("cum_log_probs",
                                            np.array([[cum_log_prob]], np.float32)),
                            pb_utils.Tensor("output_log_probs",
                                            np.array([[log_probs]], np.float32))]
            if want_in:
                tensors.append(pb_utils.Tensor("num_input_tokens",
                                               np.array([[len(prompt)]], np.int32)))
            if want_out:
                tensors.append(pb_utils.Tensor("num_output_tokens",
                                               np.array([[generated]], np.int32)))
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                        flags=FINAL if final else 0)

        def fail(message):
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                        flags=FINAL)

        # Called on the engine thread: snapshot what the response needs, then build and send
        # it on the outbox thread (decoupled) so the engine never waits for the server.
        def on_tokens(tokens, log_probs, final):
            self._tokens += len(tokens) if req.streaming else len(req.generated)
            args = (list(tokens), list(log_probs), final, sum(req.log_probs), len(req.generated))
            if isinstance(sender, _Tracked):
                self.outbox.put(respond, *args)
            else:
                respond(*args)

        def on_error(message):
            if isinstance(sender, _Tracked):
                self.outbox.put(fail, message)
            else:
                fail(message)

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
        del self.expert_metrics, self.tokens_metric, self.running_metric


class _Tracked:
    """A decoupled request's response sender, as the outbox thread sees it."""

    def __init__(self, sender):
        self.sender = sender
        self.is_cancelled_flag = False
        self.done = False

    def cancelled(self):
        return self.is_cancelled_flag

    def send(self, response=None, flags=0):
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


class _Collector:
    """A response sender for non-decoupled mode: keeps the final response for execute()."""

    def __init__(self, slots, index, event):
        self.slots, self.index, self.event = slots, index, event

    def is_cancelled(self):
        return False

    def send(self, response, flags=0):
        if flags & FINAL:
            self.slots[self.index] = response
            self.event.set()
