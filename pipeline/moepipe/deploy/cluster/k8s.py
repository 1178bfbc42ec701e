"""Kubernetes objects for a rendered deployment: ``<deploy>/k8s/`` as a kustomize folder.

One node (world size <= ``deploy.k8s.gpus_per_node``; the cpu target at world size 1): a
Deployment and a Service. More nodes (trtllm-engine: its MPI ranks span nodes): a
LeaderWorkerSet whose groups are one leader + ``nodes - 1`` workers, a headless Service for the
group's DNS names, a ClusterIP Service on the leaders, and the RBAC + ``kubessh`` agent through
which the leader's ``mpirun`` starts the ranks of the workers (the pattern of LWS's TensorRT-LLM
example, kubernetes-sigs/lws docs/examples/tensorrt-llm). The cpu target at world size > 1 is
a LeaderWorkerSet too, one rank per pod, no MPI and no API access: the leader pod's
tritonserver holds rank 0 (listening for the others on ``deploy.rank_port``), each worker pod
runs its rank (``LWS_WORKER_INDEX``) in a loop that starts it again when it exits, so a lost
rank is replaced in seconds while the leader keeps serving (``restartPolicy: None``:
recreating the group would restart the server too). Both shapes get probes on Triton's
``/v2/health/{live,ready}``, ``nvidia.com/gpu`` requests on GPU targets, the accounts, rights,
non-root read-only-root security context and writable volumes of
:mod:`moepipe.deploy.cluster.pod_security`, a HorizontalPodAutoscaler on a custom metric (served
by prometheus-adapter, whose rule ``monitoring/prometheus-adapter.yaml`` holds) and a
PodDisruptionBudget.

Each release (the build a workload serves) is its own workload ``<app>-<release[:8]>`` in
``k8s/release/`` (with its launch ConfigMap, its own Service for the validate Job, and the
group's headless Service), reading its own repository ``<deploy>/releases/<release>``; the
stable objects in ``k8s/`` (the Service ``<app>`` selecting the serving release, the autoscaler
on its workload, the budget over every release's serving pods, the rights) carry over from one
release to the next. ``kubectl apply -k k8s`` installs a release at once; ``k8s/rollout.sh``
replaces a running one blue/green (:mod:`moepipe.deploy.cluster.rollout`).

The PersistentVolumeClaim ``deploy.k8s.volume_claim`` holds the workdir and is mounted,
read-only, at ``deploy.serve_root`` (default: the workdir's own path): the Python models find
their files relative to the repository, and what a backend reads by absolute path (the engine)
was rendered under that root (:mod:`moepipe.deploy.serve_paths`).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moepipe.config import DNS1123_LABEL
from moepipe.deploy.cluster import pod_security
from moepipe.deploy.cluster.labels import (
    COMPONENT_LABEL,
    INSTANCE_LABEL,
    MONITORING,
    SERVER,
    WORKER,
    labels,
    meta,
    selector,
)
from moepipe.deploy.tritonserver import RAISE_STACK, ServerCommand
from moepipe.errors import ConfigError
from moepipe.targets import get_target, targets_where

# Where a pod's TensorRT-LLM writes its expert statistics (an emptyDir: the workdir is mounted
# read-only); `kubectl cp` copies the folder out for `moepipe balance --counts`, or `moepipe
# balance --metrics` reads the counts the pod exports.
EXPERT_STATISTIC_DIR = "/var/lib/moepipe/expert-statistic"
LWS_API = "leaderworkerset.x-k8s.io/v1"
# Triton's ports, by name: the Service, probes and scrape configs refer to these names.
PORT_NAMES = ("http", "grpc", "metrics")
# Python-backend shared memory per Python model instance (its region starts at 1 MiB and grows
# in 1 MiB steps with the tensors in flight; python_backend README "Managing Shared Memory").
SHM_PER_PYTHON_INSTANCE_MIB = 64
SHM_MIN_MIB = 1024
# The release's own objects: a kustomize folder inside k8s/ (the rollout applies it first).
RELEASE_DIR = "release"
RELEASE_CHARS = 8  # of the release (12 hex digits) in object names: <app>-<8> stays within 49


def release_name(app: str, release: str) -> str:
    """The name of release ``release``'s workload and Service: ``<app>-<release[:8]>``
    (a LeaderWorkerSet's worker StatefulSets add ``-<group>``, and their revision label
    11 more characters, within Kubernetes' 63)."""
    return f"{app}-{release[:RELEASE_CHARS]}"


@dataclass(frozen=True)
class Shape:
    """How the world size lands on nodes."""

    world_size: int
    nodes: int
    gpus_per_pod: int  # 0 on the cpu target

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


def shape(target: str, world_size: int, gpus_per_node: int) -> Shape:
    """Nodes and GPUs per pod: a CPU target's rank group is one rank per pod (moepipe.ranks,
    no GPUs); a GPU target spreads over whole nodes only when its ranks may span nodes
    (``Target.multi_node``)."""
    t = get_target(target)
    if not t.gpu:
        return Shape(world_size, world_size, 0)
    if world_size <= gpus_per_node:
        return Shape(world_size, 1, world_size)
    if not t.multi_node:
        able = targets_where(lambda o: o.multi_node and o.gpu)
        raise ConfigError(f"world size {world_size} needs more than one node of "
                          f"{gpus_per_node} GPUs, which only the {' or '.join(able)} target "
                          "spans",
                          f"use target: {' or '.join(able)}, or raise deploy.k8s.gpus_per_node")
    if world_size % gpus_per_node:
        raise ConfigError(f"world size {world_size} is not a multiple of "
                          f"deploy.k8s.gpus_per_node ({gpus_per_node})",
                          "every node runs the same number of ranks: choose tp x pp as a "
                          "multiple of the GPUs per node")
    return Shape(world_size, world_size // gpus_per_node, gpus_per_node)


def check_name(name: str, what: str) -> str:
    if len(name) > 40 or not DNS1123_LABEL.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is not a Kubernetes name",
                          "lower-case letters, digits and '-', at most 40 characters")
    return name


def shm_mib(python_instances: int) -> int:
    return max(SHM_MIN_MIB, SHM_PER_PYTHON_INSTANCE_MIB * python_instances)


@dataclass(frozen=True)
class PodPlan:
    """Everything a pod template needs, computed once from the config."""

    name: str
    release: str  # the build version the pods serve (their repository's)
    image: str
    target: str
    serve_root: str  # where the workdir's volume is mounted (deploy.serve_root)
    server: ServerCommand  # bound to all of the pod's addresses
    ports: dict[str, int]
    gpus: int
    cpu: str
    memory_mib: int
    shm_mib: int
    volume_claim: str
    startup_s: int
    exit_timeout_s: int
    rank_port: int = 0  # cpu target: where rank 0 listens for the other ranks
    env: tuple[tuple[str, str], ...] = ()  # the server's environment (its ranks inherit it)
    scratch: tuple[str, ...] = ()  # writable folders (emptyDir): the workdir is read-only

    @property
    def workload(self) -> str:
        """The release's workload (Deployment or LeaderWorkerSet) and its own Service."""
        return release_name(self.name, self.release)


def _mi(mib: int) -> str:
    """A Kubernetes quantity of ``mib`` mebibytes."""
    return f"{mib}Mi"


def serve_command(args: list[str]) -> list[str]:
    """A container command that raises the stack limit, then becomes ``tritonserver args``
    (``exec``: it is still the process the kubelet signals). Triton's HTTP frontend parses a
    form-encoded body into stack arrays of its size (moepipe.deploy.tritonserver
    SERVER_STACK_BYTES): with a container's usual 8 MiB stacks a ~5 MB body would kill it."""
    return ["/bin/sh", "-c", f'{RAISE_STACK}; exec tritonserver "$@"', "tritonserver", *args]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def container(plan: PodPlan, name: str, command: list[str], *, serving: bool) -> dict[str, Any]:
    """The Triton container; ``serving`` containers get ports and probes (LWS workers don't:
    their ranks open no ports)."""
    limits: dict[str, Any] = {"memory": _mi(plan.memory_mib)}
    requests: dict[str, Any] = {"cpu": plan.cpu, "memory": _mi(plan.memory_mib)}
    if plan.gpus:
        limits["nvidia.com/gpu"] = plan.gpus
        requests["nvidia.com/gpu"] = plan.gpus
    c: dict[str, Any] = {
        "name": name, "image": plan.image, "imagePullPolicy": "IfNotPresent",
        "command": command,
        "resources": {"limits": limits, "requests": requests},
        "securityContext": pod_security.container_security(),
        "env": list(pod_security.ENV),
        "volumeMounts": [*(m for _, m in pod_security.writable_volumes(plan.shm_mib)),
                         {"name": "workdir", "mountPath": plan.serve_root,
                          "readOnly": True}],
    }
    c["env"] += [{"name": k, "value": v} for k, v in plan.env]
    c["volumeMounts"] += [{"name": f"scratch-{i}", "mountPath": path}
                          for i, path in enumerate(plan.scratch)]
    if serving:
        c["ports"] = [{"name": n, "containerPort": plan.ports[n], "protocol": "TCP"}
                      for n in PORT_NAMES]
        # startup: up to startup_s for the models to load; then liveness restarts a hung
        # server and readiness takes a pod out of the Service while it cannot serve.
        c["startupProbe"] = _probe("/v2/health/ready", 10, max(1, math.ceil(plan.startup_s / 10)))
        c["livenessProbe"] = _probe("/v2/health/live", 10, 3)
        c["readinessProbe"] = _probe("/v2/health/ready", 5, 3)
    return c


def pod_spec(plan: PodPlan, containers: list[dict], service_account: str | None = None,
             api_access: bool = False) -> dict[str, Any]:
    """A pod of ``containers``; only a pod with ``api_access`` (a group's leader) gets a
    service-account token mounted (moepipe.deploy.cluster.pod_security)."""
    spec: dict[str, Any] = {
        "securityContext": pod_security.pod_security(),
        # Triton drains in-flight requests for exit_timeout_s after SIGTERM.
        "terminationGracePeriodSeconds": plan.exit_timeout_s + 15,
        "containers": containers,
        "volumes": [
            *(v for v, _ in pod_security.writable_volumes(plan.shm_mib)),
            {"name": "workdir", "persistentVolumeClaim": {"claimName": plan.volume_claim,
                                                          "readOnly": True}},
            *({"name": f"scratch-{i}", "emptyDir": {}} for i in range(len(plan.scratch))),
        ],
        "automountServiceAccountToken": api_access,
    }
    if plan.gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                                "effect": "NoSchedule"}]
    if service_account:
        spec["serviceAccountName"] = service_account
    return spec


