"""Ranks on two hosts: rank 0 (with Triton) and rank 1 in two Linux network namespaces joined
by a veth pair, each with its own address, started by the scripts of the rendered Kubernetes
LeaderWorkerSet (the cpu target's leader.sh / worker.sh, with the environment LWS gives its
pods); validate's accuracy job, run inside the leader's namespace against its address, finds
the answers equal to transformers'. Only addresses inside the namespaces are used; the
namespaces (and every process in them) are removed afterwards, also when the test fails."""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import make_config

from moepipe.commands.build import run_build
from moepipe.commands.deploy import artifacts
from moepipe.deploy.local.binary import find_tritonserver, server_env
from moepipe.deploy.render.repository import render_deployment

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                                reason="network namespaces need root and iproute2")


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Namespaces:
    """Two namespaces and a veth pair between them: a gets .1, b gets .2 of 10.211.N.0/24."""

    def __init__(self):
        tag = secrets.token_hex(3)
        self.a, self.b = f"mp-a-{tag}", f"mp-b-{tag}"
        net = 1 + secrets.randbelow(250)
        self.addr_a, self.addr_b = f"10.211.{net}.1", f"10.211.{net}.2"
        _ip("netns", "add", self.a)
        _ip("netns", "add", self.b)
        _ip("link", "add", f"va-{tag}", "type", "veth", "peer", "name", f"vb-{tag}")
        for ns, dev, addr in ((self.a, f"va-{tag}", self.addr_a),
                              (self.b, f"vb-{tag}", self.addr_b)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def run(self, ns, cmd, env, log):
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def remove(self):
        for ns in (self.a, self.b):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                  timeout=30).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture
def namespaces():
    spaces = Namespaces()
    try:
        yield spaces
    finally:
        spaces.remove()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert spaces.a not in left and spaces.b not in left


def _scripts(deploy_dir: Path) -> dict[str, str]:
    for doc in yaml.safe_load_all((deploy_dir / "k8s" / "release" / "launch-configmap.yaml").read_text()):
        if doc and doc.get("kind") == "ConfigMap":
            return doc["data"]
    raise AssertionError("no launch ConfigMap rendered")


def test_ranks_in_two_network_namespaces_answer_as_transformers(namespaces, tmp_path):
    ns = namespaces
    cfg = make_config(tmp_path, example="tiny-mixtral",
                      validate={"max_tokens": 8, "min_token_agreement": 1.0})
    run_build(tmp_path / "moepipe.yaml", echo=lambda s: None)
    render_deployment(cfg, artifacts(cfg))
    scripts = _scripts(cfg.deploy_dir)
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
    # what the image has on PATH: `tritonserver` (here nvidia-pytriton's, with its backends)
    triton = find_tritonserver(None, tmp_path / "server")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "tritonserver"
    wrapper.write_text(f'#!/bin/sh\nexec {triton.path} --backend-directory={triton.backend_dir}'
                       ' "$@"\n')
    wrapper.chmod(0o755)
    env = server_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    # a pod's environment: not this test process's (an in-process rank group of an earlier test
    # pins GLOO_SOCKET_IFNAME to loopback, which would bind both ranks to 127.0.0.1)
    env.pop("GLOO_SOCKET_IFNAME", None)
    # what LeaderWorkerSet gives the pods of group 0
    lws = {"LWS_LEADER_ADDRESS": ns.addr_a, "LWS_GROUP_SIZE": "2", "LWS_GROUP_INDEX": "0"}
    leader = ns.run(ns.a, ["/bin/sh", str(tmp_path / "leader.sh")],
                    {**env, **lws, "LWS_WORKER_INDEX": "0", "POD_NAME": "moepipe-0"},
                    open(tmp_path / "leader.log", "wb"))
    worker = ns.run(ns.b, ["/bin/sh", str(tmp_path / "worker.sh")],
                    {**env, **lws, "LWS_WORKER_INDEX": "1", "POD_NAME": "moepipe-0-1",
                     "MOEPIPE_PYTHON": sys.executable},
                    open(tmp_path / "worker.log", "wb"))
    http = f"{ns.addr_a}:{cfg.deploy.http_port}"
    ready = [sys.executable, "-c", "import sys, urllib.request; "
             f"sys.exit(urllib.request.urlopen('http://{http}/v2/health/ready', timeout=2)"
             ".status != 200)"]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert leader.poll() is None, (tmp_path / "leader.log").read_text()[-3000:]
        if subprocess.run(["ip", "netns", "exec", ns.a, *ready], capture_output=True,
                          timeout=30).returncode == 0:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("not ready: " + (tmp_path / "leader.log").read_text()[-3000:]
                             + (tmp_path / "worker.log").read_text()[-2000:])
    # the worker rank reached the leader across the veth pair, from its own address
    assert "rank 1 joined generation 1" in (tmp_path / "worker.log").read_text()
    out = subprocess.run(["ip", "netns", "exec", ns.a, sys.executable, "-m", "moepipe",
                          "validate", "-c", str(tmp_path / "moepipe.yaml"), "--url", http,
                          "--grpc-url", f"{ns.addr_a}:{cfg.deploy.grpc_port}",
                          "--job", "accuracy"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (cfg.workdir / "reports" / "validate.json").read_text()
    assert '"accuracy"' in report
    worker.send_signal(signal.SIGTERM)
    leader.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    leader.wait(60)
