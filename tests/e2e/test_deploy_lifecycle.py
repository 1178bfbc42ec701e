"""Deploy failures leave nothing running; the CLI lifecycle (deploy, status, stop) works on a
non-decoupled deployment, where plain HTTP/gRPC inference is available."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from helpers import make_config

from moepipe.commands.build import run_build
from moepipe.commands.deploy import run_deploy, state_dir
from moepipe.errors import MoepipeError


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "moepipe", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)


def _no_server(cfg):
    assert not (state_dir(cfg) / "server.json").exists()


def test_deploy_before_build_is_refused(tmp_path):
    cfg = make_config(tmp_path / "w")
    with pytest.raises(MoepipeError, match="run `moepipe build` first"):
        run_deploy(cfg, echo=lambda s: None)
    _no_server(cfg)


def test_busy_port_is_reported_before_starting(tmp_path):
    cfg = make_config(tmp_path / "w")
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", cfg.deploy.grpc_port))
        busy.listen(1)
        proc = _cli("deploy", cwd=cfg.workdir)
    assert proc.returncode == 2
    assert f"grpc port {cfg.deploy.grpc_port} on 127.0.0.1 is not available" in proc.stderr
    assert "Traceback" not in proc.stderr
    _no_server(cfg)


@pytest.mark.parametrize("rank,tp", [(0, 1), (0, 2)], ids=["one-process", "rank-group"])
def test_model_that_fails_to_load_shows_the_servers_reason(tmp_path, rank, tp):
    cfg = make_config(tmp_path / "w", parallel={"tp": tp, "moe_ep": tp})
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    path = cfg.workdir / "checkpoint" / f"rank{rank}.safetensors"
    # A corrupt header the build's cheap check cannot see (same size, same mtime; deploy
    # refuses outputs whose size or contents changed), so the server meets it while loading.
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = _cli("deploy", cwd=cfg.workdir)
    assert proc.returncode == 2
    first = proc.stderr.splitlines()[0]
    # rank 0 is the tensorrt_llm model in the server, in one process or a rank group
    assert first.startswith("error: tritonserver exited during start")
    assert "tensorrt_llm" in first and "truncated" in first
    _no_server(cfg)
    out = subprocess.run(["pgrep", "-f", str(cfg.workdir)], capture_output=True, text=True)
    assert out.stdout.strip() == "", "a server process was left behind"


def test_cli_lifecycle_non_decoupled(tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    cfg = make_config(tmp_path / "w", example="tiny-qwen3-moe",
                      parallel={"tp": 2, "moe_ep": None, "moe_tp": 2},
                      deploy={"decoupled": False})
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    proc = _cli("deploy", cwd=cfg.workdir)
    assert proc.returncode == 0, proc.stderr
    try:
        status = json.loads(_cli("status", "--json", cwd=cfg.workdir).stdout)
        assert status["running"]
        pid = status["pid"]
        http = httpclient.InferenceServerClient(f"127.0.0.1:{cfg.deploy.http_port}")
        text = httpclient.InferInput("text_input", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"Call me Ishmael."]], dtype=object))
        n = httpclient.InferInput("max_tokens", [1, 1], "INT32")
        n.set_data_from_numpy(np.array([[6]], np.int32))
        out = http.infer("ensemble", [text, n]).as_numpy("text_output")
        assert out.reshape(-1)[0]
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{cfg.deploy.grpc_port}")
        gt = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        gt.set_data_from_numpy(np.array([[b"Call me Ishmael."]], dtype=object))
        gn = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        gn.set_data_from_numpy(np.array([[6]], np.int32))
        assert grpc.infer("ensemble", [gt, gn]).as_numpy("text_output").reshape(-1)[0] == \
            out.reshape(-1)[0]
        stream = httpclient.InferInput("stream", [1, 1], "BOOL")
        stream.set_data_from_numpy(np.array([[True]]))
        with pytest.raises(Exception, match="decoupled"):
            http.infer("ensemble", [text, n, stream])
        http.close()  # an open keep-alive connection holds the server's shutdown
        grpc.close()
        proc = _cli("validate", cwd=cfg.workdir)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "skip smoke.grpc_streaming" in proc.stdout
    finally:
        stopped = _cli("stop", cwd=cfg.workdir)
    assert stopped.returncode == 0 and f"stopped tritonserver pid {pid}" in stopped.stdout
    assert "(forced)" not in stopped.stdout
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()
    left = subprocess.run(["pgrep", "-f", str(cfg.workdir)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "backend stubs were left behind"
    assert json.loads(_cli("status", "--json", cwd=cfg.workdir).stdout) == {"running": False}
    again = _cli("stop", cwd=cfg.workdir)
    assert again.returncode == 2 and "no server is recorded" in again.stderr
