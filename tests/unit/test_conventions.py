"""The rendered files follow the conventions of the tools that read them (issue 25 item 4):
Kubernetes' recommended ``app.kubernetes.io/*`` labels with selectors on the component that
still match their pods (kubernetes-validate runs in test_operations.py), Prometheus' naming
(no ``_total`` on a gauge, ``_ratio`` on a 0-1 value, recorded series that name their window,
a ``runbook_url`` on every alert that points at a README section which exists), Grafana's
40-character uid and its dashboard sidecar's ConfigMap. promtool on a live scrape is
tests/e2e/test_exported_metrics.py."""

import json
import re
from pathlib import Path

import pytest
import yaml
from test_operations import IDS, SHAPES, k8s_errors, kustomize, make_cfg, render

from moepipe.config import RUNBOOKS, CostSection
from moepipe.deploy.cluster import grafana, monitoring
from moepipe.deploy.cluster import labels as k8s_labels
from moepipe.deploy.cluster.operate import render_operations
from moepipe.deploy.metric_names import EXPORTED
from moepipe.serving.metrics import GAUGES

VERSION = "0123456789ab"  # the build version the pods serve (a fingerprint's 12 hex digits)

README = Path(__file__).parents[2] / "README.md"
NAME_LABEL, INSTANCE_LABEL, VERSION_LABEL, COMPONENT_LABEL, MANAGED_BY_LABEL = (
    k8s_labels.NAME_LABEL, k8s_labels.INSTANCE_LABEL, k8s_labels.VERSION_LABEL,
    k8s_labels.COMPONENT_LABEL, k8s_labels.MANAGED_BY_LABEL)
RECOMMENDED = {NAME_LABEL, INSTANCE_LABEL, VERSION_LABEL, COMPONENT_LABEL, MANAGED_BY_LABEL}


def all_docs(out: Path) -> list[dict]:
    """The objects of k8s/ (as kustomize builds them) and of its two add-on folders."""
    extra = [d for folder in ("prometheus-operator", "grafana")
             for path in sorted((out / "k8s" / folder).glob("*.yaml"))
             if path.name != "kustomization.yaml"
             for d in yaml.safe_load_all(path.read_text()) if d]
    return kustomize(out / "k8s") + extra


def pods(docs: list[dict]) -> list[dict]:
    """The labels of every pod template, by owner."""
    found = []
    for d in docs:
        if d["kind"] == "Deployment":
            found.append(d["spec"]["template"]["metadata"]["labels"])
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            found += [lwt["leaderTemplate"]["metadata"]["labels"],
                      lwt["workerTemplate"]["metadata"]["labels"]]
    return found


def selects(selector: dict, labels: dict) -> bool:
    """A Service's selector (a map), or a label selector (matchLabels, matchExpressions)."""
    if "matchLabels" in selector or "matchExpressions" in selector:
        ops = {"In": lambda v, vs: v in vs, "NotIn": lambda v, vs: v not in vs}
        return selects(selector.get("matchLabels", {}), labels) and all(
            ops[e["operator"]](labels.get(e["key"]), e["values"])
            for e in selector.get("matchExpressions", []))
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize(("target", "extra"), SHAPES, ids=IDS)
def test_objects_carry_the_recommended_labels_and_selectors_match_their_pods(
        tmp_path, target, extra):
    cfg, out = render(tmp_path, target, **extra)
    docs = all_docs(out)
    name = cfg.deploy.k8s.name
    for d in docs:
        meta_labels = d["metadata"]["labels"]
        assert RECOMMENDED <= meta_labels.keys(), d["kind"]
        assert "role" not in meta_labels
        assert (meta_labels[NAME_LABEL], meta_labels[INSTANCE_LABEL],
                meta_labels[MANAGED_BY_LABEL]) == ("moepipe", name, "moepipe")
    templates = pods(docs)
    for labels in templates:
        assert RECOMMENDED <= labels.keys() and "role" not in labels
    servers = [p for p in templates if p[COMPONENT_LABEL] == "server"]
    workers = [p for p in templates if p[COMPONENT_LABEL] == "worker"]
    assert len(servers) == 1 and len(workers) == (1 if "LeaderWorkerSet" in
                                                    {d["kind"] for d in docs} else 0)
    # the release's validate Job (k8s/rollout): its pod is selected by nothing that serves or
    # budgets (a budget over a Job's pod would allow no eviction at all)
    job_docs = [d for d in yaml.safe_load_all(
        (out / "k8s" / "rollout" / "validate-job.yaml").read_text()) if d]
    (job_pod,) = [d["spec"]["template"]["metadata"]["labels"] for d in job_docs
                  if d["kind"] == "Job"]
    assert RECOMMENDED <= job_pod.keys()
    for d in docs:
        spec = d.get("spec", {})
        sel = spec.get("selector")
        if d["kind"] in ("Service", "PodDisruptionBudget", "PodMonitor") and sel:
            assert not selects(sel, job_pod), d["kind"]
        if d["kind"] == "Deployment":
            sel = spec["selector"]["matchLabels"]
            assert selects(sel, spec["template"]["metadata"]["labels"])
            assert VERSION_LABEL not in sel  # an upgrade must not change a selector
        elif d["kind"] == "Service":
            matched = [p for p in templates if selects(spec["selector"], p)]
            # the serving Service reaches the servers only; the headless one every pod
            assert matched == (templates if spec.get("clusterIP") == "None" else servers)
        elif d["kind"] in ("PodDisruptionBudget", "PodMonitor"):
            sel = spec["selector"]
            matched = [p for p in templates if selects(sel, p)]
            assert matched == (templates if d["kind"] == "PodDisruptionBudget" else servers)
            assert VERSION_LABEL not in sel.get("matchLabels", {})


