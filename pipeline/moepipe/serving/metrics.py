"""Server-side Prometheus figures of the cpu target's ``tensorrt_llm`` model.

Histograms (real buckets, so ``histogram_quantile`` works over any window):

* ``moepipe_request_latency_seconds`` - arrival at the model to the final response,
* ``moepipe_time_to_first_token_seconds`` - arrival to the first generated token,
* ``moepipe_queue_time_seconds`` - arrival to admission into a KV-cache slot;

gauges: ``moepipe_batch_occupancy_ratio`` (running requests / max_batch_size),
``moepipe_queued_requests``, ``moepipe_kv_slots_used`` / ``moepipe_kv_slots`` and
``moepipe_kv_tokens_used`` (prompt + generated tokens held in the KV cache).

Every metric update is a call from the model's process into the server, so the engine thread
only records numbers; ``publish`` (called off the engine thread, at most every publication
period) sends them.
"""

from __future__ import annotations

import threading
from typing import Any

from moepipe.serving.request import GenerationRequest

# Seconds; from a 5 ms single-token step to a minute-long generation.
BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
HISTOGRAMS = {
    "latency": ("moepipe_request_latency_seconds",
                "Request latency at the model: arrival to the final response"),
    "ttft": ("moepipe_time_to_first_token_seconds",
             "Time to first token at the model: arrival to the first generated token"),
    "queue": ("moepipe_queue_time_seconds",
              "Queue time at the model: arrival to admission into a KV-cache slot"),
}
GAUGES = {
    "occupancy": ("moepipe_batch_occupancy_ratio", "Running requests / max_batch_size"),
    "queued": ("moepipe_queued_requests", "Requests waiting for a KV-cache slot"),
    "slots_used": ("moepipe_kv_slots_used", "KV-cache slots held by running requests"),
    "slots": ("moepipe_kv_slots", "KV-cache slots (max_batch_size)"),
    "kv_tokens": ("moepipe_kv_tokens_used", "Tokens held in the KV cache"),
}


class ServingMetrics:
    """The model's latency histograms and occupancy gauges (``pb_utils`` is the Python
    backend's module, passed in so this file imports without a server)."""

    def __init__(self, pb_utils: Any, model: str, max_batch_size: int):
        labels = {"model": model}
        self.max_batch_size = max_batch_size
        mf = pb_utils.MetricFamily
        self._families = {k: mf(name=n, description=d, kind=mf.HISTOGRAM)
                          for k, (n, d) in HISTOGRAMS.items()}
        self._families.update({k: mf(name=n, description=d, kind=mf.GAUGE)
                               for k, (n, d) in GAUGES.items()})
        self.histograms = {k: self._families[k].Metric(labels=labels, buckets=BUCKETS)
                           for k in HISTOGRAMS}
        self.gauges = {k: self._families[k].Metric(labels=labels) for k in GAUGES}
        self._pending: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def record(self, req: GenerationRequest) -> None:
        """Remember a finished request's queue time, TTFT and latency (cheap; the engine
        thread calls it)."""
        if not (req.arrival_ns and req.scheduled_ns and req.first_token_ns):
            return
        with self._lock:
            self._pending += [("queue", (req.scheduled_ns - req.arrival_ns) / 1e9),
                              ("ttft", (req.first_token_ns - req.arrival_ns) / 1e9),
                              ("latency", (req.last_token_ns - req.arrival_ns) / 1e9)]

    def publish(self, load: dict[str, int]) -> None:
        """Send the recorded observations and the batcher's occupancy (``Batcher.load()``)
        to the server; called off the engine thread."""
        with self._lock:
            pending, self._pending = self._pending, []
        for kind, value in pending:
            self.histograms[kind].observe(max(0.0, value))
        values = {"occupancy": load["running"] / self.max_batch_size, "queued": load["waiting"],
                  "slots_used": load["slots_used"], "slots": self.max_batch_size,
                  "kv_tokens": load["kv_tokens"]}
        for kind, value in values.items():
            self.gauges[kind].set(value)

    def close(self) -> None:
        self.histograms.clear()
        self.gauges.clear()
        self._families.clear()


class EngineCounters:
    """``moepipe_expert_tokens_total{model,layer,expert}`` (tokens routed to each expert of each
    MoE layer), ``moepipe_generated_tokens_total{model}``, ``moepipe_prompt_tokens_total{model}``
    (prompt tokens of admitted requests) and ``moepipe_running_requests``.
    ``delta`` runs on the engine thread, ``publish`` off it (like ``ServingMetrics``)."""

    def __init__(self, pb_utils: Any, model_name: str, model: Any):
        mf = pb_utils.MetricFamily
        self._families = [
            mf(name="moepipe_expert_tokens_total",
               description="Tokens routed to each expert of each MoE layer", kind=mf.COUNTER),
            mf(name="moepipe_generated_tokens_total", description="Tokens generated",
               kind=mf.COUNTER),
            mf(name="moepipe_running_requests", description="Requests in the running batch",
               kind=mf.GAUGE),
            mf(name="moepipe_prompt_tokens_total",
               description="Prompt tokens of admitted requests", kind=mf.COUNTER)]
        # (the families stay referenced: the backend deletes a collected family's metrics)
        experts, tokens, running, prompt = self._families
        self.experts = [[experts.Metric(labels={"model": model_name, "layer": str(layer),
                                                "expert": str(e)})
                         for e in range(model.num_experts)]
                        for layer in range(model.ckpt.num_layers)]  # a stage: all layers
        self.tokens = tokens.Metric(labels={"model": model_name})
        self.running = running.Metric(labels={"model": model_name})
        self.prompt = prompt.Metric(labels={"model": model_name})
        self._last = model.expert_tokens.clone()

    def delta(self, model: Any) -> list[list[int]]:
        """Tokens routed per (layer, expert) since the last call."""
        counts = model.expert_tokens.clone()
        delta = (counts - self._last).tolist()
        self._last = counts
        return delta

    def publish(self, delta: list[list[int]], tokens: int, running: int) -> None:
        for layer, row in enumerate(delta):
            for e, n in enumerate(row):
                if n:
                    self.experts[layer][e].increment(n)
        if tokens:
            self.tokens.increment(tokens)
        self.running.set(running)

    def close(self) -> None:
        self.experts.clear()
        del self.tokens, self.running, self.prompt
        self._families.clear()
