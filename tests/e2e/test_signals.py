"""Every way `moepipe serve`, `moepipe deploy` and the supervisor end stops what they started
(issue 26 items 1, 5, 6), against a real tritonserver: SIGTERM, SIGHUP and Ctrl-C (once or
twice) while the server starts, serves or is being restarted leave no process and no shared
memory of the deployment behind, exit 128 + the signal's number and say so in one line; a
repository is served by one server at a time, and a deployment's supervisor acts only on the
processes its deployment started."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import free_ports, make_config

from moepipe.commands.build import run_build
from moepipe.commands.deploy import artifacts, run_deploy, state_dir
from moepipe.deploy.local import lifecycle, processes, shm
from moepipe.deploy.local.state import SERVE_DIR, read_state
from moepipe.deploy.render.repository import render_deployment


def _default_signals():
    """In a child that the test signals: the default actions, also when the suite runs in the
    background (a shell starts background jobs with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _wait(cond, timeout=240.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(step)
    return None


def _regions_on_disk(names):
    return sorted(n for n in names if (shm.SHM / n).exists())


class Run:
    """A moepipe command in a child process, its output read as it comes."""

    def __init__(self, *args, cwd=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "moepipe", *map(str, args)],
                                     cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, preexec_fn=_default_signals)
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout],
                         daemon=True).start()

    def until(self, text, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.out.append(self.lines.get(timeout=0.5))
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if text in self.out[-1]:
                return
        raise AssertionError(f"no {text!r}: {self.out} {self.proc.stderr.read()}")

    def finish(self, timeout=120):
        """(exit status, stderr) once it has exited."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {timeout}s after the signal: {self.out}") \
                from None
        return code, self.proc.stderr.read()


def _nothing_left(repo: Path, *state_dirs: Path) -> None:
    assert processes.servers_of(repo) == []
    for where in state_dirs:
        assert processes.deployment_processes(where) == [], where
    left = subprocess.run(["pgrep", "-f", str(repo)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a process of the deployment was left behind"


def _cleanup(repo: Path, *state_dirs: Path) -> None:
    for where in state_dirs:
        lifecycle.clear(where)
    processes.kill_all([p for p, _ in processes.servers_of(repo)])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A built tiny-mixtral with its repository rendered (nothing started). World size 1: a
    second server on the same repository (a foreign one, below) must be able to start, which a
    rank group's rank 0 cannot without its workers (a lost rank: tests/e2e/test_rank_faults.py)."""
    workdir = tmp_path_factory.mktemp("signals")
    cfg = make_config(workdir, deploy={"max_restarts": 2}, parallel={"tp": 1, "moe_ep": 1})
    run_build(workdir / "moepipe.yaml", echo=lambda s: None)
    repo = render_deployment(cfg, artifacts(cfg))
    yield cfg, repo
    _cleanup(repo, state_dir(cfg), repo.parent / SERVE_DIR)


def _serve(repo, *extra):
    http, grpc, metrics = free_ports(3)
    return Run("serve", repo, "--http-port", http, "--grpc-port", grpc, "--metrics-port",
               metrics, *extra)


def _server_of(where: Path, other_than: int | None = None):
    """The tritonserver of a deployment, once there is one (other than ``other_than``)."""
    def found():
        return next((p for p in processes.deployment_processes(where)
                     if p.kind == "server" and p.pid != other_than), None)
    server = _wait(found)
    assert server is not None, f"no tritonserver started for {where}"
    return server


def _loading(where: Path) -> list[str]:
    """The shared memory of a deployment's server once its first model loads."""
    regions = _wait(lambda: sorted(shm.regions(processes.deployment_processes(where))))
    assert regions, f"no model of {where} started loading"
    return regions


def _ended_cleanly(run, code, line, repo, where, regions):
    """``run`` exited with ``code`` and the one line ``line``; nothing of the deployment is
    left: no process, no record, none of ``regions``."""
    got, err = run.finish()
    assert got == code and err.strip().splitlines() == [line], err
    _nothing_left(repo, where)
    assert read_state(where) is None
    assert _regions_on_disk(regions) == []


def test_serve_sigterm_while_the_server_starts(built):
    _, repo = built
    where = repo.parent / SERVE_DIR
    run = _serve(repo)
    try:
        regions = _loading(where)  # the ready loop waits for the server now
        run.proc.send_signal(signal.SIGTERM)
        _ended_cleanly(run, 143, "interrupted by SIGTERM", repo, where, regions)
        assert not any("Ctrl-C to stop" in x for x in run.out), "it was ready already"
    finally:
        run.proc.kill()
        _cleanup(repo, where)


def test_serve_ctrl_c_twice_stops_a_hung_server_at_once_and_frees_its_memory(built):
    """A second Ctrl-C while the first one's graceful stop waits (the engine hangs with a
    request in flight): the server is killed at once, nothing is left, and the shared memory
    of the killed server is removed (Triton removes it only when it exits by itself)."""
    _, repo = built
    where = repo.parent / SERVE_DIR
    run = _serve(repo)
    try:
        run.until("Ctrl-C to stop")
        state = read_state(where)
        assert state.regions and _regions_on_disk(state.regions) == state.regions
        os.kill(state.models["tensorrt_llm_0_0"], signal.SIGSTOP)  # the engine hangs
        run.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)  # the graceful stop is under way (Triton unloads, the stub cannot)
        assert run.proc.poll() is None
        run.proc.send_signal(signal.SIGINT)
        _ended_cleanly(run, 130, "interrupted", repo, where, state.regions)
    finally:
        run.proc.kill()
        _cleanup(repo, where)


