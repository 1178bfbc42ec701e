"""A deployment moves with its project folder (issue 25 item 1), against a real tritonserver:
built and deployed in one folder, stopped, the whole folder moved elsewhere (the old path gone),
`moepipe serve` from the new place answers the same tokens. Nothing rendered names the old
place: the Python models find the tokenizer and the converted checkpoint relative to their own
folder (``args["model_repository"]``)."""

import json
import shutil
import signal
import subprocess
import sys

import numpy as np
from helpers import free_ports, make_config

from moepipe.commands.build import run_build
from moepipe.commands.deploy import run_deploy, state_dir
from moepipe.commands.validate import endpoint_for
from moepipe.deploy.local import lifecycle, processes
from moepipe.validate import client

PROMPT = "The quick brown fox jumps over the lazy dog."
TOKENS = 10


def answers(http: str, grpc: str) -> tuple[str, list[int]]:
    """(text of the ensemble over HTTP, token ids of tensorrt_llm over gRPC) for PROMPT."""
    text = client.generate(http, "ensemble", {"text_input": PROMPT, "max_tokens": TOKENS,
                                              "exclude_input_in_output": True})["text_output"]
    ids = [5, 17, 42, 7, 99, 3]
    result = client.grpc_infer(grpc, "tensorrt_llm", {
        "input_ids": np.array([ids], np.int32),
        "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[TOKENS]], np.int32),
        "end_id": np.array([[1]], np.int32),
        "exclude_input_in_output": np.array([[True]], np.bool_)}, ["output_ids"])
    return text, [t for out in result.outputs for t in out["output_ids"].reshape(-1).tolist()]


def test_a_moved_project_serves_the_same_tokens(tmp_path):
    project = tmp_path / "built-here" / "project"
    cfg = make_config(project)  # the workdir is the project folder (moepipe.yaml inside)
    run_build(project / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    try:
        ep = endpoint_for(cfg, None, None)
        before = answers(ep.http, ep.grpc)
    finally:
        lifecycle.stop(state_dir(cfg), grace=40)
    assert len(before[1]) == TOKENS and before[0]

    moved = tmp_path / "served-there" / "elsewhere"
    moved.parent.mkdir()
    shutil.move(project, moved)
    assert not project.exists()
    repo = moved / "deploy" / "model_repo"
    rendered = [p for p in repo.rglob("*") if p.is_file() and p.suffix in (".pbtxt", ".yaml")]
    assert rendered and not [p for p in rendered if str(project) in p.read_text()]

    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "moepipe", "serve", str(repo),
                             "--http-port", str(http), "--grpc-port", str(grpc),
                             "--metrics-port", str(metrics), "--timeout", "240", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # one JSON object once the server is ready
        assert line, proc.stderr.read() if proc.poll() is not None else "no status line"
        status = json.loads(line)
        assert status["http"] == f"127.0.0.1:{http}"
        after = answers(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            processes.kill_all([p for p, _ in processes.servers_of(repo)])
    assert after == before
    assert code == 128 + signal.SIGTERM  # stopped by the signal, cleanly
    assert processes.servers_of(repo) == []
