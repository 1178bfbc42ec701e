"""The blue/green rollout script (k8s/rollout.sh, moepipe.deploy.cluster.rollout) run step by
step, and the deploy folder that keeps each release's repository and rollout.

No Kubernetes API server installs on these machines, so the script runs against a kubectl
stand-in: it answers what kubectl prints for the queries the script makes (the jsonpath rows,
a Job's Complete/Failed condition, the budget's disruptionsAllowed) and records every call, so
the test checks the script's order of steps and where it stops, not a cluster. The objects
themselves pass the real validators in tests/unit/test_rollout.py and test_operations.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moepipe.config import parse_config
from moepipe.deploy.cluster.operate import render_operations
from moepipe.deploy.cluster.rollout import VALIDATE_JOB_FILE
from moepipe.deploy.render.repository import render_deployment
from moepipe.deploy.render.targets import Artifacts
from moepipe.deploy.serve_paths import KEEP_RELEASES

OLD, NEW = "aaaaaaaa0001", "bbbbbbbb0002"


def render(tmp_path: Path, target: str, version: str, tp: int = 1, pp: int = 1,
           **deploy) -> tuple[object, Path]:
    cfg = parse_config({"model": {"example": "tiny-mixtral"}, "target": target,
                        "parallel": {"tp": tp, "pp": pp}, "workdir": str(tmp_path / "work"),
                        "deploy": deploy}, "moepipe.yaml").resolve_paths(tmp_path)
    out = tmp_path / f"deploy-{version}"
    out.mkdir()
    render_operations(cfg, out, version=version, model_dir=cfg.workdir / "artifacts" / "src")
    return cfg, out / "k8s"


# -- the script's steps, against a kubectl stand-in ---------------------------------------

STANDIN = r'''
import json, os, sys
from pathlib import Path
import yaml

state_path = Path(os.environ["STANDIN_STATE"])
st = json.loads(state_path.read_text())
args = sys.argv[1:]
if args[:1] == ["--namespace"]:
    st["namespaces"].append(args[1])
    args = args[2:]
st["calls"].append(args)

def save():
    state_path.write_text(json.dumps(st))

def workload_docs(files):
    for f in files:
        for d in yaml.safe_load_all(Path(f).read_text()):
            if d:
                yield d

def label_value(selector, key):
    for part in selector.split(","):
        k, _, v = part.partition("=")
        if k == key:
            return v
    return None

verb = args[0]
out = ""
code = 0
if verb == "apply":
    files = []
    for i, a in enumerate(args):
        if a == "-k":
            folder = Path(args[i + 1])
            files += [folder / r for r in yaml.safe_load(
                (folder / "kustomization.yaml").read_text())["resources"]]
        if a == "-f":
            files.append(Path(args[i + 1]))
    for d in workload_docs(files):
        kind, name = d["kind"].lower(), d["metadata"]["name"]
        if kind in ("deployment", "leaderworkerset"):
            st["workloads"].setdefault(f"{kind}/{name}", {
                "replicas": d["spec"]["replicas"],
                "release": d["metadata"]["labels"].get("moepipe.dev/release", "")})
        if kind == "service" and name == "moepipe":
            st["serving"] = d["spec"]["selector"]["moepipe.dev/release"]
        if kind == "job":
            st["jobs"].append(name)
elif verb == "get":
    what = args[1]
    if what.startswith(("deployments.apps", "leaderworkersets")):
        kind = "deployment" if what.startswith("deployments") else "leaderworkerset"
        out = "".join(f"{k} {w['replicas']} {w['release']}\n"
                      for k, w in st["workloads"].items() if k.startswith(kind + "/"))
    elif what in st["workloads"]:
        out = str(st["workloads"][what]["replicas"])
    elif what == "job":
        out = "True/" if st["job_passes"] else "/True"
    elif what == "pdb":  # disruptionsAllowed: the scripted answers, then 1
        out = str(st["budget"].pop(0)) if st["budget"] else "1"
    elif what == "pods":
        rel = label_value(args[args.index("-l") + 1], "moepipe.dev/release")
        out = "".join(f"pod/{k}-{i}\n" for k, w in st["workloads"].items()
                      if w["release"] == rel for i in range(w["replicas"]))
elif verb == "scale":
    st["workloads"][args[1]]["replicas"] = int(args[2].split("=")[1])
elif verb == "wait":
    code = 0 if st["ready"] else 1
elif verb == "delete" and "-l" in args:
    rel = label_value(args[args.index("-l") + 1], "moepipe.dev/release")
    st["workloads"] = {k: w for k, w in st["workloads"].items() if w["release"] != rel}
elif verb == "delete" and args[1] in st["workloads"]:
    del st["workloads"][args[1]]
elif verb == "logs":
    out = "validate FAILED: smoke.generate: no answer\n"
save()
sys.stdout.write(out)
sys.exit(code)
'''


def standin(tmp_path: Path) -> Path:
    """The kubectl stand-in's command (its cluster: the JSON file ``STANDIN_STATE`` names)."""
    script = tmp_path / "kubectl.py"
    script.write_text(STANDIN)
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    kubectl.chmod(0o755)
    return kubectl