def test_serve_ctrl_c_during_a_restart(built):
    """Ctrl-C while the foreground watch restarts a server whose model process died: the new
    server (not ready yet) is stopped too, and the dead one's shared memory is gone."""
    _, repo = built
    where = repo.parent / SERVE_DIR
    run = _serve(repo)
    try:
        run.until("Ctrl-C to stop")
        old = read_state(where)
        os.kill(old.models["tensorrt_llm_0_0"], signal.SIGKILL)
        run.until("restarting (1 of 3)")
        _server_of(where, other_than=old.pid)  # the restart's server is starting
        regions = _loading(where)
        run.proc.send_signal(signal.SIGINT)
        _ended_cleanly(run, 130, "interrupted", repo, where, old.regions + regions)
    finally:
        run.proc.kill()
        _cleanup(repo, where)


def test_deploy_sigterm_while_the_server_starts(built):
    cfg, repo = built
    where = state_dir(cfg)
    run = Run("deploy", cwd=cfg.workdir)
    try:
        regions = _loading(where)
        run.proc.send_signal(signal.SIGTERM)
        _ended_cleanly(run, 143, "interrupted by SIGTERM", repo, where, regions)
    finally:
        run.proc.kill()
        _cleanup(repo, where)


def _deploy(cfg):
    run_deploy(cfg, echo=lambda s: None)
    return read_state(state_dir(cfg))


def _supervisor_log(cfg):
    return (state_dir(cfg) / "supervisor.log").read_text()


def test_one_server_per_repository_and_the_supervisor_sees_only_its_own(built):
    """Item 5: `moepipe serve` of the repository a deploy serves is refused (it used to be
    adopted by the deploy's supervisor, which then restarted the deployment); a tritonserver
    started on the same repository by someone else is neither watched nor stopped. Then item
    1 and 6 for the supervisor: SIGTERM in the middle of its restart leaves nothing, and the
    killed server's shared memory is removed."""
    cfg, repo = built
    where = state_dir(cfg)
    foreign = None
    try:
        state = _deploy(cfg)
        refused = subprocess.run([sys.executable, "-m", "moepipe", "serve", repo,
                                  "--http-port", str(free_ports(1)[0])],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2
        assert refused.stderr.splitlines() == [
            f"error: {repo} is already served by the `moepipe deploy` whose state is {where} "
            f"(tritonserver pid {state.pid}, http port {cfg.deploy.http_port}) (hint: stop "
            "that server first, or serve a copy of the repository)"]

        # Someone else's server on the same repository (not started by moepipe).
        from moepipe.deploy.local.binary import find_tritonserver, server_env
        from moepipe.deploy.tritonserver import ServerCommand

        triton = find_tritonserver(None, where)
        http, grpc, metrics = free_ports(3)
        foreign = subprocess.Popen(
            [str(triton.path), *ServerCommand(repo, "127.0.0.1", http, grpc, metrics,
                                              5).args(triton.backend_dir)],
            env=server_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)
        assert _wait(lambda: _ready(http), timeout=240), "the foreign server did not start"
        time.sleep(6)  # longer than the supervisor's refresh (5 s) of the watched processes
        now = read_state(where)
        assert now.pid == state.pid and now.restarts == 0 and now.models == state.models
        assert processes.alive(foreign.pid)
        _kill_foreign(foreign)  # (a restart would be refused while it serves the repository)
        foreign = None

        # SIGTERM to the supervisor while it restarts a killed server.
        os.kill(state.pid, signal.SIGKILL)
        _server_of(where, other_than=state.pid)
        os.kill(state.supervisor_pid, signal.SIGTERM)
        assert _wait(lambda: not processes.alive(state.supervisor_pid), timeout=120)
        _nothing_left_of(where)
        assert "interrupted by SIGTERM: stopped the deployment" in _supervisor_log(cfg)
        assert _regions_on_disk(state.regions) == []
    finally:
        if foreign is not None:
            _kill_foreign(foreign)
        _cleanup(repo, where)


def _ready(port) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _kill_foreign(foreign) -> None:
    """Kill a server moepipe did not start, its stubs and their shared memory."""
    procs = [p for p in processes.triton_processes()
             if foreign.pid in (p.pid, p.server_pid)]
    regions = shm.regions(procs)
    processes.kill_all(procs)
    foreign.wait()
    shm.remove(regions)


def _nothing_left_of(where: Path) -> None:
    assert processes.deployment_processes(where) == []
    assert read_state(where) is None


def test_supervisor_sighup_while_supervising_stops_the_deployment(built):
    cfg, repo = built
    where = state_dir(cfg)
    try:
        state = _deploy(cfg)
        os.kill(state.supervisor_pid, signal.SIGHUP)
        assert _wait(lambda: not processes.alive(state.supervisor_pid), timeout=120)
        _nothing_left(repo, where)
        assert read_state(where) is None
        assert "interrupted by SIGHUP: stopped the deployment" in _supervisor_log(cfg)
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "moepipe", "status", "--json"], cwd=cfg.workdir,
            capture_output=True, text=True).stdout)
        assert status == {"running": False}
    finally:
        _cleanup(repo, where)
