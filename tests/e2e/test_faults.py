"""Faults of a running deployment (issue 9, cases 5-8), against a real tritonserver: a dead
model process turns readiness false and the supervisor restores service; a killed server is
restarted and leaves no orphaned backend process; a lost ``server.json`` loses nothing; stop is
prompt when requests hang and works from what the deploy recorded when moepipe.yaml became
invalid. Recovery times are printed (README "Faults" quotes them), never asserted."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers import make_config

from moepipe.commands.build import run_build
from moepipe.commands.deploy import repository_dir, run_deploy, state_dir
from moepipe.deploy.local import lifecycle, processes
from moepipe.deploy.local.state import SERVE_DIR


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "moepipe", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _ready(cfg) -> bool:
    try:
        url = f"http://127.0.0.1:{cfg.deploy.http_port}/v2/health/ready"
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _generate(cfg, max_tokens=4, timeout=60):
    body = json.dumps({"text_input": "Call me Ishmael.", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{cfg.deploy.http_port}/v2/models/ensemble/generate", body,
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _state(cfg):
    return json.loads((state_dir(cfg) / "server.json").read_text())


def _wait(cond, timeout=240.0, step=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


def _default_sigint():
    """In a child that the test interrupts: Ctrl-C's default action, also when the suite
    itself runs in the background (where a shell starts jobs with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _left(cfg):
    return processes.deployment_processes(state_dir(cfg))


def _served(cfg):
    """The processes of a `moepipe serve` of the deployment's repository."""
    return processes.deployment_processes(repository_dir(cfg).parent / SERVE_DIR)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """A supervised deployment of its own (the tests kill its processes)."""
    workdir = tmp_path_factory.mktemp("faults")
    cfg = make_config(workdir, deploy={"max_restarts": 5})
    run_build(workdir / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    yield cfg
    processes.kill_all(_left(cfg))


def _kill_and_recover(cfg, pid, what):
    restarts = _state(cfg)["restarts"]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert _wait(lambda: not _ready(cfg), timeout=10), "readiness still claimed"
    not_ready = time.monotonic() - killed
    assert _wait(lambda: _ready(cfg) and _state(cfg)["restarts"] > restarts)
    recovered = time.monotonic() - killed
    print(f"\n{what} killed: not ready after {not_ready:.2f}s, ready again after "
          f"{recovered:.1f}s")
    assert _generate(cfg)["text_output"]


def test_dead_model_process_turns_readiness_false_and_is_replaced(faulty):
    cfg = faulty
    stub = _state(cfg)["models"]["tensorrt_llm_0_0"]
    _kill_and_recover(cfg, stub, "tensorrt_llm backend process")
    assert not processes.alive(stub)
    status = json.loads(_cli("status", "--json", cwd=cfg.workdir).stdout)
    assert status["running"] and status["supervised"] and status["restarts"] >= 1


def test_killed_server_is_restarted_and_leaves_no_orphans(faulty):
    """Killed by validate's ``recovery`` job under load (issue 10): the job passes - the
    supervisor brings the server back - and nothing of the old server is left."""
    from moepipe.commands.validate import run_validate
    from moepipe.config import RecoverySection

    cfg = faulty
    old = _state(cfg)
    c = cfg.model_copy(deep=True)
    # The gate is generous: a restart here takes 30-110 s depending on the machine's load.
    c.validation.recovery = RecoverySection(kill=["server"], rate=2, warmup_s=2.0,
                                            max_seconds=240.0, after_s=1.0)
    report, _ = run_validate(c, None, None, jobs=["recovery"], echo=lambda s: None)
    run = report.jobs[0].data["runs"][0]
    assert report.passed, report.jobs[0].cases
    assert run["time_to_first_success_s"] is not None
    print(f"\nrecovery job (server killed): ready after {run['time_to_ready_s']}s, "
          f"served after {run['time_to_first_success_s']}s, "
          f"{run['requests_lost']} request(s) lost")
    assert _ready(cfg) and _generate(cfg)["text_output"]
    assert not [pid for pid in old["models"].values() if processes.alive(pid)]
    pids = {p.pid for p in _left(cfg)}
    assert _state(cfg)["pid"] in pids and not pids & set(old["models"].values())
    # the restarted server's model processes are watched again (all of them)
    assert _wait(lambda: set(old["models"]) <= set(_state(cfg)["models"]), timeout=20)


def test_stop_is_prompt_with_hung_requests_and_an_invalid_config(faulty):
    cfg = faulty
    import http.client

    stub = _state(cfg)["models"]["tensorrt_llm_0_0"]
    conn = http.client.HTTPConnection("127.0.0.1", cfg.deploy.http_port, timeout=120)
    conn.request("POST", "/v2/models/ensemble/generate_stream",
                 json.dumps({"text_input": "Call me Ishmael.", "stream": True,
                             "max_tokens": cfg.build.max_seq_len - 32}),
                 {"Content-Type": "application/json"})
    assert conn.getresponse().readline().startswith(b"data:")  # generating now
    from moepipe.deploy.local.drain import progress as _progress
    from moepipe.deploy.local.state import read_state

    # Hang the engine once the metrics show the request in flight. Its own running gauge is
    # published every 0.5 s and may not show it yet (Triton's pending count did): then stop
    # sees Triton wait for the client's connection with nothing progressing - also hung.
    assert _wait(lambda: (_progress(read_state(state_dir(cfg))) or (0,))[0] >= 1, timeout=10)
    os.kill(stub, signal.SIGSTOP)  # the engine hangs with the request in flight
    config = cfg.workdir / "moepipe.yaml"
    config.write_text(config.read_text() + "parallel: {tp: [half-written\n")
    proc = _cli("stop", cwd=cfg.workdir)
    assert proc.returncode == 0, proc.stderr
    # Killed without waiting Triton's exit timeout (30 s), saying why.
    assert "forced: " in proc.stdout and "exit timeout expired" not in proc.stdout, proc.stdout
    assert "made no progress" in proc.stdout or "nothing progressed" in proc.stdout
    conn.close()
    assert "stopped tritonserver" in proc.stdout and "using the deployment recorded" in \
        proc.stderr
    assert _left(cfg) == []


def test_serve_restarts_a_dead_model_process_and_stops_on_ctrl_c(faulty):
    """Issue 9 case 5 for ``moepipe serve`` (the foreground server): a dead backend process
    is noticed, the server restarted, and Ctrl-C leaves nothing behind."""
    import queue
    import threading

    cfg = faulty
    lifecycle.clear(state_dir(cfg))  # the module's deployment, if a test left it running
    proc = subprocess.Popen(
        [sys.executable, "-m", "moepipe", "serve", str(repository_dir(cfg)), "--http-port",
         str(cfg.deploy.http_port), "--grpc-port", str(cfg.deploy.grpc_port),
         "--metrics-port", str(cfg.deploy.metrics_port), "--max-restarts", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_default_sigint)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()

    def until(text, timeout=240):
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            if text in seen[-1]:
                return seen
        raise AssertionError(f"no {text!r} from moepipe serve: {seen}")

    try:
        until("Ctrl-C to stop")  # ready, and its model processes are being watched
        stub = next(p.pid for p in _served(cfg) if p.model == "tensorrt_llm_0_0")
        killed = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        seen = until("serving again")
        assert any("tensorrt_llm_0_0" in x and "restarting (1 of 1)" in x for x in seen), seen
        assert _ready(cfg) and _generate(cfg)["text_output"]
        print(f"\nserve: model process killed, serving again after "
              f"{time.monotonic() - killed:.1f}s")
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            left = []
            while not lines.empty():
                left.append(lines.get())
            raise AssertionError(f"serve still running 120 s after Ctrl-C: {seen + left}, "
                                 f"processes {[(p.pid, p.kind) for p in _served(cfg)]}") \
                from None
        assert code == 130
        assert _served(cfg) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        processes.kill_all(_served(cfg))


def test_lost_server_json_and_orphans_after_sigkill(tmp_path):
    cfg = make_config(tmp_path / "w", deploy={"max_restarts": 0})
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    try:
        pid = _state(cfg)["pid"]
        (state_dir(cfg) / "server.json").unlink()
        status = json.loads(_cli("status", "--json", cwd=cfg.workdir).stdout)
        assert status["running"] and status["pid"] == pid and not status["recorded"]
        # deploy finds the running server by its tag: the same build is served already (a new
        # one would be a live update, issue 23), no second server is started
        said: list[str] = []
        result = run_deploy(cfg, echo=said.append)
        status = json.loads(_cli("status", "--json", cwd=cfg.workdir).stdout)
        assert result["updated"] is False and status["pid"] == pid, said
        assert any("serving already; nothing to update" in line for line in said), said
        # The server dies hard (no supervisor to clean up): its stubs are orphaned. Stopped
        # first, they cannot notice and exit by themselves (as a busy one does not).
        for p in _left(cfg):
            os.kill(p.pid, signal.SIGSTOP if p.kind == "stub" else signal.SIGKILL)
        assert _wait(lambda: not processes.alive(pid), timeout=10)
        assert [p for p in _left(cfg) if p.kind == "stub"], "no orphan to clean up"
        proc = _cli("stop", cwd=cfg.workdir)
        assert proc.returncode == 0, proc.stderr
        assert "killed" in proc.stdout and "leftover" in proc.stdout
        assert _left(cfg) == []
    finally:
        processes.kill_all(_left(cfg))


def test_stop_after_a_rejected_grpc_request_is_prompt_and_says_what_happened(tmp_path):
    """Triton never unloads a decoupled ensemble that rejected a request (a gRPC input of the
    wrong datatype): stop used to sit out Triton's exit timeout and call it graceful."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    cfg = make_config(tmp_path / "w", deploy={"max_restarts": 0})
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    run_deploy(cfg, echo=lambda s: None)
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{cfg.deploy.grpc_port}")
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put(error))
        wrong = grpcclient.InferInput("text_input", [1, 1], "INT32")  # BYTES expected
        wrong.set_data_from_numpy(np.array([[5]], dtype=np.int32))
        tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
        client.async_stream_infer("ensemble", [wrong, tokens])
        error = answers.get(timeout=60)
        assert error is not None and "INT32" in str(error)  # rejected, with the reason
        proc = _cli("stop", cwd=cfg.workdir)  # the client still holds its stream open
        assert proc.returncode == 0, proc.stderr
        assert "forced: Triton could not unload ensemble with no request in flight" \
            in proc.stdout, proc.stdout
        assert _left(cfg) == []
        client.stop_stream()
    finally:
        processes.kill_all(_left(cfg))