def dump_all(docs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def deployment(plan: PodPlan, replicas: int) -> dict[str, Any]:
    app, rel = plan.name, plan.release
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": meta(plan.workload, app, SERVER, rel),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(app, SERVER, rel)},
            # A new pod must be ready before an old one goes: capacity never drops.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels(app, SERVER, rel)},
                "spec": pod_spec(plan, [container(plan, "triton",
                                                  serve_command(plan.server.args()),
                                                  serving=True)]),
            },
        },
    }


def service(plan: PodPlan, *, selector: dict[str, str], headless: bool = False,
            name: str | None = None, release: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": selector,
        "ports": [{"name": n, "port": plan.ports[n], "targetPort": n, "protocol": "TCP"}
                  for n in PORT_NAMES],
    }
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = True  # ranks find each other before ready
    else:
        spec["type"] = "ClusterIP"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": meta(name or plan.name, plan.name, SERVER, release), "spec": spec}


def hpa(plan: PodPlan, kind: str, api_version: str, min_replicas: int, max_replicas: int,
        metric: str, target: str) -> dict[str, Any]:
    """Scale on a per-pod custom metric that prometheus-adapter serves (custom.metrics.k8s.io).
    For a LeaderWorkerSet, a replica is a whole group and the metric is read on its pods
    (LWS's scale subresource publishes ``status.hpaPodSelector``: the leaders)."""
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": meta(plan.name, plan.name),
        "spec": {
            # the serving release's workload: the rollout moves it with the Service
            "scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": plan.workload},
            "minReplicas": min_replicas, "maxReplicas": max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": metric},
                "target": {"type": "AverageValue", "averageValue": target}}}],
            # A model takes minutes to load: scale up promptly, scale down slowly.
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600,
                                       "policies": [{"type": "Pods", "value": 1,
                                                     "periodSeconds": 300}]}},
        },
    }


