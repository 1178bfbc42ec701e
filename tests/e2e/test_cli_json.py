"""``--json`` as a script drives the pipeline: init, build (plan and build), deploy, validate,
stop, serve and convert each print one JSON object on stdout (their messages go to stderr), and
a failure is still one line on stderr with exit 2."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_ports, make_config

from moepipe.commands.deploy import repository_dir, state_dir
from moepipe.deploy.local import lifecycle
from moepipe.deploy.local.state import SERVE_DIR


def moepipe(*args, cwd):
    return subprocess.run([sys.executable, "-m", "moepipe", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})


def one_object(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # the whole of stdout: one JSON object


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_pipeline_commands_print_one_json_object(tmp_path):
    project = tmp_path / "project"
    cfg = make_config(project, validate={"jobs": ["smoke"]})
    made = one_object(moepipe("init", "--example", "tiny-mixtral", "--tp", 2, "--moe-ep", 2,
                              "-c", "other.yaml", "--json", cwd=project))
    assert made["config"] == str(project / "other.yaml")
    assert made["parallel"] == {"tp": 2, "pp": 1, "moe_tp": None, "moe_ep": 2,
                                "attention_dp": False}
    assert Path(made["schema"]).is_file()

    planned = one_object(moepipe("build", "--dry-run", "--json", cwd=project))
    assert planned["dry_run"] is True and planned["target"] == "cpu"
    assert [s["action"] for s in planned["stages"]] == ["run"] * len(planned["stages"])
    built = moepipe("build", "--json", cwd=project)
    manifest = one_object(built)
    assert manifest["dry_run"] is False and manifest["finished"]
    assert [s["stage"] for s in manifest["stages"]] == [s["stage"] for s in planned["stages"]]
    assert all(s["status"] == "built" for s in manifest["stages"])
    assert "convert" in built.stderr  # the human lines, on stderr

    try:
        deployed = moepipe("deploy", "--json", cwd=project)
        state = one_object(deployed)
        assert state["running"] and state["http"] == f"127.0.0.1:{cfg.deploy.http_port}"
        assert "tritonserver ready" in deployed.stderr
        checked = moepipe("validate", "--json", cwd=project)
        report = one_object(checked)
        assert report["passed"] and [j["job"] for j in report["jobs"]] == ["smoke"]
        assert all(Path(p).is_file() for p in report["files"].values())
        assert json.loads(Path(report["files"]["json"]).read_text())["jobs"] == report["jobs"]
    finally:
        stopped = moepipe("stop", "--json", cwd=project)
    result = one_object(stopped)
    assert result["was_running"] and result["pid"] == state["pid"], result

    # serve: the object comes once the server is ready, alone on its line, before Ctrl-C
    http, grpc, metrics = free_ports(3)
    argv = ["serve", repository_dir(cfg), "--http-port", http, "--grpc-port", grpc,
            "--metrics-port", metrics, "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "moepipe", *map(str, argv)],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    try:
        serving = json.loads(proc.stdout.readline())
        assert serving["running"] and serving["http"] == f"127.0.0.1:{http}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and out == "", out
        assert "Ctrl-C to stop" in err
    finally:
        if proc.poll() is None:
            proc.kill()
        lifecycle.clear(repository_dir(cfg).parent / SERVE_DIR)

    converted = one_object(moepipe("convert", "--model", cfg.workdir / "model", "--output",
                                   tmp_path / "ckpt", "--tp", 2, "--json", cwd=project))
    assert converted["world_size"] == 2 and converted["output"] == str(tmp_path / "ckpt")
    ranks = sorted(p.name for p in (tmp_path / "ckpt").glob("rank*.safetensors"))
    assert ranks == ["rank0.safetensors", "rank1.safetensors"]
    assert converted["bytes_written"] == sum(p.stat().st_size for p in
                                             (tmp_path / "ckpt").iterdir() if p.is_file())
    assert not lifecycle.status(state_dir(cfg)).get("running")


@pytest.mark.parametrize("argv", [["deploy", "--json"], ["stop", "--json"],
                                  ["convert", "--model", "missing", "--output", "x", "--json"]])
def test_a_failure_with_json_is_one_line_on_stderr(tmp_path, argv):
    proc = moepipe(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "hint:" in lines[0]
