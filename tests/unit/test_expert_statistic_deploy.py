"""TensorRT-LLM's expert statistics in a rendered trtllm-pytorch deployment
(``deploy.trtllm.expert_statistic``): the environment its workers read in every launch path
(the pods, a LeaderWorkerSet's templates, the local command line, config.pbtxt for model.py),
a writable folder in the pods, the dashboard's expert panels for the window's counts, and the
imbalance alert on them (promtool).
"""

import json

import pytest
import yaml
from test_operations import (
    _series,
    by_kind,
    k8s_errors,
    kustomize,
    make_cfg,
    pod_templates,
    promtool,
    render,
)

from moepipe.config import RUNBOOKS
from moepipe.deploy.cluster import k8s, monitoring
from moepipe.deploy.cluster.operate import RULES_FILE, plan
from moepipe.deploy.metric_names import exported, metrics_in
from moepipe.deploy.render.targets import Artifacts
from moepipe.errors import ConfigError

WINDOW = {"trtllm": {"expert_statistic": {"start": 100, "stop": 1100}}}
ENV = {"EXPERT_STATISTIC_ITER_RANGE": "100-1100",
       "EXPERT_STATISTIC_PATH": k8s.EXPERT_STATISTIC_DIR}


def _env(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_pods_get_the_environment_and_a_writable_folder(tmp_path):
    _, out = render(tmp_path, "trtllm-pytorch", **WINDOW)
    docs = kustomize(out / "k8s")
    for version in ("1.29", "1.37"):
        assert [p for d in docs for p in k8s_errors(d, version)] == []
    (tmpl,) = pod_templates(docs)
    (c,) = tmpl["spec"]["containers"]
    assert ENV.items() <= _env(c).items()
    mount = [m for m in c["volumeMounts"] if m["mountPath"] == k8s.EXPERT_STATISTIC_DIR]
    assert len(mount) == 1 and not mount[0].get("readOnly")
    volume = [v for v in tmpl["spec"]["volumes"] if v["name"] == mount[0]["name"]]
    assert volume == [{"name": mount[0]["name"], "emptyDir": {}}]


def test_without_a_window_nothing_is_collected(tmp_path):
    _, out = render(tmp_path, "trtllm-pytorch")
    (tmpl,) = pod_templates(kustomize(out / "k8s"))
    assert not set(ENV) & set(_env(tmpl["spec"]["containers"][0]))
    assert not [v for v in tmpl["spec"]["volumes"] if v["name"].startswith("scratch")]


def test_a_leader_worker_set_carries_the_environment_to_every_pod(tmp_path):
    """trtllm-pytorch serves one node today (k8s.shape); a LeaderWorkerSet of a plan with
    the environment gives it to the leader and the workers, beside POD_NAME."""
    cfg = make_cfg(tmp_path, "trtllm-pytorch", **WINDOW)
    pod, _ = plan(cfg, "0123456789ab")
    shape = k8s.Shape(16, 2, 8)
    (lws,) = k8s.objects(pod, shape, min_replicas=1, max_replicas=2, metric="m",
                         target="1")["release/leaderworkerset.yaml"]
    assert k8s_errors(lws, "1.37") == []
    templates = lws["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        (c,) = templates[key]["spec"]["containers"]
        assert {"POD_NAME": None, **ENV}.items() <= _env(c).items()


def test_the_window_is_a_pytorch_backend_setting(tmp_path):
    for target in ("cpu", "trtllm-engine"):
        with pytest.raises(ConfigError, match="expert_statistic"):
            make_cfg(tmp_path, target, **WINDOW)
    with pytest.raises(ConfigError, match="start .100. must be smaller than stop"):
        make_cfg(tmp_path, "trtllm-pytorch", trtllm={"expert_statistic": {"start": 100,
                                                                          "stop": 100}})


def test_the_local_command_line_names_the_environment(tmp_path):
    from moepipe.commands.deploy import _gpu_instructions

    cfg = make_cfg(tmp_path, "trtllm-pytorch", **WINDOW)
    text = _gpu_instructions(cfg, Artifacts(version="0123456789ab", model_dir=tmp_path), cfg.deploy_dir / "model_repo")
    assert (f"EXPERT_STATISTIC_ITER_RANGE=100-1100 EXPERT_STATISTIC_PATH="
            f"{cfg.workdir / 'expert-statistic'} tritonserver --model-repository") in text


def test_the_dashboard_shows_the_windows_expert_load(tmp_path):
    _, out = render(tmp_path, "trtllm-pytorch", **WINDOW)
    dash = json.loads((out / "monitoring" / "grafana-dashboard.json").read_text())
    titles = [p["title"] for p in dash["panels"]]
    assert any("Expert load in TensorRT-LLM's statistics window" in t for t in titles)
    assert any("Expert balance per layer in TensorRT-LLM's window" in t for t in titles)
    assert not any(t.startswith("Expert activation") for t in titles)  # rates of live counts
    assert "Generated tokens / s" in titles
    names = exported("trtllm-pytorch", expert_statistic=True)
    for panel in dash["panels"]:
        for t in panel["targets"]:
            assert metrics_in(t["expr"]) <= names
    assert "layer" in [v["name"] for v in dash["templating"]["list"]]
    (tmp_path / "plain").mkdir()
    _, plain = render(tmp_path / "plain", "trtllm-pytorch")
    plain_titles = json.loads((plain / "monitoring" / "grafana-dashboard.json").read_text())
    assert not any("Expert" in p["title"] for p in plain_titles["panels"])


def test_the_imbalance_alert_fires_on_the_windows_counts(tmp_path):
    """promtool test rules: counts of a statistics window (constant, with a window label)
    give the same std/mean as live counters routing at the same proportions, and the alert
    fires after alert_for_s; an even window stays silent."""
    _, out = render(tmp_path, "trtllm-pytorch", monitoring={
        "rate_window_s": 120, "alert_for_s": 180, "max_expert_imbalance": 1.0}, **WINDOW)
    job = {"job": "moepipe", "model": "tensorrt_llm", "window": "100-1100"}
    skewed = [3700, 100, 100, 100]  # std/mean = sqrt(24300)/100 = 1.56
    inputs = [_series("moepipe_expert_tokens_total", f"{n}x20", instance="skewed", layer="3",
                      expert=str(e), **job) for e, n in enumerate(skewed)]
    inputs += [_series("moepipe_expert_tokens_total", "_x3 1000x17", instance="even",
                       layer="3", expert=str(e), **job) for e in range(4)]
    labels = {"instance": "skewed", "job": "moepipe", "layer": "3", "model": "tensorrt_llm"}
    tests = {"rule_files": [RULES_FILE], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": inputs,
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "MoepipeExpertImbalance", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "MoepipeExpertImbalance", "exp_alerts": [{
                "exp_labels": {"severity": "warning", **labels},
                "exp_annotations": {
                    "summary": "layer 3 of tensorrt_llm: tokens per expert std/mean = 1.559",
                    "description": "The router sends most tokens to a few experts: those "
                                   "experts' ranks bound the step time (expert parallelism "
                                   "cannot balance the load).",
                    "runbook_url": f"{RUNBOOKS}#runbook-moepipeexpertimbalance"}}]}],
        "promql_expr_test": [{
            "expr": f"round({monitoring.recorded(120).expert_imbalance}, 0.000001)",
            "eval_time": "10m",
            "exp_samples": [
                {"labels": json.dumps(labels).replace('": "', '="').replace('", "', '",')
                 .replace('{"', "{"), "value": round(24300 ** 0.5 / 100, 6)},
                {"labels": '{instance="even",job="moepipe",layer="3",model="tensorrt_llm"}',
                 "value": 0}]}],
    }]}
    path = out / "monitoring" / "window_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    assert "SUCCESS" in promtool("test", "rules", path.name, cwd=out / "monitoring")
    assert by_kind  # the module's helpers, shared with test_operations

