"""Kubernetes rights and filesystem of moepipe's pods (issue 26, item 10): only a LeaderWorker
Set's leader may read pods and exec into them (its mpirun's kubessh agent), workers and
one-node pods get no API token at all, and every container runs with a read-only root
filesystem, writing only to its memory /dev/shm and its /tmp volume (the workdir claim is
mounted read-only). The objects still pass kustomize, kubernetes-validate and the LWS CRD
schema (test_operations.py); tests/e2e/test_k8s_filesystem.py runs the cpu pod's own command
under a read-only root with these volumes."""

import re

import pytest
from test_operations import by_kind, k8s_errors, kustomize, pod_templates, render


def lws_docs(tmp_path):
    _, out = render(tmp_path, "trtllm-engine", tp=8, pp=2)
    return by_kind(kustomize(out / "k8s"))


def allowed(kinds, account):
    """(verb, resource) pairs the namespace's Roles grant ``account``."""
    roles = {r["metadata"]["name"]: r for r in kinds.get("Role", [])}
    out = set()
    for b in kinds.get("RoleBinding", []):
        if {"kind": "ServiceAccount", "name": account} in b["subjects"]:
            for rule in roles[b["roleRef"]["name"]]["rules"]:
                out |= {(v, r) for v in rule["verbs"] for r in rule["resources"]}
    return out


def kubectl_needs(script):
    """(verb, resource) each kubectl call of a launch script needs from the API server."""
    need = set()
    for sub in re.findall(r"\bkubectl\s+(\w+)", script):
        need |= {"get": {("get", "pods")},
                 "exec": {("get", "pods"), ("create", "pods/exec")}}[sub]
    return need


def test_only_the_leader_may_read_and_exec_into_pods(tmp_path):
    kinds = lws_docs(tmp_path)
    lws = kinds["LeaderWorkerSet"][0]["spec"]["leaderWorkerTemplate"]
    leader, worker = lws["leaderTemplate"]["spec"], lws["workerTemplate"]["spec"]
    assert leader["serviceAccountName"] != worker["serviceAccountName"]
    assert leader["automountServiceAccountToken"] is True
    assert worker["automountServiceAccountToken"] is False
    scripts = kinds["ConfigMap"][0]["data"]
    need = kubectl_needs(scripts["leader.sh"]) | kubectl_needs(scripts["kubessh"])
    assert need == {("get", "pods"), ("create", "pods/exec")}
    # exactly what the scripts use: no listing, no other verb or resource
    assert allowed(kinds, leader["serviceAccountName"]) == need
    assert allowed(kinds, worker["serviceAccountName"]) == set()
    accounts = {a["metadata"]["name"]: a for a in kinds["ServiceAccount"]}
    assert accounts[worker["serviceAccountName"]]["automountServiceAccountToken"] is False


def test_one_node_pods_have_no_api_token(tmp_path):
    _, out = render(tmp_path, "cpu", tp=1)
    kinds = by_kind(kustomize(out / "k8s"))
    assert "Role" not in kinds and "ServiceAccount" not in kinds
    (spec,) = [t["spec"] for t in pod_templates(kinds["Deployment"])]
    assert spec["automountServiceAccountToken"] is False


def test_cpu_rank_group_pods_have_no_api_token(tmp_path):
    """The cpu target's LeaderWorkerSet (one rank per pod) needs no kubessh: no account, no
    rights, no token in either pod."""
    _, out = render(tmp_path, "cpu", tp=2)
    kinds = by_kind(kustomize(out / "k8s"))
    assert "LeaderWorkerSet" in kinds
    assert "Role" not in kinds and "ServiceAccount" not in kinds
    specs = [t["spec"] for t in pod_templates(kinds["LeaderWorkerSet"])]
    assert len(specs) == 2
    assert all(s["automountServiceAccountToken"] is False and "serviceAccountName" not in s
               for s in specs)


@pytest.mark.parametrize("target", ["cpu", "trtllm-engine", "trtllm-pytorch"])
def test_root_filesystem_is_read_only_with_writable_volumes(tmp_path, target):
    cfg, out = render(tmp_path, target)
    docs = kustomize(out / "k8s")
    for tmpl in pod_templates(docs):
        spec = tmpl["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (c,) = spec["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        writable = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]
                    if not m.get("readOnly") and "configMap" not in volumes[m["name"]]}
        assert sorted(writable) == ["/dev/shm", "/tmp"]
        assert writable["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert writable["/tmp"]["emptyDir"]["sizeLimit"].endswith("Mi")
        workdir = [m for m in c["volumeMounts"] if m["name"] == "workdir"][0]
        assert workdir == {"name": "workdir", "mountPath": str(cfg.workdir), "readOnly": True}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HOME"] == "/tmp" and env["TMPDIR"] == "/tmp"
    for d in docs:
        assert k8s_errors(d, "1.37") == []