def cluster(path: Path, workloads: dict, *, job_passes: bool = True, ready: bool = True,
            budget: tuple[int, ...] = ()) -> None:
    path.write_text(json.dumps({"workloads": workloads, "calls": [], "jobs": [],
                                "namespaces": [], "serving": None, "budget": list(budget),
                                "job_passes": job_passes, "ready": ready}))


def run_rollout(tmp_path: Path, k8s: Path, *, workloads: dict, job_passes: bool = True,
                ready: bool = True, budget: tuple[int, ...] = ()
                ) -> tuple[subprocess.CompletedProcess, dict]:
    state = tmp_path / "cluster.json"
    cluster(state, workloads, job_passes=job_passes, ready=ready, budget=budget)
    env = {**os.environ, "KUBECTL": str(standin(tmp_path)), "STANDIN_STATE": str(state),
           "MOEPIPE_DRAIN_S": "0", "MOEPIPE_POLL_S": "0"}
    res = subprocess.run(["/bin/sh", str(k8s / "rollout.sh")], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path)
    return res, json.loads(state.read_text())


def _verbs(calls: list[list[str]]) -> list[str]:
    return [" ".join(c[:2]) for c in calls]


@pytest.mark.parametrize(("target", "extra"), [("cpu", {"tp": 1}),
                                               ("trtllm-engine", {"tp": 8, "pp": 2})])
def test_the_rollout_validates_then_switches_then_drains_the_old_release(tmp_path, target,
                                                                         extra):
    _, k8s = render(tmp_path, target, NEW, k8s={"namespace": "llm"}, **extra)
    kind = "leaderworkerset" if "pp" in extra else "deployment"
    old = {f"{kind}/moepipe-{OLD[:8]}": {"replicas": 3, "release": OLD}}
    res, st = run_rollout(tmp_path, k8s, workloads=old)
    assert res.returncode == 0, res.stderr
    assert set(st["namespaces"]) == {"llm"}
    calls = st["calls"]
    new = f"{kind}/moepipe-{NEW[:8]}"
    verbs = _verbs(calls)
    # the new release comes up with the old one's capacity before anything else happens
    assert ["scale", new, "--replicas=3"] in calls
    waited = verbs.index(f"wait {new}")
    job = calls.index(["apply", "-f", VALIDATE_JOB_FILE])
    rbac = ["apply", "-f", "rbac.yaml"]  # the MPI leader's rights, before its pods start
    assert (rbac in calls) is (kind == "leaderworkerset")
    switch = next(i for i, c in enumerate(calls) if c[:3] == ["apply", "-f", "service.yaml"])
    assert waited < job < switch
    assert st["serving"] == NEW and st["jobs"] == [f"moepipe-{NEW[:8]}-validate"]
    # after the switch the old release goes one pod at a time, each after the budget allows it
    scales = [c for c in calls[switch:] if c[0] == "scale"]
    assert [c[2] for c in scales] == ["--replicas=2", "--replicas=1", "--replicas=0"]
    budget = [i for i, c in enumerate(calls) if c[:2] == ["get", "pdb"]]
    assert len(budget) == 3 and all(switch < i for i in budget)
    assert list(st["workloads"]) == [new]  # the old release's objects are deleted
    assert "release bbbbbbbb0002 serves" in res.stderr