def pdb(plan: PodPlan, selector: dict[str, str]) -> dict[str, Any]:
    """At most one of the serving pods (servers and group workers, of every release) down at a
    time. Not the validate Job's pods: a budget with ``maxUnavailable`` must select only pods
    of scalable controllers, or the disruption controller allows no eviction at all
    (Kubernetes docs, "Specifying a Disruption Budget for your Application", arbitrary
    controllers)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(plan.name, plan.name),
            "spec": {"maxUnavailable": 1, "selector": {
                "matchLabels": selector,
                "matchExpressions": [{"key": COMPONENT_LABEL, "operator": "In",
                                      "values": [SERVER, WORKER]}]}}}


KUBESSH = """#!/bin/sh
# mpirun's remote-shell agent inside a LeaderWorkerSet group: runs the command in the named
# pod's triton container through the API server (`kubectl exec`), so no sshd is needed.
# Usage (by mpirun): kubessh POD COMMAND...
set -eu
pod="$1"
shift
exec kubectl exec "$pod" -c triton -- /bin/sh -c "$*"
"""

LEADER = """#!/bin/sh
# Leader of a moepipe LeaderWorkerSet group: waits until the group's worker pods run, then
# starts the engine's __WORLD__ MPI ranks, __PER_NODE__ per pod, with mpirun over kubessh. Rank 0
# (this pod) serves HTTP, gRPC and metrics; the other ranks only load tensorrt_llm.
set -eu
SIZE="${LWS_GROUP_SIZE:?LWS_GROUP_SIZE unset: run by a LeaderWorkerSet}"
ME="${POD_NAME:?POD_NAME unset}"
hosts="$ME:__PER_NODE__"
i=1
while [ "$i" -lt "$SIZE" ]; do
    worker="$ME-$i"  # LWS names workers <leader pod>-<worker index>
    waited=0
    until [ "$(kubectl get pod "$worker" -o 'jsonpath={.status.phase}' 2>/dev/null)" = Running ]; do
        waited=$((waited + 5))
        if [ "$waited" -gt __WAIT_S__ ]; then
            echo "error: worker pod $worker is not running after __WAIT_S__ s" >&2
            exit 1
        fi
        sleep 5
    done
    hosts="$hosts,$worker:__PER_NODE__"
    i=$((i + 1))
