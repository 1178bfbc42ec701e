"""The Grafana dashboard of a deployment (``monitoring/grafana-dashboard.json``, and as a
ConfigMap for Grafana's dashboard sidecar in ``k8s/grafana/``).

Classic dashboard JSON (Grafana "JSON model": uid, title, panels with gridPos, datasource,
targets[{refId, expr, legendFormat}]), Prometheus datasource chosen by the ``datasource``
variable. A panel is included only when its target exports every metric its queries read
(:mod:`moepipe.deploy.metric_names`), so no panel of a rendered dashboard stays empty for lack
of a metric.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from moepipe.deploy.cluster import labels
from moepipe.deploy.metric_names import exported, metrics_in
from moepipe.targets import get_target

# `$datasource`, not `${datasource}`: nothing that moepipe renders may keep a `${`.
DS = {"type": "prometheus", "uid": "$datasource"}
RI = "[$__rate_interval]"
SEL = '{model=~"$model"}'


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | heatmap | stat | bargauge
    queries: tuple[tuple[str, str], ...]  # (expr, legend)
    unit: str = "short"
    width: int = 12
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    repeat: str | None = None
    fallback: bool = False  # only with deploy.fallback (the BLS model exports it then)
    experts: str = ""  # reads expert counts of this kind (Target.expert_counts)


def _rate(metric: str, by: str = "model") -> str:
    return f"sum by ({by}) (rate({metric}{SEL}{RI}))"


EXPERT_RATE = ("sum by (layer, expert) (rate(moepipe_expert_tokens_total"
               f"{{window=\"\",layer=~\"$layer\"}}{RI}))")
# TensorRT-LLM's window (trtllm-pytorch): constant counts, read as they are.
EXPERT_WINDOW = ("sum by (layer, expert) (moepipe_expert_tokens_total"
                 "{window!=\"\",layer=~\"$layer\"})")
PANELS = (
    Panel("Request rate", "timeseries",
          ((_rate("nv_inference_request_success"), "{{model}} ok"),
           (_rate("nv_inference_request_failure"), "{{model}} failed")), "reqps"),
    Panel("Latency percentiles", "timeseries",
          (('max by (model, quantile) (nv_inference_request_summary_us{model=~"$model",'
            'quantile=~"0.5|0.9|0.99"}) / 1000', "{{model}} p{{quantile}}"),), "ms",
          description="Triton's request-latency summary (sliding window); for decoupled "
                      "models it covers the whole generation."),
    Panel("Time to first token (p50 / p99)", "timeseries",
          tuple((f"histogram_quantile({q}, sum by (le, model) "
                 f"(rate(nv_inference_first_response_histogram_ms_bucket{SEL}{RI})))",
                 f"{{{{model}}}} p{int(q * 100)}") for q in (0.5, 0.99)), "ms"),
    Panel("First-response latency histogram", "heatmap",
          ((f"sum by (le) (rate(nv_inference_first_response_histogram_ms_bucket{SEL}{RI}))",
            "{{le}}"),), "ms", options={"calculate": False, "yAxis": {"unit": "ms"}}),
    # The cpu target measures inside its model (moepipe.serving.metrics), in seconds.
    Panel("Time to first token (p50 / p99, at the model)", "timeseries",
          tuple((f"histogram_quantile({q}, sum by (le, model) "
                 f"(rate(moepipe_time_to_first_token_seconds_bucket{SEL}{RI})))",
                 f"{{{{model}}}} p{int(q * 100)}") for q in (0.5, 0.99)), "s"),
    Panel("Request latency histogram (at the model)", "heatmap",
          ((f"sum by (le) (rate(moepipe_request_latency_seconds_bucket{SEL}{RI}))", "{{le}}"),),
          "s", options={"calculate": False, "yAxis": {"unit": "s"}}),
    Panel("Queue time per request", "timeseries",
          ((f"{_rate('nv_inference_queue_duration_us')} / 1000 / clamp_min("
            f"{_rate('nv_inference_request_success')}, 1e-9)", "{{model}}"),), "ms"),
    Panel("Pending requests", "timeseries",
          ((f"sum by (model) (nv_inference_pending_request_count{SEL})", "{{model}}"),)),
    Panel("Batch slots (requests)", "timeseries",
          (('max by (model, request_type) (nv_trt_llm_request_metrics{model=~"$model",'
            'request_type=~"active|max|waiting"})', "{{request_type}}"),)),
    Panel("KV cache used", "timeseries",
          (('max by (model) (nv_trt_llm_kv_cache_block_metrics{model=~"$model",'
            'kv_cache_block_type="fraction"})', "{{model}}"),), "percentunit"),
    Panel("Running requests (cpu engine)", "timeseries",
          ((f"sum by (model) (moepipe_running_requests{SEL})", "{{model}}"),)),
    Panel("Generated tokens / s", "timeseries",
          ((_rate("moepipe_generated_tokens_total"), "{{model}}"),), "short"),
    Panel("Requests sent to the fallback (deploy.fallback)", "timeseries",
          ((f"sum by (reason) (rate(moepipe_fallback_requests_total{RI}))", "{{reason}}"),),
          "reqps", fallback=True),
    Panel("Expert activation, layer $layer (tokens / s per expert)", "heatmap",
          (("sum by (expert) (rate(moepipe_expert_tokens_total"
            f"{{window=\"\",layer=~\"$layer\"}}{RI}))", "{{expert}}"),), "short", width=12,
          repeat="layer", options={"calculate": False, "yAxis": {"axisLabel": "expert"}},
          experts="live"),
    Panel("Expert balance per layer (std / mean of tokens per expert)", "timeseries",
          ((f"stddev by (layer) ({EXPERT_RATE}) / (avg by (layer) ({EXPERT_RATE}) > 0)",
            "layer {{layer}}"),), "short",
          description="0 = every expert gets the same share; the MoepipeExpertImbalance "
                      "alert fires above monitoring.max_expert_imbalance.", experts="live"),
    Panel("Expert load in TensorRT-LLM's statistics window, layer $layer (tokens per expert)",
          "bargauge", (("sum by (expert) (moepipe_expert_tokens_total"
                        "{window!=\"\",layer=~\"$layer\"})", "{{expert}}"),), "short",
          width=12, repeat="layer", experts="window",
          description="Counted by TensorRT-LLM over deploy.trtllm.expert_statistic's "
                      "iterations and exported once written; `moepipe balance --metrics` "
                      "places experts from them.",
          options={"orientation": "vertical", "displayMode": "basic",
                   "reduceOptions": {"calcs": ["lastNotNull"], "values": False}}),
    Panel("Expert balance per layer in TensorRT-LLM's window (std / mean)", "timeseries",
          ((f"stddev by (layer) ({EXPERT_WINDOW}) / (avg by (layer) ({EXPERT_WINDOW}) > 0)",
            "layer {{layer}}"),), "short", experts="window",
          description="0 = every expert got the same share in the window; the "
                      "MoepipeExpertImbalance alert fires above "
                      "monitoring.max_expert_imbalance."),
)


def panels_for(target: str, fallback: bool = False, decoupled: bool = True,
               expert_statistic: bool = False) -> list[Panel]:
    """The panels whose every query reads only metrics the deployment exports (and, for
    expert panels, whose kind of expert counts it exports: ``Target.expert_counts``)."""
    names = exported(target, decoupled=decoupled, expert_statistic=expert_statistic)
    return [p for p in PANELS if (fallback or not p.fallback)
            and (not p.experts or p.experts == get_target(target).expert_counts)
            and all(metrics_in(expr) <= names for expr, _ in p.queries)]


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": pid, "type": p.kind, "title": p.title, "datasource": DS,
        "gridPos": {"h": 8, "w": p.width, "x": x, "y": y},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr,
                     "legendFormat": legend,
                     "format": "heatmap" if p.kind == "heatmap" and "le" in legend
                     else "time_series"}
                    for i, (expr, legend) in enumerate(p.queries)],
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": dict(p.options),
    }
    if p.description:
        out["description"] = p.description
    if p.repeat:
        out["repeat"] = p.repeat
        out["repeatDirection"] = "h"
    return out


UID_MAX = 40  # characters Grafana allows in a dashboard uid


def dashboard_uid(name: str) -> str:
    """``moepipe-<name>``, or, when that is longer than Grafana's 40 characters, its first 31
    characters + ``-`` + 8 hex digits of the name's SHA-256: the same name always gives the
    same uid (a re-render updates the dashboard in place), different names different ones."""
    uid = f"moepipe-{name}"
    if len(uid) <= UID_MAX:
        return uid
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{uid[:UID_MAX - 9].rstrip('-')}-{digest}"


def config_map(dashboard_json: str, uid: str, app: str) -> dict[str, Any]:
    """The dashboard as a ConfigMap that Grafana's dashboard sidecar (the grafana Helm chart's
    ``sidecar.dashboards``, kube-prometheus-stack) loads: labelled ``grafana_dashboard: "1"``,
    the sidecar's default label, the JSON under a key ending in ``.json``."""
    meta = labels.meta(f"{app}-grafana-dashboard", app, labels.DASHBOARD)
    meta["labels"]["grafana_dashboard"] = "1"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {f"{uid}.json": dashboard_json}}


