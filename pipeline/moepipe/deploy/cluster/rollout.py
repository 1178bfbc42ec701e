"""Blue/green on Kubernetes: a new release serves only after it was validated beside the old.

Why not in place. Triton reloads a model only by unloading it first (its model-management guide,
``docs/user_guide/model_management.md``, since server PR #8562), the ``llmapi`` model has no
weight-update hook, and TensorRT-LLM's PyTorch backend updates weights only through its Ray
orchestrator (``update_weights`` over ``_collective_rpc``, refused for load-balanced MoE). So a
GPU deployment changes version as a second workload beside the first (the cpu target's local
server updates in place: :mod:`moepipe.commands.update`).

``k8s/rollout.sh`` (rendered here; ``moepipe deploy --rollout`` runs it) goes:

1. apply ``k8s/release`` (release ``R``'s workload ``<app>-<R[:8]>``, its Service and launch
   ConfigMap) beside the serving release, as many replicas as that one has now (the
   autoscaler's count: capacity does not drop at the switch);
2. wait until every replica is ready (``.status.readyReplicas``; a LeaderWorkerSet counts whole
   groups, kubernetes-sigs/lws ``api/leaderworkerset/v1/leaderworkerset_types.go``);
3. run the validate Job (``moepipe validate``, the gate jobs of :data:`GATE_JOBS` that the
   config runs, against the new release's own Service); a Job that does not complete stops the
   rollout: the serving release keeps every request;
4. switch: apply the stable Service ``<app>`` (its selector now names ``R``; a Service's
   selector may change, a workload's may not) and the autoscaler (now on the new workload);
5. wait ``MOEPIPE_DRAIN_S`` (default :data:`DRAIN_S`: the endpoints move, requests admitted
   before finish), then scale each older release down one pod at a time, each step only while
   the PodDisruptionBudget allows a disruption (scaling is not an eviction, so the budget would
   not stop it by itself) and after the last pod is gone (Triton finishes its requests within
   ``deploy.exit_timeout_s`` of SIGTERM), then delete that release's objects.

Going back is the same script of the previous release: ``<deploy>/releases/<R>/k8s/rollout.sh``
(the newest releases' folders are kept, :data:`moepipe.deploy.serve_paths.KEEP_RELEASES`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from moepipe import __version__
from moepipe.deploy.cluster import pod_security
from moepipe.deploy.cluster.labels import RELEASE_LABEL, labels, meta
from moepipe.deploy.serve_paths import ServePaths
from moepipe.targets import get_target

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig
    from moepipe.deploy.cluster.k8s import PodPlan, Shape

SCRIPT = "rollout.sh"
VALIDATE_JOB_FILE = "rollout/validate-job.yaml"
VALIDATE = "validate"  # the Job's component label
# What must pass before traffic moves (those the config runs; smoke at least), as a live update.
GATE_JOBS = ("smoke", "accuracy")
CONFIG_MOUNT = "/etc/moepipe"
JOB_WORKDIR = "/tmp/moepipe-validate"  # reports: on the Job's writable /tmp
DRAIN_S = 15


def validate_image(cfg: MoepipeConfig) -> str:
    """The Job runs moepipe: the target's image where that is moepipe's, else moepipe's image
    (``docker/Dockerfile``; NVIDIA's Triton image has no moepipe)."""
    if get_target(cfg.target).image == "moepipe" and cfg.deploy.k8s.image:
        return cfg.deploy.k8s.image
    return f"moepipe-trtllm:{__version__}"


def validate_config(cfg: MoepipeConfig, plan: PodPlan, model_dir: Path | None) -> dict[str, Any]:
    """The moepipe config the validate Job runs: the deployment's, pointed at the new
    release's Service, its reference model where the pods see the workdir, reports on /tmp."""
    data = cfg.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
    paths = ServePaths.of(cfg)
    if model_dir is not None:  # the built source model, on the workdir's volume
        model = {k: v for k, v in data["model"].items() if k not in ("example", "path")}
        data["model"] = {**model, "path": paths.absolute(model_dir, "the source model")}
    data["workdir"] = JOB_WORKDIR
    deploy = data.get("deploy", {})
    for key in ("output", "fallback", "serve_root"):  # paths of the build machine
        deploy.pop(key, None)
    deploy.get("trtllm", {}).pop("expert_placement", None)
    v = data.setdefault("validate", {})
    gates = [j for j in v.get("jobs", GATE_JOBS) if j in GATE_JOBS]
    host = plan.workload
    v.update(jobs=gates or ["smoke"], url=f"{host}:{plan.ports['http']}",
             grpc_url=f"{host}:{plan.ports['grpc']}",
             metrics_url=f"{host}:{plan.ports['metrics']}")
    return data


def validate_objects(cfg: MoepipeConfig, plan: PodPlan,
                     model_dir: Path | None) -> list[dict[str, Any]]:
    """The validate Job of the release and the ConfigMap holding its config."""
    app, rel = plan.name, plan.release
    name = f"{plan.workload}-validate"
    config = yaml.safe_dump(validate_config(cfg, plan, model_dir), sort_keys=False)
    tmp_volume, tmp_mount = pod_security.tmp_volume()
    timeout = int(cfg.validation.timeout_s)
    container = {
        "name": VALIDATE, "image": validate_image(cfg), "imagePullPolicy": "IfNotPresent",
        "command": ["moepipe", "validate", "-c", f"{CONFIG_MOUNT}/moepipe.yaml"],
        "env": [*pod_security.ENV, {"name": "HF_HUB_OFFLINE", "value": "1"}],
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
        "securityContext": pod_security.container_security(),
        "volumeMounts": [tmp_mount,
                         {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                         {"name": "workdir", "mountPath": plan.serve_root, "readOnly": True}],
    }
    spec = {
        "securityContext": pod_security.pod_security(), "restartPolicy": "Never",
        "automountServiceAccountToken": False, "containers": [container],
        "volumes": [tmp_volume,
                    {"name": "config", "configMap": {"name": name}},
                    {"name": "workdir", "persistentVolumeClaim": {
                        "claimName": plan.volume_claim, "readOnly": True}}],
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(name, app, VALIDATE, rel),
         "data": {"moepipe.yaml": config}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta(name, app, VALIDATE, rel),
         "spec": {
             "backoffLimit": 0,  # a failed check is an answer, not a flake to retry
             # bounded: every case of every job has its own timeout; this bounds them all
             "activeDeadlineSeconds": max(600, 20 * timeout),
             "ttlSecondsAfterFinished": 86400,
             # its pod: no release label (no Service or budget of the release selects it;
             # deleting the Job by its labels removes it)
             "template": {"metadata": {"labels": labels(app, VALIDATE)}, "spec": spec}}},
    ]


ROLLOUT = r"""#!/bin/sh
# Blue/green rollout of the moepipe deployment __APP__ to release __RELEASE__, rendered by
# `moepipe deploy` (`moepipe deploy --rollout` runs it; moepipe.deploy.cluster.rollout):
#   1. apply release __RELEASE__ (k8s/release: __KIND__ __NAME__ and its Service) beside the
#      serving release, with as many replicas as that one has now;
#   2. wait until all of them are ready (up to __READY_S__ s);
#   3. run the validate Job (moepipe validate) against __NAME__; if it fails, stop here: the
#      serving release keeps every request;
#   4. switch: the Service __APP__ selects release __RELEASE__, the autoscaler follows it;
#   5. after MOEPIPE_DRAIN_S (default __DRAIN_S__) seconds, scale each older release down one pod at
#      a time while the PodDisruptionBudget allows it, each pod finishing its requests, then
#      delete that release.
# The cluster: the current kubectl context (KUBECTL names another kubectl); MOEPIPE_POLL_S: the
# seconds between two checks of a wait (default 5).
set -eu
cd "$(dirname "$0")"
KUBECTL=$(printenv KUBECTL || echo kubectl)
DRAIN_S=$(printenv MOEPIPE_DRAIN_S || echo __DRAIN_S__)
POLL_S=$(printenv MOEPIPE_POLL_S || echo 5)
NAMESPACE='__NAMESPACE__'
APP='__APP__'
RELEASE='__RELEASE__'
KIND='__KIND__'
NAME='__NAME__'
RELEASE_LABEL='__RELEASE_LABEL__'
SEL="app.kubernetes.io/instance=$APP,app.kubernetes.io/component=server"

k() {
    if [ -n "$NAMESPACE" ]; then "$KUBECTL" --namespace "$NAMESPACE" "$@"; else "$KUBECTL" "$@"; fi
}
say() { echo "rollout: $*" >&2; }
fail() {
    echo "rollout: error: $*" >&2
    exit 1
}
# Wait POLL_S more, at most $1 s in all (counted in $waited), else fail saying the rest.
tick() {
    limit=$1
    shift
    if [ "$POLL_S" -ge 1 ]; then waited=$((waited + POLL_S)); else waited=$((waited + 1)); fi
    if [ "$waited" -gt "$limit" ]; then fail "$@"; fi
    sleep "$POLL_S"
}

# The other releases' workloads: "kind/name replicas release" per line (the release is empty
# for a workload rendered before releases had their own).
LWS=leaderworkersets.leaderworkerset.x-k8s.io
ROW='{.metadata.name} {.spec.replicas} {.metadata.labels.moepipe\.dev/release}{"\n"}{end}'
others() {
    k get deployments.apps -l "$SEL" -o "jsonpath={range .items[*]}deployment/$ROW"
    k get "$LWS" -l "$SEL" -o "jsonpath={range .items[*]}leaderworkerset/$ROW" 2>/dev/null ||
        true
}

say "1/5 apply release $RELEASE: $KIND/$NAME"
if [ -f rbac.yaml ]; then k apply -f rbac.yaml; fi
k apply -k release
old=$(others | awk -v r="$RELEASE" 'NF && $3 != r')
serving=$(echo "$old" | awk 'NF {n += $2} END {print n + 0}')
replicas=$(k get "$KIND/$NAME" -o 'jsonpath={.spec.replicas}')
if [ "$serving" -gt "$replicas" ]; then
    k scale "$KIND/$NAME" --replicas="$serving"
    replicas=$serving
fi

say "2/5 wait for $replicas ready replica(s) of $NAME"
k wait "$KIND/$NAME" --for="jsonpath={.status.readyReplicas}=$replicas" \
    --timeout=__READY_S__s ||
    fail "$NAME is not ready after __READY_S__ s (kubectl describe $KIND/$NAME);" \
        "the serving release keeps its traffic"

JOB="$NAME-validate"
say "3/5 validate release $RELEASE: job $JOB"
k delete job "$JOB" --ignore-not-found
k apply -f __VALIDATE_FILE__
DONE='{.status.conditions[?(@.type=="Complete")].status}'
FAILED='{.status.conditions[?(@.type=="Failed")].status}'
MINE="app.kubernetes.io/instance=$APP,$RELEASE_LABEL=$RELEASE"
waited=0
while :; do
    state=$(k get job "$JOB" -o "jsonpath=$DONE/$FAILED")
    case "$state" in
        True/*) break ;;
        */True)
            k logs "job/$JOB" --tail=40 >&2 || true
            fail "the validate job $JOB failed: release $RELEASE gets no traffic" \
                "(remove it: kubectl delete deployments,$LWS,services,configmaps,jobs -l $MINE)"
            ;;
    esac
    tick __VALIDATE_S__ "the validate job $JOB did not finish within __VALIDATE_S__ s"
done

say "4/5 switch: Service $APP -> release $RELEASE"
k apply -f service.yaml -f hpa.yaml -f pdb.yaml

if [ -z "$old" ]; then
    say "done: release $RELEASE serves"
    exit 0
fi
# disruptions the budget allows now (1 where there is no budget)
allowed() {
    k get pdb "$APP" -o 'jsonpath={.status.disruptionsAllowed}' 2>/dev/null || echo 1
}
say "5/5 drain: $DRAIN_S s for requests in flight, then the older releases go one pod at a time"
sleep "$DRAIN_S"
echo "$old" | while read -r obj n rel; do
    while [ "$n" -gt 0 ]; do
        waited=0
        until [ "$(allowed)" -ge 1 ]; do
            tick __READY_S__ "the PodDisruptionBudget $APP allows no disruption for" \
                "__READY_S__ s: $obj stays at $n"
        done
        n=$((n - 1))
        k scale "$obj" --replicas="$n"
        if [ -n "$rel" ]; then pods="$SEL,$RELEASE_LABEL=$rel"; else pods=""; fi
        waited=0
        while [ -n "$pods" ] && [ "$(k get pods -l "$pods" -o name | wc -l)" -gt "$n" ]; do
            tick __EXIT_S__ "a pod of $obj is still there after __EXIT_S__ s"
        done
        say "  $obj: $n replica(s)"
    done
    if [ -n "$rel" ]; then
        theirs="app.kubernetes.io/instance=$APP,$RELEASE_LABEL=$rel"
        k delete deployments.apps,services,configmaps,jobs -l "$theirs" --ignore-not-found
        k delete "$LWS" -l "$theirs" --ignore-not-found 2>/dev/null || true
    else
        k delete "$obj" --ignore-not-found
    fi
    say "  $obj: removed"
done
say "done: release $RELEASE serves"
"""


def script(cfg: MoepipeConfig, plan: PodPlan, shape: Shape) -> str:
    """``k8s/rollout.sh`` of release ``plan.release``."""
    values = {
        "__APP__": plan.name, "__RELEASE__": plan.release, "__NAME__": plan.workload,
        "__KIND__": "leaderworkerset" if shape.multi_node else "deployment",
        "__NAMESPACE__": cfg.deploy.k8s.namespace or "",
        "__READY_S__": str(plan.startup_s), "__EXIT_S__": str(plan.exit_timeout_s + 30),
        "__VALIDATE_S__": str(max(600, 20 * int(cfg.validation.timeout_s)) + 60),
        "__DRAIN_S__": str(DRAIN_S), "__VALIDATE_FILE__": VALIDATE_JOB_FILE,
        "__RELEASE_LABEL__": RELEASE_LABEL,
    }
    text = ROLLOUT
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def write(out: Path, cfg: MoepipeConfig, plan: PodPlan, shape: Shape, *,
          model_dir: Path | None) -> list[Path]:
    """``out/rollout.sh`` and ``out/rollout/validate-job.yaml`` (``out``: the k8s folder)."""
    from moepipe.deploy.cluster.k8s import dump_all

    job = out / VALIDATE_JOB_FILE
    job.parent.mkdir()
    job.write_text(dump_all(validate_objects(cfg, plan, model_dir)))
    path = out / SCRIPT
    path.write_text(script(cfg, plan, shape))
    path.chmod(0o755)
    return [job, path]