done
__RANKS__
# Rank 0 (this pod) serves HTTP: the larger stack limit (moepipe.deploy.tritonserver.RAISE_STACK;
# `ulimit -S -s` is not POSIX, but dash, bash and busybox sh have it; elsewhere it is skipped).
# shellcheck disable=SC3045
__RAISE_STACK__
echo "leader: __WORLD__ ranks on $hosts" >&2
exec mpirun --allow-run-as-root -mca plm_rsh_agent /opt/moepipe/kubessh \\
    --host "$hosts" -np __WORLD__ "$@"
"""


CPU_LEADER = """#!/bin/sh
# Leader of a moepipe cpu rank group (world size __WORLD__, one rank per pod): rank 0 runs in
# tritonserver's tensorrt_llm model and listens for the worker pods' ranks on every address of
# this pod; Triton is ready once they have joined.
set -eu
export MOEPIPE_RANK_LISTEN="0.0.0.0:__RANK_PORT__"
# shellcheck disable=SC3045
__RAISE_STACK__
exec tritonserver __ARGS__
"""

CPU_WORKER = """#!/bin/sh
# Worker pod of a moepipe cpu rank group: runs rank LWS_WORKER_INDEX, and again whenever it
# exits (rank 0 dissolves the group when it loses any rank; the next group forms from the
# ranks that connect again). SIGTERM stops the rank and the loop.
set -u
# (no shell parameter expansion with braces: nothing moepipe renders keeps a dollar-brace)
for name in LWS_LEADER_ADDRESS LWS_WORKER_INDEX; do
    if [ -z "$(printenv "$name")" ]; then
        echo "$name unset: run by a LeaderWorkerSet" >&2
        exit 1
    fi