def _variable(name: str, query: str, multi: bool = True) -> dict[str, Any]:
    return {"type": "query", "name": name, "label": name, "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
            "includeAll": True, "multi": multi, "current": {}, "sort": 3}


def dashboard(target: str, title: str, uid: str, fallback: bool = False,
              decoupled: bool = True, expert_statistic: bool = False) -> dict[str, Any]:
    chosen = panels_for(target, fallback, decoupled, expert_statistic)
    panels, x, y = [], 0, 0
    for i, p in enumerate(chosen, start=1):
        if x + p.width > 24:
            x, y = 0, y + 8
        panels.append(_panel_json(p, i, x, y))
        x += p.width
    variables = [{"type": "datasource", "name": "datasource", "label": "Prometheus",
                  "query": "prometheus", "current": {}},
                 _variable("model", "label_values(nv_inference_request_success, model)")]
    if any("$layer" in e for p in chosen for e, _ in p.queries):
        variables.append(_variable("layer",
                                   "label_values(moepipe_expert_tokens_total, layer)"))
    return {
        "id": None, "uid": uid, "title": title, "tags": ["moepipe", "triton", target],
        "timezone": "browser", "editable": True, "schemaVersion": 39, "version": 1,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables}, "annotations": {"list": []}, "panels": panels,
    }
