"""TensorRT-LLM's Triton metric families, exported by the cpu target with the same names and
labels, so alerts, dashboards and request routers read every target the same way.

Upstream (NVIDIA/TensorRT-LLM, 1.2 line): ``triton_backend/inflight_batcher_llm/src/
custom_metrics_reporter/custom_metrics_reporter.cc`` creates gauge families with labels
``model``, ``version`` and one category label; ``model_instance_state.cc`` (``WaitForStats``)
fills them from each iteration's executor statistics:

==================================== ===========================================================
series                               value (upstream -> here)
==================================== ===========================================================
request_type="active"                numActiveRequests -> requests in the batch + waiting for a
                                     slot
request_type="max"                   maxNumActiveRequests -> max_batch_size
request_type="scheduled"             numScheduledRequests -> requests in the last step
request_type="context"               numContextRequests -> prompts prefilled in the last step
request_type="waiting"               active - scheduled
kv_cache_block_type="max"            maxNumBlocks -> slots x ceil(max_seq_len / tokens_per)
kv_cache_block_type="used"           usedNumBlocks -> blocks the running requests' tokens fill
kv_cache_block_type="free"           freeNumBlocks -> max - used
kv_cache_block_type="tokens_per"     tokensPerBlock -> 32 (TensorRT-LLM 1.2's default)
kv_cache_block_type="reused"         reusedBlocks -> 0 (the cpu target shares no prefixes)
kv_cache_block_type="fraction"       used / max
==================================== ===========================================================

The cpu runtime gives each request a whole KV slot of max_seq_len tokens; blocks count the
tokens held, as TensorRT-LLM's paged cache would.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

TOKENS_PER_BLOCK = 32
REQUEST = ("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type",
           ("active", "max", "scheduled", "context", "waiting"))
KV_CACHE = ("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics",
            "kv_cache_block_type", ("max", "free", "used", "tokens_per", "reused", "fraction"))


class EngineView(Protocol):
    max_batch_size: int
    max_seq_len: int
    last_step: tuple[int, int]  # (scheduled, context) requests of the latest step

    def running_tokens(self) -> list[int]: ...

    def load(self) -> dict[str, int]: ...


def iteration_values(engine: EngineView) -> dict[str, dict[str, float]]:
    """family name -> category value -> gauge value, for the engine's latest step (call it on
    the engine thread: a consistent snapshot)."""
    held = engine.running_tokens()
    scheduled, context = engine.last_step
    active = len(held) + engine.load()["waiting"]
    per_slot = math.ceil(engine.max_seq_len / TOKENS_PER_BLOCK)
    max_blocks = engine.max_batch_size * per_slot
    used = sum(math.ceil(n / TOKENS_PER_BLOCK) for n in held)
    return {
        REQUEST[0]: {"active": active, "max": engine.max_batch_size, "scheduled": scheduled,
                     "context": context, "waiting": max(0, active - scheduled)},
        KV_CACHE[0]: {"max": max_blocks, "free": max_blocks - used, "used": used,
                      "tokens_per": TOKENS_PER_BLOCK, "reused": 0,
                      "fraction": used / max_blocks if max_blocks else 0.0},
    }


class TrtllmMetrics:
    """The gauges, registered through the Python backend's metric API (``pb_utils``)."""

    def __init__(self, pb_utils: Any, model: str, version: str):
        self.families = []
        self.gauges: dict[str, dict[str, Any]] = {}
        for name, description, label, values in (REQUEST, KV_CACHE):
            family = pb_utils.MetricFamily(name=name, description=description,
                                           kind=pb_utils.MetricFamily.GAUGE)
            self.families.append(family)
            self.gauges[name] = {v: family.Metric(labels={"model": model, "version": version,
                                                          label: v}) for v in values}

    def publish(self, values: dict[str, dict[str, float]]) -> None:
        """Set the gauges to :func:`iteration_values` (a call into the server per gauge: the
        model makes it on the thread that makes its other metric calls)."""
        for name, family in values.items():
            for key, value in family.items():
                self.gauges[name][key].set(float(value))

    def close(self) -> None:
        """Drop the metrics before their families (the Python backend's order)."""
        self.gauges.clear()
        self.families.clear()
