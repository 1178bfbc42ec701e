"""The local deployment's server: started on loopback, watched, stopped by PID; its status and
stop from what the deploy recorded or, when ``server.json`` is gone, from the processes
themselves. This is the face of :mod:`moepipe.deploy.local`.

``stop`` is prompt: SIGTERM lets Triton finish the requests in flight, but when a model's
backend process has died, or the requests in flight make no progress (no token, no finished
request) for :data:`NO_PROGRESS_S`, waiting for Triton's exit timeout helps nobody and the
deployment is killed at once. The same holds when Triton, with nothing in flight, cannot unload a
model (its log stops counting down live models): a decoupled ensemble that rejected a request
(e.g. a gRPC input of the wrong datatype) while the client keeps its stream open is never
released by Triton and would hold the server for its whole exit timeout. Likewise when Triton
waits for client connections or in-flight inferences and nothing progresses for
:data:`DRAIN_IDLE_S`: an idle keep-alive connection, or a hung request the engine never got to
report as running. A server that did sit
out its exit timeout is reported as forced, not graceful. Every process of the deployment
(server, backend stubs that a killed server left behind, worker ranks, the supervisor, any
other process started with the deployment's tag: :mod:`.processes`) is gone when ``stop``
returns, and so is the shared memory of a server that had to be killed (:mod:`.shm`).

The same holds for every other way a server's life ends: a start that fails, times out or is
interrupted by a signal stops what it began (:func:`start`); a command that started a server
and is ended by a signal or an error stops it (:func:`guard`); one repository is served by one
server at a time (:func:`refuse_served`).

A deployment whose ``tensorrt_llm`` model is rank 0 of a rank group (world size > 1) has its
worker ranks started with the server (:mod:`moepipe.deploy.local.ranks`); the server is ready
once they have joined.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from moepipe.deploy.local import drain, live, processes, ranks, shm
from moepipe.deploy.local.binary import (
    LOG_FILE,
    check_port,
    failure_reason,
    find_tritonserver,
    log_tail,
    server_env,
    server_limits,
)
from moepipe.deploy.local.state import (
    SERVE_DIR,
    STATE_FILE,
    ServerError,
    ServerState,
    read_state,
    write_state,
)
from moepipe.deploy.tritonserver import ServerCommand
from moepipe.utils import interrupt


def _found_state(proc: processes.Proc, state_dir: Path) -> ServerState:
    """A server that ``server.json`` no longer records, described from its command line."""
    def port(name: str, default: int) -> int:
        value = proc.option(name)
        return int(value) if value and value.isdigit() else default

    return ServerState(pid=proc.pid, host=proc.option("http-address") or "127.0.0.1",
                       http_port=port("http-port", 8000), grpc_port=port("grpc-port", 8001),
                       metrics_port=port("metrics-port", 8002),
                       repository=proc.option("model-repository") or "",
                       log=str(state_dir / "tritonserver.log"), binary=proc.argv[0],
                       started=0.0, exit_timeout=port("exit-timeout-secs", 30))


def locate(state_dir: Path) -> tuple[ServerState | None, bool]:
    """(the deployment's server, whether ``server.json`` recorded it). Without a record, the
    deployment's running tritonserver is found by what started it (see :mod:`.processes`)."""
    state = read_state(state_dir)
    if state is not None:
        return state, True
    servers = [p for p in processes.deployment_processes(state_dir) if p.kind == "server"]
    return (_found_state(servers[0], state_dir), False) if servers else (None, False)


def start_ranks(state: ServerState, state_dir: Path) -> None:
    """Start the worker ranks of ``state``'s deployment (none for a single process)."""
    group = ranks.RankGroup.of(Path(state.repository))
    state.ranks = ranks.start_workers(group, Path(state.repository), state_dir) \
        if group is not None else None


def dead_models(state: ServerState) -> list[str]:
    """Model instances whose backend process died since the server became ready."""
    return [f"{name} (pid {pid})" for name, pid in sorted((state.models or {}).items())
            if not processes.alive(pid)]


def ready(state: ServerState) -> bool:
    try:
        with urllib.request.urlopen(f"http://{state.http}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def status(state_dir: Path) -> dict:
    """What runs for this workdir. ``running`` means serving: the server is up and none of
    its model processes has died."""
    state, recorded = locate(state_dir)
    if state is None:
        failed = _failure(state_dir)
        return {"running": False, **({"failure": failed} if failed else {})}
    server_alive = processes.alive(state.pid)
    dead = dead_models(state) if server_alive else []
    lost = ranks.dead_ranks(state.ranks) if server_alive else []
    info = state.to_status(server_alive and not dead and not lost)
    info.update(server_alive=server_alive, dead_models=dead, dead_ranks=lost, recorded=recorded,
                supervised=bool(state.supervisor_pid and processes.alive(state.supervisor_pid)),
                version=_version(state_dir) if server_alive else None)
    if not recorded:
        info["note"] = f"{STATE_FILE} is missing; found the server by its deployment tag"
    failed = _failure(state_dir)
    if failed and not info["running"]:
        info["failure"] = failed
    return info


def _version(state_dir: Path) -> str | None:
    """The weights version serving: as the model says (cpu target), else as recorded."""
    return live.serving_version(state_dir) or \
        (live.read_versions(state_dir).get("serving") or {}).get("version")


def _failure(state_dir: Path) -> str | None:
    try:
        return json.loads((state_dir / "supervisor.json").read_text()).get("gave_up")
    except (OSError, ValueError):
        return None


def refuse_served(repository: Path) -> None:
    """Refuse a second server on ``repository``: the two would share its files and the ports
    of neither would say which one a client reaches."""
    for proc, tag in processes.servers_of(repository):
        if tag is None:
            by = "a tritonserver moepipe did not start"
        elif Path(tag).name == SERVE_DIR:
            by = "`moepipe serve`"
        else:
            by = f"the `moepipe deploy` whose state is {tag}"
        raise ServerError(f"{repository} is already served by {by} (tritonserver pid "
                          f"{proc.pid}, http port {proc.option('http-port')})",
                          "stop that server first, or serve a copy of the repository")


def start(repository: Path, state_dir: Path, *, host: str, http_port: int, grpc_port: int,
          metrics_port: int, timeout: float = 180.0, exit_timeout: int = 30,
          binary: Path | None = None) -> ServerState:
    """Start tritonserver on ``repository`` and wait until it is ready. Whatever ends the
    wait - the server's exit, the timeout, a signal - stops every process the start began."""
    state_dir.mkdir(parents=True, exist_ok=True)
    current = read_state(state_dir)
    if current is not None and processes.alive(current.pid):
        raise ServerError(f"a server is already running for this workdir (pid {current.pid}, "
                          f"http {current.http})", "run `moepipe stop` first")
    refuse_served(repository)
    for what, port in (("http", http_port), ("grpc", grpc_port), ("metrics", metrics_port)):
        check_port(host, port, what)
    triton = find_tritonserver(binary, state_dir)
    log = state_dir / LOG_FILE
    # The local server runs a CPU target's repository (GPU targets run in NVIDIA's container).
    server = ServerCommand(repository, host, http_port, grpc_port, metrics_port, exit_timeout)
    cmd = [str(triton.path), *server.args(triton.backend_dir)]
    try:
        with open(log, "wb") as log_file:
            # Own session: Ctrl-C in the terminal reaches moepipe, which stops the server and
            # everything of its deployment (they carry its tag: processes.tagged).
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    env=processes.tagged(server_env(), state_dir),
                                    start_new_session=True, preexec_fn=server_limits)
        state = ServerState(pid=proc.pid, host=host, http_port=http_port,
                            grpc_port=grpc_port, metrics_port=metrics_port,
                            repository=str(repository), log=str(log),
                            binary=str(triton.path), started=time.time(),
                            exit_timeout=exit_timeout,
                            backend_dir=str(triton.backend_dir) if triton.backend_dir else None)
        start_ranks(state, state_dir)  # rank 0 (in the server) waits for them: ready = joined
        write_state(state_dir, state)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                reason = failure_reason(log) or f"exit code {proc.returncode}"
                raise ServerError(f"tritonserver exited during start: {reason}",
                                  f"full log: {log}", details=log_tail(log))
            if ready(state):
                watch(state_dir, state)  # so that a model process that dies is noticed
                write_state(state_dir, state)
                return state
            time.sleep(0.25)
        terminate(state, exit_timeout, state_dir)
        raise ServerError(f"tritonserver was not ready after {timeout:.0f}s (stopped it)",
                          f"raise deploy.ready_timeout_s, or see {log}", details=log_tail(log))
    except BaseException:
        clear(state_dir)
        raise


def watch(state_dir: Path, state: ServerState) -> list[str]:
    """Record the model processes of ``state``'s server and their shared memory: one that
    dies later is noticed, and the regions of a killed server are removed. Returns the model
    instances that were not recorded yet (seen after restarts: a model missing from the record
    could die unnoticed)."""
    mine = [p for p in processes.deployment_processes(state_dir)
            if p.pid == state.pid or p.server_pid == state.pid]
    stubs = {p.model: p.pid for p in mine if p.kind == "stub" and p.model}
    new = sorted(m for m in stubs if m not in (state.models or {}))
    state.models = {**stubs, **(state.models or {})}
    state.regions = sorted(set(state.regions or []) | shm.regions(mine))
    return new


def _signal(state: ServerState, grace: float) -> tuple[bool, str | None]:
    """SIGTERM, then SIGKILL when Triton's wait for in-flight requests is pointless (a model
    process died, or nothing progresses) or after ``grace``. Returns (graceful, why forced)."""
    dead = dead_models(state)
    if dead:  # requests routed to it can never finish: Triton would wait its exit timeout
        os.kill(state.pid, signal.SIGKILL)
        return False, f"model process {dead[0]} had died"
    before = drain.progress(state)
    models = drain.models(state)
    shutdown = drain.ShutdownLog(Path(state.log))
    try:
        os.kill(state.pid, signal.SIGTERM)
    except ProcessLookupError:
        return True, None
    deadline = time.monotonic() + grace
    last, since = before, time.monotonic()
    reason = f"still running after {grace:.0f}s"
    while time.monotonic() < deadline:
        if interrupt.hurry():
            return False, "interrupted again while it stopped"
        if not processes.alive(state.pid):
            shutdown.read()
            if shutdown.timed_out:
                return False, "Triton's exit timeout expired with models still loaded"
            return True, None
        shutdown.read()
        if shutdown.stuck(models):
            live = [m for m in models if m not in shutdown.unloaded]
            reason = (f"Triton could not unload {', '.join(live) or 'a model'} with no request "
                      f"in flight (Triton holds a decoupled ensemble that rejected a request "
                      f"while the client's gRPC stream stays open); killed instead of waiting "
                      f"{state.exit_timeout}s")
            break
        now = drain.progress(state)
        if now is not None and last is not None and now[1] != last[1]:
            since = time.monotonic()
        if now is not None:
            last = now
        idle = time.monotonic() - since
        if now is not None and now[0] > 0 and idle > drain.NO_PROGRESS_S:
            reason = (f"{now[0]:.0f} request(s) in flight made no progress for "
                      f"{drain.NO_PROGRESS_S:.0f}s")
            break
        if shutdown.waiting_for and not shutdown.unloading and idle > drain.DRAIN_IDLE_S:
            reason = (f"Triton waited for {shutdown.waiting_for} while nothing progressed for "
                      f"{drain.DRAIN_IDLE_S:.0f}s; killed instead of waiting {state.exit_timeout}s")
            break
        time.sleep(drain.POLL_S)
    return False, reason


def terminate(state: ServerState, grace: float,
              state_dir: Path) -> tuple[bool, str | None, list[int]]:
    """Stop ``state``'s server (see :func:`_signal`), then kill what is left of its deployment
    (the server after a forced stop, backend stubs, any other process it started) and remove
    its shared memory. Returns (graceful, why forced, pids killed)."""
    graceful, forced = True, None
    if processes.alive(state.pid):
        graceful, forced = _signal(state, grace)
    processes.reap(state.pid)
    return graceful, forced, _kill_all(state_dir, state)


def _kill_all(state_dir: Path, state: ServerState | None) -> list[int]:
    """Kill every process of the deployment (this one excepted) and remove the shared
    memory of its servers; returns the pids killed."""
    procs = processes.deployment_processes(state_dir)
    processes.freeze(procs)  # no region is created between reading them and the kill
    regions = shm.regions(procs) | set(state.regions or [] if state else [])
    killed = processes.kill_all(procs)
    shm.remove(regions)
    return killed


def clear(state_dir: Path) -> list[int]:
    """Kill what a deployment left behind (stubs of a killed server, its supervisor, a server
    whose start was interrupted), remove its shared memory and forget its record; returns the
    pids killed."""
    killed = _kill_all(state_dir, read_state(state_dir))
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return killed


@contextlib.contextmanager
def guard(state_dir: Path, grace: float = 40.0) -> Iterator[None]:
    """Whatever ends the block other than its own end - a signal (:mod:`moepipe.utils.interrupt`),
    an error - stops every process of the deployment started in it: the server gracefully
    (a second signal: at once), then the rest."""
    try:
        yield
    except BaseException:
        state = read_state(state_dir)
        if state is not None:
            terminate(state, grace, state_dir)
        clear(state_dir)
        raise


def stop(state_dir: Path, grace: float | None = None) -> dict:
    """Stop the deployment's server and every process that belongs to it."""
    state, recorded = locate(state_dir)
    procs = processes.deployment_processes(state_dir)
    if state is None and not procs:
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        raise ServerError("no server is recorded or running for this workdir", "nothing to stop")
    # The supervisor first: it would restart what is being stopped.
    processes.kill_all([p for p in procs if p.kind == "supervisor"])
    running = state is not None and processes.alive(state.pid)
    if state is not None:
        graceful, forced, killed = terminate(
            state, state.exit_timeout + 10 if grace is None else grace, state_dir)
    else:
        graceful, forced, killed = True, None, _kill_all(state_dir, None)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    pid = state.pid if state is not None else None
    return {"pid": pid, "was_running": running, "graceful": graceful, "forced": forced,
            "leftovers": len([k for k in killed if k != pid]),
            "recorded": recorded}
