"""Blue/green on Kubernetes (issue 23 item 5): each release is its own workload, validated by a
Job before the stable Service moves to it; the older one drains one pod at a time.

Upstream behaviour relied on, and where it is stated:

* A Deployment's ``spec.selector`` is immutable in apps/v1 (Kubernetes docs, "Deployments",
  "Label selector updates"): a release that changes the selector is a new workload, never an
  edit. A Service's ``spec.selector`` may be changed by ``kubectl apply``: that is the switch.
* LeaderWorkerSet (kubernetes-sigs/lws ``api/leaderworkerset/v1/leaderworkerset_types.go``):
  ``status.readyReplicas`` counts whole groups that are ready; the ``scale`` subresource
  (``specpath=.spec.replicas``) lets ``kubectl scale`` and the autoscaler size it.
* Jobs (batch/v1 ``JobConditionType``): a finished Job has the condition ``Complete`` or
  ``Failed`` (``backoffLimit: 0``: one failed pod fails it; ``activeDeadlineSeconds`` bounds
  it, ending as ``Failed``).
* PodDisruptionBudgets bind the Eviction API only ("Disruptions": deleting or scaling down
  bypasses them), so the rollout reads ``status.disruptionsAllowed`` itself before each step.
* Triton (``docs/user_guide/model_management.md``, since server PR #8562): a model is reloaded
  by unloading it first, hence a second workload rather than an in-place reload.

The script's steps run in tests/e2e/test_rollout_script.py.
"""

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from test_operations import K8S_VERSIONS, _tool, k8s_errors, kustomize, make_cfg

from moepipe.config import parse_config
from moepipe.deploy.cluster.labels import RELEASE_LABEL
from moepipe.deploy.cluster.operate import render_operations
from moepipe.deploy.cluster.rollout import GATE_JOBS, VALIDATE_JOB_FILE

OLD, NEW = "aaaaaaaa0001", "bbbbbbbb0002"
# one pod (a Deployment), a cpu rank group and an MPI group (LeaderWorkerSets)
SHAPES = [("cpu", {"tp": 1}), ("cpu", {"tp": 2}), ("trtllm-engine", {"tp": 8, "pp": 2})]


def render(tmp_path: Path, target: str, version: str, **extra) -> tuple[object, Path]:
    cfg = make_cfg(tmp_path, target, **extra)
    out = tmp_path / f"deploy-{version}"
    out.mkdir()
    render_operations(cfg, out, version=version, model_dir=cfg.workdir / "artifacts" / "src")
    return cfg, out / "k8s"


def docs_of(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize(("target", "extra"), SHAPES)
def test_each_release_is_its_own_workload_and_the_service_selects_one(tmp_path, target, extra):
    _, old = render(tmp_path, target, OLD, **extra)
    _, new = render(tmp_path, target, NEW, **extra)
    objects = {}
    for version, folder in ((OLD, old), (NEW, new)):
        docs = kustomize(folder)
        objects[version] = {(d["kind"], d["metadata"]["name"]): d for d in docs}
        workloads = [d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet")]
        (w,) = workloads
        assert w["metadata"]["name"] == f"moepipe-{version[:8]}"
        assert w["metadata"]["labels"][RELEASE_LABEL] == version
        if w["kind"] == "Deployment":
            assert w["spec"]["selector"]["matchLabels"][RELEASE_LABEL] == version
            pods = [w["spec"]["template"]]
        else:
            lwt = w["spec"]["leaderWorkerTemplate"]
            pods = [lwt["leaderTemplate"], lwt["workerTemplate"]]
        assert all(p["metadata"]["labels"][RELEASE_LABEL] == version for p in pods)
        # the stable Service selects this release's serving pods; the budget every release's
        by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
        assert by_name[("Service", "moepipe")]["spec"]["selector"][RELEASE_LABEL] == version
        assert by_name[("Service", w["metadata"]["name"])]["spec"]["selector"][
            RELEASE_LABEL] == version
        assert RELEASE_LABEL not in by_name[("PodDisruptionBudget", "moepipe")]["spec"][
            "selector"]["matchLabels"]
        ref = by_name[("HorizontalPodAutoscaler", "moepipe")]["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == (w["kind"], w["metadata"]["name"])
        # names within Kubernetes' limits: a LeaderWorkerSet's worker StatefulSet
        # <name>-<group> gets a controller-revision-hash label of 11 more characters
        assert len(w["metadata"]["name"]) + len("-99") + 11 <= 63
        # k8s/release holds exactly the release's own objects (the rollout applies it first)
        own = kustomize(folder / "release")
        assert own and all(d["metadata"]["labels"].get(RELEASE_LABEL) == version for d in own)
    # the stable objects keep their names: applying the new release's updates them in place
    stable = {k for k, d in objects[NEW].items() if RELEASE_LABEL not in d["metadata"]["labels"]}
    assert stable == {k for k, d in objects[OLD].items()
                      if RELEASE_LABEL not in d["metadata"]["labels"]}
    assert {("Service", "moepipe"), ("HorizontalPodAutoscaler", "moepipe"),
            ("PodDisruptionBudget", "moepipe")} <= stable
    assert not (set(objects[NEW]) - stable) & set(objects[OLD])  # no release object shared


@pytest.mark.parametrize(("target", "extra"), SHAPES)
def test_the_validate_job_passes_the_validators_and_runs_the_gate_jobs_on_the_release(
        tmp_path, target, extra):
    cfg, k8s = render(tmp_path, target, NEW, **extra)
    cm, job = docs_of(k8s / VALIDATE_JOB_FILE)
    for version in K8S_VERSIONS:
        assert k8s_errors(cm, version) + k8s_errors(job, version) == []
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] > 0
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["command"][:2] == ["moepipe", "validate"]
    assert c["image"].startswith("moepipe-trtllm:")  # the image with moepipe in it
    # the config it runs is a valid moepipe config aimed at the new release's own Service
    run = parse_config(yaml.safe_load(cm["data"]["moepipe.yaml"]), "the job's moepipe.yaml")
    name = f"moepipe-{NEW[:8]}"
    assert run.validation.url == f"{name}:{cfg.deploy.http_port}"
    assert run.validation.grpc_url == f"{name}:{cfg.deploy.grpc_port}"
    assert run.validation.metrics_url == f"{name}:{cfg.deploy.metrics_port}"
    assert list(run.validation.jobs) == list(GATE_JOBS)
    assert str(run.model.path) == str(cfg.workdir / "artifacts" / "src")  # on the volume
    assert run.target == cfg.target and run.parallel == cfg.parallel
    assert {"name": "workdir", "mountPath": str(cfg.workdir), "readOnly": True} in \
        c["volumeMounts"]


@pytest.mark.parametrize(("target", "extra"), SHAPES)
def test_the_rollout_script_passes_shellcheck(tmp_path, target, extra):
    _, k8s = render(tmp_path, target, NEW, **extra)
    res = subprocess.run([_tool("shellcheck"), "-s", "sh", str(k8s / "rollout.sh")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.access(k8s / "rollout.sh", os.X_OK)