done
LEADER=$LWS_LEADER_ADDRESS
RANK=$LWS_WORKER_INDEX
PYTHON=$(printenv MOEPIPE_PYTHON || echo python3)
pid=
trap 'if [ -n "$pid" ]; then kill "$pid" 2>/dev/null; fi; exit 0' TERM INT
while :; do
    "$PYTHON" -m moepipe.ranks.worker --leader "$LEADER:__RANK_PORT__" --rank "$RANK" \\
        --connect-timeout __WAIT_S__ &
    pid=$!
    wait "$pid" || echo "rank $RANK exited ($?); starting it again" >&2
    pid=
    sleep 1
done
"""


def cpu_scripts(plan: PodPlan, shape_: Shape) -> dict[str, str]:
    """leader.sh and worker.sh of a cpu rank group (the launch path of every host; the
    workers load the checkpoint the leader names)."""
    leader = (CPU_LEADER.replace("__WORLD__", str(shape_.world_size))
              .replace("__RANK_PORT__", str(plan.rank_port)).replace("__RAISE_STACK__", RAISE_STACK)
              .replace("__ARGS__", shlex.join(plan.server.args())))
    worker = (CPU_WORKER.replace("__RANK_PORT__", str(plan.rank_port))
              .replace("__WAIT_S__", str(plan.startup_s)))
    return {"leader.sh": leader, "worker.sh": worker}


def leader_script(plan: PodPlan, shape_: Shape) -> str:
    return (LEADER.replace("__RANKS__", plan.server.mpi_ranks("tritonserver", "__WORLD__"))
            .replace("__WORLD__", str(shape_.world_size))
            .replace("__PER_NODE__", str(shape_.gpus_per_pod))
            .replace("__WAIT_S__", str(plan.startup_s))
            .replace("__RAISE_STACK__", RAISE_STACK))


def leader_worker_set(plan: PodPlan, shape_: Shape, replicas: int) -> dict[str, Any]:
    app, rel = plan.name, plan.release
    cpu = not get_target(plan.target).mpi_ranks  # moepipe's rank group, not an MPI job
    scripts = {"name": "scripts", "configMap": {"name": f"{plan.workload}-launch",
                                                "defaultMode": 0o555}}
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]

    def template(role: str, command: list[str], serving: bool) -> dict[str, Any]:
        c = container(plan, "triton", command, serving=serving)
        c["env"] += env
        c["volumeMounts"].append({"name": "scripts", "mountPath": "/opt/moepipe"})
        # only a GPU group's leader talks to the API server (its kubessh agent)
        leader = role == "leader" and not cpu
        account = None if cpu else \
            (pod_security.leader_account if leader else pod_security.worker_account)(app)
        spec = pod_spec(plan, [c], service_account=account, api_access=leader)
        spec["volumes"].append(scripts)
        return {"metadata": {"labels": labels(app, SERVER if role == "leader" else WORKER, rel)},
                "spec": spec}

    # Workers wait; the leader's mpirun starts their ranks in them (GPU), or each runs its
    # own rank (cpu).
    worker = ["/bin/sh", "/opt/moepipe/worker.sh"] if cpu else \
        ["/bin/sh", "-c", "exec sleep infinity"]

    return {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
        "metadata": meta(plan.workload, app, SERVER, rel),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 0,
                                                               "maxSurge": 1}},
            "leaderWorkerTemplate": {
                "size": shape_.nodes,
                # A rank that dies takes the MPI job with it: restart the whole group. A cpu
                # group re-forms around its leader by itself.
                "restartPolicy": "None" if cpu else "RecreateGroupOnPodRestart",
                "leaderTemplate": template("leader", ["/bin/sh", "/opt/moepipe/leader.sh"],
                                           True),
                "workerTemplate": template("worker", worker, False),
            },
        },
    }


def launch_config_map(plan: PodPlan, shape_: Shape) -> dict[str, Any]:
    data = cpu_scripts(plan, shape_) if not get_target(plan.target).mpi_ranks else \
        {"leader.sh": leader_script(plan, shape_), "kubessh": KUBESSH}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": meta(f"{plan.workload}-launch", plan.name, SERVER, plan.release),
            "data": data}


def objects(plan: PodPlan, shape_: Shape, *, min_replicas: int, max_replicas: int,
            metric: str, target: str) -> dict[str, list[dict[str, Any]]]:
    """file name (``release/...``: the release's own) -> the objects it holds."""
    app, rel = plan.name, plan.release
    serving = selector(app, SERVER, rel)  # the release's serving pods (a group's leaders)
    own = service(plan, selector=serving, name=plan.workload, release=rel)
    r = f"{RELEASE_DIR}/"
    if not shape_.multi_node:
        release: dict[str, list[dict[str, Any]]] = {
            r + "deployment.yaml": [deployment(plan, min_replicas)], r + "service.yaml": [own]}
        kind, api = "Deployment", "apps/v1"
    else:
        release = {
            r + "leaderworkerset.yaml": [leader_worker_set(plan, shape_, min_replicas)],
            r + "launch-configmap.yaml": [launch_config_map(plan, shape_)],
            # the headless Service gives every pod of a group a DNS name
            r + "service.yaml": [own, service(plan, selector=selector(app, release=rel),
                                              headless=True, name=f"{plan.workload}-group",
                                              release=rel)],
        }
        kind, api = "LeaderWorkerSet", LWS_API
    return {
        **release,
        **({"rbac.yaml": pod_security.rbac(app, meta)}
           if shape_.multi_node and get_target(plan.target).mpi_ranks else {}),
        # The stable objects: the Service on the serving release (the rollout's switch), the
        # autoscaler on its workload, and the budget over every release's serving pods
        # (evicting any pod of a group restarts the group: at most one pod at a time).
        "service.yaml": [service(plan, selector=serving)],
        "hpa.yaml": [hpa(plan, kind, api, min_replicas, max_replicas, metric, target)],
        "pdb.yaml": [pdb(plan, selector(app))],
    }


def kustomization(files: list[str], namespace: str | None, image: str) -> dict[str, Any]:
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    k: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                         "kind": "Kustomization", "resources": files}
    if namespace:
        k["namespace"] = namespace
    # `kustomize edit set image` / an overlay changes the image here, in one place.
    img: dict[str, str] = {"name": name}
    if tag:
        img["newTag"] = tag
    k["images"] = [img]
    return k


