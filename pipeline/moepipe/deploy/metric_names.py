"""The metric names each target's deployment exports, and the names a PromQL query reads.

Dashboards and alerts may only read what the deployment exports; these catalogs are the
contract, checked against upstream (the TensorRT-LLM names) and against a live cpu server.

Sources: Triton server ``docs/user_guide/metrics.md`` and core ``src/metric_model_reporter.cc``
(``nv_inference_*``, counters without ``_total``; ``*_summary_us`` with
``--metrics-config summary_latencies=true``; ``nv_inference_first_response_histogram_ms`` with
``histogram_latencies=true``, Triton >= 24.x, not in the 2.51 server of nvidia-pytriton);
TensorRT-LLM ``triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/
custom_metrics_reporter.cc`` (``nv_trt_llm_*``, ``nv_llm_*_token_len``).
"""

from __future__ import annotations

import math
import re

from moepipe.arch.bounds import MAX_EXPERTS, MAX_LAYERS
from moepipe.errors import ConfigError
from moepipe.targets import TARGETS, get_target


def _summary(name: str) -> set[str]:
    return {name, f"{name}_sum", f"{name}_count"}


def _histogram(name: str) -> set[str]:
    return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}


# Triton core (src/metrics.cc names, src/metric_model_reporter.cc: which a model reports):
# counters and the pending-request gauge always, the latency counters unless
# counter_latencies=false, CPU metrics unless --allow-cpu-metrics=false.
TRITON_CORE = {
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
    "nv_inference_exec_count", "nv_inference_pending_request_count",
    "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
    "nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes",
    "up",  # Prometheus' own, per scrape target
}
# --metrics-config summary_latencies=true (InitializeSummaries)
TRITON_SUMMARIES = {
    *_summary("nv_inference_request_summary_us"), *_summary("nv_inference_queue_summary_us"),
    *_summary("nv_inference_compute_input_summary_us"),
    *_summary("nv_inference_compute_infer_summary_us"),
    *_summary("nv_inference_compute_output_summary_us"),
}
# --metrics-config histogram_latencies=true, decoupled models only (InitializeHistograms)
TRITON_FIRST_RESPONSE = _histogram("nv_inference_first_response_histogram_ms")
# DCGM, on a GPU machine unless --allow-gpu-metrics=false (TRITON_ENABLE_METRICS_GPU)
TRITON_GPU = {"nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
              "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption"}
# TensorRT-LLM's C++ backend: family -> (category label, its values), from
# custom_metrics_reporter.cc (InitializeReporter; *_labels_ vectors).
TRTLLM_FAMILIES = {
    "nv_trt_llm_request_metrics": ("request_type",
                                   ("active", "max", "scheduled", "context", "waiting")),
    "nv_trt_llm_runtime_memory_metrics": ("memory_type", ("cpu", "gpu", "pinned")),
    "nv_trt_llm_kv_cache_block_metrics": ("kv_cache_block_type",
                                          ("max", "free", "used", "tokens_per", "reused",
                                           "fraction")),
    "nv_trt_llm_disaggregated_serving_metrics": ("disaggregated_serving_type",
                                                 ("kv_cache_transfer_ms", "request_count")),
    "nv_trt_llm_inflight_batcher_metrics": ("inflight_batcher_specific_metric",
                                            ("total_context_tokens", "generation_requests",
                                             "micro_batch_id", "paused_requests")),
    "nv_trt_llm_general_metrics": ("general_type", ("timestamp", "iteration_counter")),
}
TRTLLM_BACKEND = {*TRTLLM_FAMILIES, *_histogram("nv_llm_input_token_len"),
                  *_histogram("nv_llm_output_token_len")}
# The cpu target's own (model_repo/targets/cpu/.../tensorrt_llm/1/model.py) and the
# TensorRT-LLM families it also exports, with the same labels (moepipe.serving.trtllm_metrics).
MOEPIPE_CPU = {"moepipe_expert_tokens_total", "moepipe_generated_tokens_total",
               "moepipe_prompt_tokens_total",
               "moepipe_running_requests",
               # moepipe.serving.metrics (HISTOGRAMS, GAUGES)
               *_histogram("moepipe_request_latency_seconds"),
               *_histogram("moepipe_time_to_first_token_seconds"),
               *_histogram("moepipe_queue_time_seconds"), "moepipe_batch_occupancy_ratio",
               "moepipe_queued_requests", "moepipe_kv_slots_used", "moepipe_kv_slots",
               "moepipe_kv_tokens_used",
               # moepipe.serving.live: the weights version serving
               "moepipe_model_info",
               # the BLS model with deploy.fallback (tensorrt_llm_bls/1/overload.py)
               "moepipe_fallback_requests_total", "moepipe_circuit_state",
               # a rank group (world size > 1; moepipe.serving.rank_metrics)
               *_histogram("moepipe_rank_step_seconds"), *_histogram("moepipe_rank_wait_seconds"),
               "moepipe_rank_group_up", "moepipe_rank_group_losses_total"}
CPU_TRTLLM_FAMILIES = ("nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics")

