"""The cpu pod serves with a read-only root filesystem (issue 26, item 10).

The Deployment's own container command and environment run the real tritonserver in a private
mount namespace laid out as the pod's: every filesystem read-only (the image's root and the
read-only workdir claim), and a fresh tmpfs at each emptyDir mount the pod declares
(/dev/shm, /tmp). The server must become ready and answer a generate request; what it wrote
is listed from /proc/PID/root (the namespace's view). Needs root for the mount namespace
(skipped visibly otherwise); the server binds 127.0.0.1 instead of the pod's 0.0.0.0.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers import free_ports

# The namespace's layout, then exec the pod's command. $KEEP: paths that stay visible
# (read-only) under the fresh /tmp; $TMPFS: the pod's emptyDir mount paths.
LAYOUT = r"""
set -eu
mount -t tmpfs -o size=16m tmpfs /mnt
i=0
for p in $KEEP; do mkdir "/mnt/$i"; mount --bind "$p" "/mnt/$i"; i=$((i + 1)); done
for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
    case "$m" in /proc*|/sys*|/dev|/dev/*|/mnt|/mnt/*) continue ;; esac
    mount -o remount,bind,ro "$m" 2>/dev/null || true
done
for t in $TMPFS; do mount -t tmpfs -o size=4g,mode=1777 tmpfs "$t"; done
i=0
for p in $KEEP; do
    mkdir -p "$p" 2>/dev/null || true
    mount --bind "/mnt/$i" "$p"
    mount -o remount,bind,ro "$p"
    i=$((i + 1))
done
exec "$@"
"""


def can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not can_unshare(), reason="needs root and unshare for a mount namespace")
def test_cpu_pod_serves_with_a_read_only_root(tmp_path):
    from helpers import make_config

    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import artifacts
    from moepipe.deploy.cluster.operate import render_operations
    from moepipe.deploy.local.binary import find_tritonserver, server_env
    from moepipe.deploy.render.repository import render_deployment
    from moepipe.validate.client import generate

    # world size 1: one pod, a Deployment (a rank group is a LeaderWorkerSet: test_rank_hosts)
    cfg = make_config(tmp_path / "w", parallel={"tp": 1, "moe_ep": 1})
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    art = artifacts(cfg)
    render_deployment(cfg, art)
    http, grpc, metrics = free_ports(3)
    pod_cfg = cfg.model_copy(deep=True)
    pod_cfg.deploy = pod_cfg.deploy.model_copy(update={
        "http_port": http, "grpc_port": grpc, "metrics_port": metrics})
    out = tmp_path / "rendered"
    out.mkdir()
    render_operations(pod_cfg, out, version=art.version)  # the release rendered above
    (dep,) = yaml.safe_load_all((out / "k8s" / "release" / "deployment.yaml").read_text())
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    tmpfs = [m["mountPath"] for m in c["volumeMounts"] if "emptyDir" in volumes[m["name"]]]
    keep = [m["mountPath"] for m in c["volumeMounts"]
            if "persistentVolumeClaim" in volumes[m["name"]]]
    assert sorted(tmpfs) == ["/dev/shm", "/tmp"] and keep == [str(cfg.workdir)]

    # This machine's tritonserver stands in for the image's (pytriton's needs its backend
    # folder); the pod's 0.0.0.0 becomes loopback.
    binary = find_tritonserver(None, tmp_path / "server")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "tritonserver").symlink_to(binary.path)
    command = [a.replace("=0.0.0.0", "=127.0.0.1") for a in c["command"]]
    if binary.backend_dir is not None:
        command.append(f"--backend-directory={binary.backend_dir}")
        keep.append(str(tmp_path))
    venv = Path(sys.prefix).resolve()  # the server and Python: hidden by /tmp's tmpfs when the
    if any(venv.is_relative_to(t) for t in tmpfs):  # checkout itself lives under /tmp
        keep.append(str(venv))
    env = server_env()
    env.update({e["name"]: e["value"] for e in c["env"]})
    env.update(PATH=f"{bindir}:{env['PATH']}", KEEP=" ".join(keep), TMPFS=" ".join(tmpfs))
    log = open(tmp_path / "pod.log", "wb")
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "/bin/sh", "-c",
                             LAYOUT, "layout", *command], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "pod.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready",
                                            timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "pod.log").read_text()[-3000:]
            time.sleep(1)
        answer = generate(f"127.0.0.1:{http}", "ensemble",
                          {"text_input": "The quick brown fox", "max_tokens": 4}, timeout=60)
        assert answer["text_output"]
        root = Path(f"/proc/{proc.pid}/root")
        written = sorted(p.name for p in (root / "tmp").iterdir())
        # the Python backend's environment folder (src/pb_env.cc), on the writable /tmp
        assert any(n.startswith("python_env_") for n in written), written
        assert any(n.startswith("triton_python_backend_shm_region")
                   for n in os.listdir(root / "dev" / "shm"))
        # nothing could be written anywhere else: the workdir is read-only in there
        probe = root / str(cfg.workdir).lstrip("/") / "probe"
        with pytest.raises(OSError, match="Read-only file system"):
            probe.write_text("x")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