def test_a_version_is_a_valid_label_value():
    assert k8s_labels.label_value("0.2.0+local.g1234") == "0.2.0-local.g1234"
    assert re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?",
                        k8s_labels.label_value("+" + "1" * 80 + "+"))


def test_dashboard_ships_as_a_configmap_for_grafanas_sidecar(tmp_path):
    _, out = render(tmp_path)
    (cm,) = kustomize(out / "k8s" / "grafana")
    assert k8s_errors(cm, "1.29") == []
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (key, text), = cm["data"].items()
    shipped = (out / "monitoring" / "grafana-dashboard.json").read_text()
    assert text == shipped and key == json.loads(shipped)["uid"] + ".json"


def test_dashboard_uid_fits_grafanas_limit_for_long_names():
    assert grafana.dashboard_uid("moepipe") == "moepipe-moepipe"
    longest = "m" + "x" * 38 + "z"  # deploy.k8s.name allows 40 characters
    uid = grafana.dashboard_uid(longest)
    assert len(uid) <= 40 and uid.startswith("moepipe-mxxx")
    assert uid == grafana.dashboard_uid(longest)  # the same name: the same dashboard
    assert uid != grafana.dashboard_uid(longest[:-1] + "y")
    assert re.fullmatch(r"[A-Za-z0-9_-]+", uid)
    for n in range(1, 41):
        assert len(grafana.dashboard_uid("a" * n)) <= 40


def test_gauges_are_named_as_prometheus_says():
    """A gauge ends neither in _total (counters) nor unitless where it is 0-1 (_ratio)."""
    for name, _ in GAUGES.values():
        assert not name.endswith("_total"), name
    assert GAUGES["occupancy"][0] == "moepipe_batch_occupancy_ratio"
    assert GAUGES["slots"][0] == "moepipe_kv_slots"
    assert {"moepipe_kv_slots", "moepipe_batch_occupancy_ratio"} <= EXPORTED["cpu"]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown``."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("window_s, suffix", [(300, "5m"), (120, "2m"), (3600, "1h"),
                                              (90, "90s"), (86400, "1d")])
def test_recorded_series_name_their_window_and_alerts_their_runbook(tmp_path, window_s, suffix):
    cfg = make_cfg(tmp_path, monitoring={"rate_window_s": window_s})
    # with a price: the cost rules and their alert too
    cfg.validation.cost = CostSection(usd_per_hour=3.6, max_usd_per_million_tokens=1.0)
    out = tmp_path / "deploy"
    out.mkdir()
    render_operations(cfg, out, version=VERSION)
    rules = yaml.safe_load((out / "monitoring" / "moepipe-rules.yml").read_text())
    group = rules["groups"][0]["rules"]
    recorded = [r["record"] for r in group if "record" in r]
    # all but TensorRT-LLM's statistics window (counts as exported, no rate)
    assert monitoring.EXPERT_WINDOW in recorded and len(recorded) == 8
    assert all(r.endswith(f"rate{suffix}") for r in recorded
               if r != monitoring.EXPERT_WINDOW), recorded
    assert all(f"[{suffix}]" in r["expr"] for r in group if "rate(" in r["expr"])
    anchors = github_anchors(README.read_text())
    alerts = [r for r in group if "alert" in r]
    assert len(alerts) == 6
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page == RUNBOOKS and anchor in anchors, url


def test_runbooks_can_point_at_a_mirror(tmp_path):
    _, out = render(tmp_path, monitoring={"runbooks": "https://wiki.example/moepipe"})
    rules = yaml.safe_load((out / "monitoring" / "moepipe-rules.yml").read_text())
    urls = [r["annotations"]["runbook_url"] for r in rules["groups"][0]["rules"] if "alert" in r]
    assert urls and all(u.startswith("https://wiki.example/moepipe#runbook-") for u in urls)
    assert monitoring.adapter_rules("queue_compute_ratio", 300)["rules"]["custom"][0][
        "seriesQuery"].startswith("triton:queue_compute:ratio_rate5m{")


@pytest.mark.parametrize("value", ["wiki.example/moepipe", "https://wiki.example/p#x",
                                   "https://wiki.example/a b", "https://" + "w" * 1100])
def test_runbooks_must_be_a_plain_http_url(value):
    from moepipe.config import parse_config
    from moepipe.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        parse_config({"model": {"example": "tiny-mixtral"},
                      "deploy": {"monitoring": {"runbooks": value}}}, "moepipe.yaml")
    assert err.value.message.startswith("moepipe.yaml: deploy.monitoring.runbooks")
