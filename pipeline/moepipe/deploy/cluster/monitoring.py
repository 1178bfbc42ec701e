"""Prometheus files for a deployment: ``<deploy>/monitoring/``.

* ``prometheus.yml`` - scrape config of the local deployment (``promtool check config``); in a
  cluster ``k8s/prometheus-operator/`` holds a PodMonitor and the same rules as a
  PrometheusRule.
* ``moepipe-rules.yml`` - recording rules and alerts (p99 latency over the SLO, error ratio,
  queue time, server down, expert imbalance; with a price, US$ per million tokens and its
  alert). ``promtool check rules`` accepts it. A series recorded from rates names their window
  (``moepipe:expert_tokens:rate5m``, :func:`recorded`); every alert has a ``runbook_url``: its
  section of the README (``deploy.monitoring.runbooks``).
* ``prometheus-adapter.yaml`` - the adapter rule that serves the autoscaler's metric on
  ``custom.metrics.k8s.io`` (values for the adapter's Helm chart: ``rules.custom``).

Metric names are Triton's (server ``docs/user_guide/metrics.md``: counters without a ``_total``
suffix, the ``_summary_us`` quantiles of ``--metrics-config summary_latencies=true``) and
moepipe's ``moepipe_expert_tokens_total{model,layer,expert}``. Token rates: moepipe's models'
``moepipe_generated_tokens_total`` / ``moepipe_prompt_tokens_total``, TensorRT-LLM's backend's
``nv_llm_output_token_len_sum`` / ``nv_llm_input_token_len_sum`` (its
``custom_metrics_reporter.cc``: histograms of each request's token counts, so ``_sum`` counts
tokens).

Cost per token (:mod:`moepipe.utils.cost`): ``$/M = $/h / (tokens/s x 3600) x 1e6`` per scraped
server (a replica; a LeaderWorkerSet's leader speaks for its group), the price being
``validate.cost``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from moepipe.config import RUNBOOKS
from moepipe.deploy.metric_names import metrics_in

JOB = "moepipe"
# TensorRT-LLM's statistics window (trtllm-pytorch): counts, no rate, so no rate window.
EXPERT_WINDOW = "moepipe:expert_tokens:window"
LAYER = "job, instance, model, layer"
# The autoscaler's metric names on custom.metrics.k8s.io (prometheus-adapter renames).
HPA_NAMES = {"pending_requests": "moepipe_pending_requests",
             "queue_compute_ratio": "moepipe_queue_compute_ratio"}
# Each alert's runbook: the README section "Runbook: <alert>", by its anchor.
RUNBOOK_ANCHOR = "runbook-{alert}"


def _dur(seconds: int) -> str:
    return f"{seconds}s"


def window(seconds: int) -> str:
    """A rate window as a Prometheus duration in its largest whole unit (300 -> ``5m``): the
    suffix of the recorded series' names, which state their window."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


@dataclass(frozen=True)
class Recorded:
    """The names of the series the rules record from rates over one window
    (level:metric:operations, Prometheus' naming practice; the operations end in the window,
    so a dashboard or an alert cannot mix two windows up)."""

    expert_rate: str
    expert_imbalance: str
    queue_compute: str
    output_rate: str
    input_rate: str
    cost_output: str  # US$ per million output tokens
    cost: str  # US$ per million tokens, input and output alike


def recorded(window_s: int) -> Recorded:
    """The recorded series' names for a rate window of ``window_s`` seconds."""
    w = window(window_s)
    return Recorded(expert_rate=f"moepipe:expert_tokens:rate{w}",
                    expert_imbalance=f"moepipe:expert_tokens:stddev_over_mean_rate{w}",
                    queue_compute=f"triton:queue_compute:ratio_rate{w}",
                    output_rate=f"moepipe:output_tokens:rate{w}",
                    input_rate=f"moepipe:input_tokens:rate{w}",
                    cost_output=f"moepipe:usd_per_million_output_tokens:rate{w}",
                    cost=f"moepipe:usd_per_million_tokens:rate{w}")


def hpa_series(metric: str, window_s: int) -> tuple[str, str]:
    """(the series prometheus-adapter reads, the name it serves) of the autoscaler's
    ``metric``: Triton's pending requests, or the recorded queue / compute ratio."""
    series = {"pending_requests": "nv_inference_pending_request_count",
              "queue_compute_ratio": recorded(window_s).queue_compute}[metric]
    return series, HPA_NAMES[metric]


