"""What a moepipe pod may do: its accounts and their rights, its security context, and the only
places it may write (the root filesystem is read-only).

Rights. Only the leader of a LeaderWorkerSet group talks to the API server: its ``mpirun``
starts the ranks of the workers through ``kubessh`` (``kubectl get pod`` while waiting for
them, then ``kubectl exec``), so its account may ``get`` pods and ``create`` ``pods/exec`` in
the namespace, no more (no listing, no other verbs). Workers, and the pods of a one-node
Deployment, have no use for the API: they run under an account of their own without any Role
and without a mounted token (a worker that could exec into its peers could reach every pod of
the namespace).

Writes. With ``readOnlyRootFilesystem`` a pod writes only to its volumes:

* ``/dev/shm`` (memory): the Python backend's shared-memory regions between tritonserver and
  each model's stub (python_backend README, "Managing Shared Memory"; ``src/shm_manager.cc``),
  and NCCL's / Open MPI's shared-memory transports between ranks;
* ``/tmp`` (disk): the Python backend creates ``/tmp/python_env_XXXXXX`` when it initializes,
  whether or not a model uses a custom execution environment (``src/python_be.cc``
  ``TRITONBACKEND_Initialize`` -> ``src/pb_env.cc`` ``EnvironmentManager``: a hard-coded
  ``mkdtemp("/tmp/python_env_XXXXXX")``; without it no Python model loads); Open MPI's
  session directory (under ``TMPDIR``); and, with ``HOME`` pointed here, the caches tools keep
  under the home directory (kubectl's ``~/.kube/cache``, OpenAI Triton's ``~/.triton``,
  torch's and CUDA's kernel caches). A test runs the cpu pod's own command under a read-only
  root with exactly these volumes (tests/e2e/test_k8s_filesystem.py).

The workdir (the PersistentVolumeClaim) is mounted read-only.
"""

from __future__ import annotations

from typing import Any

UID = 1000  # the Dockerfile's user (NVIDIA's triton-server user in the NGC images)
TMP_MIB = 4096  # /tmp: the Python backend's environment folder, MPI's session, kernel caches

# Environment of every container: the home directory and temporary files on the writable
# volume (the images' HOME is on the read-only root).
ENV = [{"name": "HOME", "value": "/tmp"}, {"name": "TMPDIR", "value": "/tmp"}]


def tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of ``/tmp``: where every container writes its files (``HOME`` too)."""
    return ({"name": "tmp", "emptyDir": {"sizeLimit": f"{TMP_MIB}Mi"}},
            {"name": "tmp", "mountPath": "/tmp"})


def writable_volumes(shm_mib: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, mount) of each place a serving container writes."""
    return [
        ({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_mib}Mi"}},
         {"name": "dshm", "mountPath": "/dev/shm"}),
        tmp_volume(),
    ]


def container_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def leader_account(app: str) -> str:
    return f"{app}-leader"


def worker_account(app: str) -> str:
    return f"{app}-worker"


def rbac(app: str, meta: Any) -> list[dict[str, Any]]:
    """The leader's account and the rights its kubessh agent uses; the workers' account,
    which has none (``meta(name, app)``: the objects' metadata)."""
    leader = leader_account(app)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(leader, app)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": meta(leader, app),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                   {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": meta(leader, app),
         "subjects": [{"kind": "ServiceAccount", "name": leader}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": leader}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": meta(worker_account(app), app), "automountServiceAccountToken": False},
    ]