def test_the_drain_waits_while_the_budget_allows_no_disruption(tmp_path):
    """Another pod of the deployment is down (disruptionsAllowed 0): the old release keeps its
    pods until the budget allows one to go, and then loses one at a time."""
    _, k8s = render(tmp_path, "cpu", NEW, tp=1)
    old = {f"deployment/moepipe-{OLD[:8]}": {"replicas": 2, "release": OLD}}
    res, st = run_rollout(tmp_path, k8s, workloads=old, budget=(0, 0, 0, 1, 0, 1))
    assert res.returncode == 0, res.stderr
    after = st["calls"][next(i for i, c in enumerate(st["calls"])
                             if c[:3] == ["apply", "-f", "service.yaml"]):]
    steps = [c[0] if c[0] == "scale" else "budget" for c in after
             if c[0] == "scale" or c[:2] == ["get", "pdb"]]
    # 0, 0, 0, then 1: scale to 1; 0, then 1: scale to 0
    assert steps == ["budget"] * 4 + ["scale"] + ["budget"] * 2 + ["scale"]


def test_a_failed_validation_leaves_the_old_release_serving(tmp_path):
    _, k8s = render(tmp_path, "cpu", NEW, tp=1)
    old = {f"deployment/moepipe-{OLD[:8]}": {"replicas": 2, "release": OLD}}
    res, st = run_rollout(tmp_path, k8s, workloads=old, job_passes=False)
    assert res.returncode == 1
    assert "rollout: error: the validate job moepipe-bbbbbbbb-validate failed" in res.stderr
    assert "validate FAILED" in res.stderr  # the Job's log is shown
    assert st["serving"] is None  # the Service was never applied
    assert st["workloads"][f"deployment/moepipe-{OLD[:8]}"]["replicas"] == 2
    assert not any(c[:3] == ["apply", "-f", "service.yaml"] for c in st["calls"])


def test_a_release_that_never_gets_ready_is_not_validated_nor_served(tmp_path):
    _, k8s = render(tmp_path, "cpu", NEW, tp=1)
    old = {f"deployment/moepipe-{OLD[:8]}": {"replicas": 1, "release": OLD}}
    res, st = run_rollout(tmp_path, k8s, workloads=old, ready=False)
    assert res.returncode == 1 and "is not ready after" in res.stderr
    assert st["jobs"] == [] and st["serving"] is None


def test_a_workload_from_before_releases_is_drained_too(tmp_path):
    """A Deployment rendered before releases had their own (no release label) is the old one."""
    _, k8s = render(tmp_path, "cpu", NEW, tp=1)
    res, st = run_rollout(tmp_path, k8s, workloads={"deployment/moepipe": {"replicas": 1,
                                                                          "release": ""}})
    assert res.returncode == 0, res.stderr
    assert list(st["workloads"]) == [f"deployment/moepipe-{NEW[:8]}"]
    assert ["delete", "deployment/moepipe", "--ignore-not-found"] in st["calls"]


def test_the_deploy_folder_keeps_each_release_and_its_rollout(tmp_path, examples):
    """Each render writes releases/<version> (repository, tokenizer, k8s with rollout.sh) and
    carries the newest earlier ones over: their pods still read them, and rolling back is
    running the earlier release's own rollout.sh."""
    model = examples["tiny-mixtral"]
    cfg = parse_config({"model": {"path": str(model)}, "target": "trtllm-pytorch",
                        "workdir": str(tmp_path / "work")}, "moepipe.yaml")
    versions = [f"{i:012x}" for i in range(1, KEEP_RELEASES + 2)]
    for v in versions:
        render_deployment(cfg, Artifacts(version=v, model_dir=model, hf_serving_dir=model,
                                         vocab_size=512))
    releases = cfg.deploy_dir / "releases"
    kept = sorted(p.name for p in releases.iterdir())
    assert kept == versions[-KEEP_RELEASES:]  # the oldest went
    for v in kept:
        assert (releases / v / "model_repo" / "tensorrt_llm" / "config.pbtxt").is_file()
        assert (releases / v / "k8s" / "rollout.sh").is_file()
        assert f"RELEASE='{v}'" in (releases / v / "k8s" / "rollout.sh").read_text()
    assert f"RELEASE='{versions[-1]}'" in (cfg.deploy_dir / "k8s" / "rollout.sh").read_text()