def cost_rules(window_s: int, usd_per_hour: float, max_usd_per_million_tokens: float | None,
               for_s: int) -> list[dict[str, Any]]:
    """Token rates per server, US$ per million output tokens and per million tokens (input
    and output alike), and the alert on the latter; an idle server gives no cost sample."""
    w, r = f"[{window(window_s)}]", recorded(window_s)

    def rate(*names: str) -> str:
        return " or ".join(f"sum by (job, instance) (rate({n}{w}))" for n in names)

    per_million = f"{usd_per_hour / 3600 * 1e6:.10g}"  # US$ per second, times a million
    out: list[dict[str, Any]] = [
        {"record": r.output_rate,
         "expr": rate("moepipe_generated_tokens_total", "nv_llm_output_token_len_sum")},
        {"record": r.input_rate,
         "expr": rate("moepipe_prompt_tokens_total", "nv_llm_input_token_len_sum")},
        {"record": r.cost_output, "expr": f"{per_million} / ({r.output_rate} > 0)"},
        {"record": r.cost,
         "expr": f"{per_million} / (({r.input_rate} + {r.output_rate}) > 0)"},
    ]
    if max_usd_per_million_tokens is not None:
        out.append({
            "alert": "MoepipeCostPerTokenHigh",
            "expr": f"{r.cost} > {max_usd_per_million_tokens:g}", "for": _dur(for_s),
            "labels": {"severity": "warning"},
            "annotations": {"summary": "{{ $labels.instance }} serves tokens at "
                                       "{{ $value | humanize }} US$ per million (limit "
                                       f"{max_usd_per_million_tokens:g}, at "
                                       f"{usd_per_hour:g} US$/h)",
                            "description": "Too few tokens for what the deployment costs: "
                                           "scale it in, or send it more traffic."}})
    return out