def write(out: Path, plan: PodPlan, shape_: Shape, *, namespace: str | None,
          min_replicas: int, max_replicas: int, metric: str, target: str) -> list[Path]:
    """Write the kustomize folder ``out`` (which must exist and be empty) and its release
    folder ``out/release``."""
    files = objects(plan, shape_, min_replicas=min_replicas, max_replicas=max_replicas,
                    metric=metric, target=target)
    (out / RELEASE_DIR).mkdir()
    written = []
    for fname, docs in files.items():
        (out / fname).write_text(dump_all(docs))
        written.append(out / fname)
    own = sorted(f.split("/", 1)[1] for f in files if f.startswith(f"{RELEASE_DIR}/"))
    top = sorted(f for f in files if "/" not in f)
    for folder, resources in ((out / RELEASE_DIR, own), (out, [RELEASE_DIR, *top])):
        (folder / "kustomization.yaml").write_text(
            yaml.safe_dump(kustomization(resources, namespace, plan.image), sort_keys=False))
        written.append(folder / "kustomization.yaml")
    return written


def write_operator(out: Path, plan: PodPlan, rules: dict[str, Any], job: str) -> list[Path]:
    """``k8s/prometheus-operator`` (created): a PodMonitor on the pods' ``metrics`` port (job label
    ``job``, so the rules' ``up{job=...}`` matches) and the rules as a PrometheusRule."""
    app = plan.name
    docs = {
        "podmonitor.yaml": {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": meta(app, app, MONITORING),
            "spec": {"selector": {"matchLabels": selector(app, SERVER)},
                     "jobLabel": INSTANCE_LABEL,
                     "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics",
                                              "relabelings": [{"targetLabel": "job",
                                                               "replacement": job}]}]}},
        "prometheusrule.yaml": {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": meta(app, app, MONITORING), "spec": rules},
    }
    return write_folder(out, docs)


def write_folder(out: Path, docs: dict[str, dict[str, Any]]) -> list[Path]:
    """A kustomize folder ``out`` (created) of one object per file, ``docs``: file -> object."""
    out.mkdir()
    written = []
    for fname, doc in docs.items():
        (out / fname).write_text(dump_all([doc]))
        written.append(out / fname)
    (out / "kustomization.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
         "resources": sorted(docs)}, sort_keys=False))
    return [*written, out / "kustomization.yaml"]