def project(work: Path, example: str):
    """A trtllm-pytorch project of ``example`` in ``work`` (its moepipe.yaml)."""
    import yaml

    data = {"model": {"example": example}, "target": "trtllm-pytorch", "workdir": str(work)}
    work.mkdir(parents=True, exist_ok=True)
    (work / "moepipe.yaml").write_text(yaml.safe_dump(data))
    return parse_config(data, "moepipe.yaml").resolve_paths(work)


def _cli(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moepipe", *args], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, **env}, timeout=300)


def test_moepipe_deploy_rollout_runs_the_release_and_a_stop_is_one_line(tmp_path, monkeypatch):
    """`moepipe deploy --rollout` on a built trtllm-pytorch config: without kubectl it stops
    before writing anything; with it the rendered release is rolled out (a failed validation is
    one line and a non-zero exit, the serving release untouched); after a second build's
    rollout, `--rollback` rolls the first out again with its own kept script."""
    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy

    work = tmp_path / "work"
    cfg = project(work, "tiny-mixtral")
    run_build(work / "moepipe.yaml", echo=lambda s: None)
    missing = _cli(["deploy", "--rollout"], work, KUBECTL=str(tmp_path / "no-kubectl"))
    assert missing.returncode != 0
    assert missing.stderr.strip().count("\n") == 0 and "not on PATH" in missing.stderr
    assert not cfg.deploy_dir.exists()  # nothing rendered

    state = tmp_path / "cluster.json"
    env = {"KUBECTL": str(standin(tmp_path)), "STANDIN_STATE": str(state),
           "MOEPIPE_DRAIN_S": "0", "MOEPIPE_POLL_S": "0"}
    serving = {f"deployment/moepipe-{OLD[:8]}": {"replicas": 2, "release": OLD}}
    cluster(state, serving, job_passes=False)
    failed = _cli(["deploy", "--rollout"], work, **env)
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the rollout of release ") and "validate job" in last, last
    st = json.loads(state.read_text())
    assert st["serving"] is None and st["workloads"][f"deployment/moepipe-{OLD[:8]}"][
        "replicas"] == 2
    first = json.loads((cfg.deploy_dir / "moepipe-deploy.json").read_text())["version"]

    cluster(state, serving)
    done = _cli(["deploy", "--rollout", "--json"], work, **env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"release": first, "rolled_out": True,
                                       "script": str(cfg.deploy_dir / "k8s" / "rollout.sh")}
    assert "rollout: 4/5 switch" in done.stderr  # the steps as they happen, on stderr
    st = json.loads(state.read_text())
    assert st["serving"] == first
    assert list(st["workloads"]) == [f"deployment/moepipe-{first[:8]}"]

    # a second build (another model), rolled out; then back to the first (in this process)
    second_cfg = project(work, "tiny-qwen2-moe")
    run_build(work / "moepipe.yaml", echo=lambda s: None)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    version = run_deploy(second_cfg, echo=lambda s: None, to_cluster=True)["release"]
    assert version != first and json.loads(state.read_text())["serving"] == version
    said: list[str] = []
    back = run_deploy(second_cfg, echo=said.append, to_cluster=True, rollback=True)
    assert back["release"] == first and f"rolling out release {first}" in said[0]
    st = json.loads(state.read_text())
    assert st["serving"] == first
    assert list(st["workloads"]) == [f"deployment/moepipe-{first[:8]}"]