# The groups a target declares it exports (moepipe.targets: Target.metrics).
GROUPS: dict[str, set[str]] = {
    "triton": TRITON_CORE,
    "triton-summaries": TRITON_SUMMARIES,
    "triton-first-response": TRITON_FIRST_RESPONSE,
    "triton-gpu": TRITON_GPU,
    "trtllm-backend": TRTLLM_BACKEND,
    "moepipe-cpu": MOEPIPE_CPU | set(CPU_TRTLLM_FAMILIES),
    # moepipe's trtllm-pytorch model (targets/trtllm-pytorch/.../model.py) counts the tokens of
    # prompts and generations: TensorRT-LLM's LLM-API Python model registers no nv_trt_llm_*
    "moepipe-tokens": {"moepipe_generated_tokens_total", "moepipe_prompt_tokens_total"},
}
# Groups only decoupled models report (Triton's first-response histogram).
DECOUPLED_ONLY = {"triton-first-response"}


def exported(target: str, decoupled: bool = True, expert_statistic: bool = False) -> set[str]:
    """Metric names the deployment of ``target`` exports (``decoupled``: its models' transaction
    policy, deploy.decoupled; ``expert_statistic``: TensorRT-LLM's expert statistics are
    collected, on a target whose expert counts are that window: ``Target.expert_counts``)."""
    t = get_target(target)
    names = {name for group in t.metrics
             if decoupled or group not in DECOUPLED_ONLY for name in GROUPS[group]}
    if expert_statistic and t.expert_counts == "window":
        names.add("moepipe_expert_tokens_total")
    return names


EXPORTED = {name: exported(name) for name in TARGETS}

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")


def metrics_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (strings, label matchers, ranges, grouping
    labels, functions, keywords and Grafana variables removed)."""
    text = _STRING.sub(" ", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\w+", " ", text)
    return {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS
            and not re.fullmatch(r"\d+[smhdwy]?|e\d+", m)}


_EXPERT_SAMPLE = re.compile(r"^moepipe_expert_tokens_total\{([^}]*)\}[ \t]+(\S+)[ \t]*$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# A token count is exact in a float64 up to 2**53; more is not a count but a broken counter.
MAX_COUNT = 2.0 ** 53
# A metrics page moepipe reads (DeepSeek-V3's 58 MoE layers x 256 experts are ~2 MB of it).
METRICS_LIMIT = 64 << 20


def expert_token_counts(text: str, where: str = "metrics") -> dict[tuple[int, int], float]:
    """(layer, expert) -> tokens routed, from Prometheus text of the cpu target's
    ``moepipe_expert_tokens_total{model,layer,expert}`` (summed over other labels). The one
    parser of these counters (``validate``'s balance job and ``moepipe balance`` both read
    them): a sample whose layer or expert is not an index of a model moepipe serves
    (:data:`moepipe.arch.bounds.LIMITS`) or whose value is not a finite count is a ConfigError
    naming ``where`` and the line."""
    out: dict[tuple[int, int], float] = {}
    for m in _EXPERT_SAMPLE.finditer(text):
        labels, value = m.groups()
        line = text.count("\n", 0, m.start()) + 1
        kv = dict(_LABEL.findall(labels))
        key = (_index(kv.get("layer"), "layer", MAX_LAYERS, where, line),
               _index(kv.get("expert"), "expert", MAX_EXPERTS, where, line))
        try:
            count = float(value)
        except ValueError:
            count = math.nan
        total = out.get(key, 0.0) + count
        if not 0 <= count <= MAX_COUNT or not total <= MAX_COUNT:
            raise ConfigError(f"{where}:{line}: {value[:40]!r} is not a token count (a finite "
                              f"number in 0..2^53)", "is this a moepipe deployment's metrics?")
        out[key] = total
    return out


def _index(label: str | None, what: str, limit: int, where: str, line: int) -> int:
    if label is None or not re.fullmatch(r"\d{1,9}", label) or int(label) >= limit:
        shown = "missing" if label is None else repr(label[:40])
        raise ConfigError(f"{where}:{line}: {what} label {shown} is not an index in "
                          f"0..{limit - 1}", "is this a moepipe deployment's metrics?")
    return int(label)


_RANK_SAMPLE = re.compile(r"^(moepipe_rank_(?:step|wait)_seconds_(?:sum|count)|"
                          r"moepipe_rank_group_up)\{([^}]*)\}\s+([0-9.eE+-]+)\s*$", re.M)


def rank_series(text: str) -> dict[tuple[str, int, str], float]:
    """A rank group's figures from Prometheus text (``moepipe.serving.rank_metrics``):
    (series, rank, op) -> value, series being ``step_sum``, ``step_count``, ``wait_sum``,
    ``wait_count`` (op ``""``) or ``up`` (rank -1, op ``""``); summed over models. Empty for a
    deployment without a rank group."""
    out: dict[tuple[str, int, str], float] = {}
    for name, labels, value in _RANK_SAMPLE.findall(text):
        kv = dict(_LABEL.findall(labels))
        if name == "moepipe_rank_group_up":
            key = ("up", -1, "")
        else:
            kind = name.removeprefix("moepipe_rank_").replace("_seconds", "")
            try:
                key = (kind, int(kv["rank"]), kv.get("op", ""))
            except (KeyError, ValueError):
                continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


_MODEL_INFO = re.compile(r"^moepipe_model_info\{([^}]*)\}[ \t]+(\S+)[ \t]*$", re.M)


def serving_version(text: str) -> str | None:
    """The weights version a cpu deployment serves: the ``version`` label of its
    ``moepipe_model_info`` sample whose value is 1 (None when there is none)."""
    for m in _MODEL_INFO.finditer(text):
        labels, value = m.groups()
        if value in ("1", "1.0"):
            return dict(_LABEL.findall(labels)).get("version") or None
    return None