def rules(*, window_s: int, for_s: int, slo_p99_ms: float, max_error_ratio: float,
          max_queue_ms: float, max_expert_imbalance: float, runbooks: str = RUNBOOKS,
          interval_s: int | None = None, exported: set[str] | None = None,
          usd_per_hour: float | None = None, max_usd_per_million_tokens: float | None = None
          ) -> dict[str, Any]:
    """The rule file's content; ``window_s`` is the rate window, ``for_s`` how long a
    condition must hold before its alert fires. With ``exported`` (the metrics the deployment
    exports, :func:`moepipe.deploy.metric_names.exported`) a rule that reads anything else is
    left out: it could never fire, and nothing would say why. ``usd_per_hour``: the
    deployment's price (cost rules and, with ``max_usd_per_million_tokens``, their alert).
    Each alert's ``runbook_url`` is its section of the page ``runbooks`` (moepipe's README)."""
    w, r = f"[{window(window_s)}]", recorded(window_s)
    success = f"sum by (model) (rate(nv_inference_request_success{w}))"
    failure = f"sum by (model) (rate(nv_inference_request_failure{w}))"
    spread = "stddev by ({0}) ({1}) / (avg by ({0}) ({1}) > 0)"
    recording = [
        # Live counts (cpu): the current load is their rate.
        {"record": r.expert_rate,
         "expr": f"sum by (job, instance, model, layer, expert) "
                 f'(rate(moepipe_expert_tokens_total{{window=""}}{w}))'},
        # TensorRT-LLM's statistics window (trtllm-pytorch): counts of iterations START-STOP,
        # constant once exported; the load is the counts themselves.
        {"record": EXPERT_WINDOW,
         "expr": "sum by (job, instance, model, layer, expert, window) "
                 '(moepipe_expert_tokens_total{window!=""})'},
        # std/mean of the tokens each expert of a layer receives: 0 when the router spreads
        # tokens evenly, sqrt(E-1) when one expert takes them all. Idle layers give no sample.
        {"record": r.expert_imbalance,
         "expr": f"({spread.format(LAYER, r.expert_rate)}) or "
                 f"({spread.format(LAYER, EXPERT_WINDOW)})"},
        {"record": r.queue_compute,
         "expr": f"sum by (namespace, pod, model) (rate(nv_inference_queue_duration_us{w}))"
                 f" / clamp_min(sum by (namespace, pod, model) "
                 f"(rate(nv_inference_compute_infer_duration_us{w})), 1)"},
    ]
    group: dict[str, Any] = {"name": "moepipe", "rules": recording + [
        {"alert": "MoepipeServerDown", "expr": f'up{{job="{JOB}"}} == 0', "for": _dur(for_s),
         "labels": {"severity": "critical"},
         "annotations": {"summary": "Triton at {{ $labels.instance }} is not answering "
                                    "metric scrapes"}},
        {"alert": "MoepipeLatencyP99High",
         "expr": 'max by (model) (nv_inference_request_summary_us{quantile="0.99"}) / 1000 '
                 f"> {slo_p99_ms:g}",
         "for": _dur(for_s), "labels": {"severity": "warning"},
         "annotations": {"summary": "p99 request latency of {{ $labels.model }} is "
                                    "{{ $value | humanize }} ms (SLO "
                                    f"{slo_p99_ms:g} ms)"}},
        {"alert": "MoepipeErrorRatioHigh",
         "expr": f"{failure} / clamp_min({success} + {failure}, 1e-9) > {max_error_ratio:g}",
         "for": _dur(for_s), "labels": {"severity": "warning"},
         "annotations": {"summary": "{{ $labels.model }} fails {{ $value | humanizePercentage }}"
                                    " of its requests"}},
        {"alert": "MoepipeQueueTimeHigh",
         "expr": f"sum by (model) (rate(nv_inference_queue_duration_us{w})) / 1000 / "
                 f"clamp_min({success}, 1e-9) > {max_queue_ms:g}",
         "for": _dur(for_s), "labels": {"severity": "warning"},
         "annotations": {"summary": "requests of {{ $labels.model }} wait "
                                    "{{ $value | humanize }} ms in the queue on average"}},
        {"alert": "MoepipeExpertImbalance",
         "expr": f"{r.expert_imbalance} > {max_expert_imbalance:g}",
         "for": _dur(for_s), "labels": {"severity": "warning"},
         "annotations": {"summary": "layer {{ $labels.layer }} of {{ $labels.model }}: "
                                    "tokens per expert std/mean = {{ $value | humanize }}",
                         "description": "The router sends most tokens to a few experts: "
                                        "those experts' ranks bound the step time "
                                        "(expert parallelism cannot balance the load)."}},
    ]}
    if exported is not None:
        group["rules"] = _readable(group["rules"], exported)
    if usd_per_hour is not None:  # each reads whichever token counter the target exports
        group["rules"] += cost_rules(window_s, usd_per_hour, max_usd_per_million_tokens, for_s)
    for rule in group["rules"]:
        if "alert" in rule:
            anchor = RUNBOOK_ANCHOR.format(alert=rule["alert"].lower())
            rule["annotations"]["runbook_url"] = f"{runbooks}#{anchor}"
    if interval_s is not None:
        group["interval"] = _dur(interval_s)
    return {"groups": [group]}


def _readable(group: list[dict[str, Any]], exported: set[str]) -> list[dict[str, Any]]:
    """The rules whose expressions read only exported metrics or series recorded before them."""
    available = set(exported)
    kept = []
    for rule in group:
        if metrics_in(rule["expr"]) <= available:
            kept.append(rule)
            if "record" in rule:
                available.add(rule["record"])
    return kept


def scrape_config(*, local_target: str, scrape_interval_s: int, evaluation_interval_s: int,
                  rule_file: str) -> dict[str, Any]:
    """prometheus.yml for the local deployment. In a cluster, the Prometheus Operator's
    PodMonitor of ``k8s/prometheus-operator`` scrapes the pods instead (and labels the samples
    with ``namespace`` and ``pod``, which prometheus-adapter maps to Kubernetes objects)."""
    return {"global": {"scrape_interval": _dur(scrape_interval_s),
                       "evaluation_interval": _dur(evaluation_interval_s)},
            "rule_files": [rule_file],
            "scrape_configs": [{"job_name": JOB,
                                "static_configs": [{"targets": [local_target]}]}]}


def adapter_rules(metric: str, window_s: int) -> dict[str, Any]:
    """prometheus-adapter rule exposing ``metric`` per pod under its custom-metrics name."""
    series, name = hpa_series(metric, window_s)
    return {"rules": {"custom": [{
        "seriesQuery": f'{series}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                    "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{series}$", "as": name},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }]}}


def dump(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=100)
