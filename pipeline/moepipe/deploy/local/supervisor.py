"""The supervisor of a deployed server: ``python -m moepipe.deploy.local.supervisor STATE_DIR
REPO``.

``moepipe deploy`` starts it (detached) once the server is ready. Every :data:`POLL_S` it
checks that the server and each model's backend process are alive; when one has died it kills
what is left of the deployment at once (so readiness is no longer claimed by a server that
cannot answer) and starts the server again, up to ``deploy.max_restarts`` times, waiting
``2**n`` seconds (at most 10) before the n-th retry of a failed start. ``server.json`` always
describes the current server (``restarts`` counts them); giving up is recorded in
``supervisor.json`` and shown by ``moepipe status``.

SIGTERM, SIGHUP or SIGINT stop the deployment - gracefully, or at once on a second signal -
also in the middle of a restart, and the supervisor exits with 128 + the signal's number; so
does ``moepipe serve``'s :func:`foreground` watch.

A worker rank that died (or left: rank 0 dissolves its group when it loses any rank) is not a
reason to restart the server: rank 0 in the server keeps running, answers UNAVAILABLE and waits
for the next group, so the supervisor kills the other workers and starts all of them again
(one restart of the rank group, counted like a server restart).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from moepipe.deploy.local import processes
from moepipe.deploy.local.binary import check_port, server_env
from moepipe.deploy.local.lifecycle import clear, dead_models, guard, start, start_ranks, watch
from moepipe.deploy.local.ranks import dead_ranks
from moepipe.deploy.local.state import ServerError, ServerState, read_state, write_state
from moepipe.utils import interrupt

POLL_S = 0.2  # a lost worker rank is noticed within a second
STARTUP_S = 60.0  # the supervisor's interpreter start, on a busy machine
REFRESH_S = 5.0  # how often a healthy deployment's model processes are looked for again
LOG = "supervisor.log"
log = logging.getLogger("moepipe.supervisor")


def spawn(state_dir: Path, state: ServerState, max_restarts: int) -> ServerState:
    """Start the supervisor for ``state`` (detached: it outlives ``moepipe deploy``)."""
    state.max_restarts = max_restarts
    (state_dir / "supervisor.json").unlink(missing_ok=True)
    with open(state_dir / LOG, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", processes.SUPERVISOR_MODULE,
                                 str(state_dir), state.repository],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=processes.tagged(server_env(), state_dir),
                                start_new_session=True)
    state.supervisor_pid = proc.pid
    write_state(state_dir, state)
    # Until its signal handlers are installed a signal would end it without stopping the
    # server: `moepipe deploy` returns (and leaves the deployment to it) once they are.
    deadline = time.monotonic() + STARTUP_S
    while not processes.catches(proc.pid, signal.SIGTERM):
        if proc.poll() is not None or time.monotonic() > deadline:
            code = proc.poll()
            proc.kill()
            raise ServerError("the supervisor did not start" + (
                f" (exit code {code})" if code is not None else f" within {STARTUP_S:.0f}s"),
                f"see {state_dir / LOG}")
        time.sleep(0.02)
    return state


def problem(state: ServerState) -> str | None:
    """Why the deployment cannot serve (None: it can)."""
    if not processes.alive(state.pid):
        return f"tritonserver (pid {state.pid}) exited"
    dead = dead_models(state)
    if dead:
        return f"the backend process of model {dead[0]} died"
    lost = dead_ranks(state.ranks)
    return f"worker {lost[0]} of the rank group exited" if lost else None


def ranks_only(state: ServerState) -> bool:
    """Whether only worker ranks died (the server and its models live on)."""
    return processes.alive(state.pid) and not dead_models(state) \
        and bool(dead_ranks(state.ranks))


def restart_ranks(state_dir: Path, state: ServerState) -> ServerState:
    """Start the rank group's workers again (the others killed first); rank 0 forms the next
    group from them."""
    processes.kill_all([p for p in processes.deployment_processes(state_dir)
                        if p.kind == "rank"])
    start_ranks(state, state_dir)
    state.restarts += 1
    write_state(state_dir, state)
    return state


def _record_new_models(state_dir: Path, state: ServerState) -> None:
    """Watch every model process of a healthy server, also one that was not visible when the
    server became ready."""
    before = state.regions
    new = watch(state_dir, state)
    if new or state.regions != before:
        write_state(state_dir, state)
    if new:
        log.info("now watching %s", ", ".join(new))


def _wait_for_ports(state: ServerState, timeout: float = 15.0) -> None:
    """A killed server's threads may still hold its sockets for a moment after its pid is a
    zombie: wait until every port can be bound again."""
    deadline = time.monotonic() + timeout
    for what, port in (("http", state.http_port), ("grpc", state.grpc_port),
                       ("metrics", state.metrics_port)):
        while True:
            try:
                check_port(state.host, port, what)
                break
            except ServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def restart(state_dir: Path, old: ServerState) -> ServerState:
    _wait_for_ports(old)

    new = start(Path(old.repository), state_dir, host=old.host, http_port=old.http_port,
                grpc_port=old.grpc_port, metrics_port=old.metrics_port,
                exit_timeout=old.exit_timeout,
                binary=None if old.backend_dir else Path(old.binary))
    new.supervisor_pid, new.max_restarts = os.getpid(), old.max_restarts
    new.restarts = old.restarts + 1
    write_state(state_dir, new)
    return new


def run(state_dir: Path, repository: str) -> int:
    """Watch the deployment until it is stopped (0), or give up (1); a signal stops it (see
    the module's docstring)."""
    with guard(state_dir):
        return _watch(state_dir, repository)


def _watch(state_dir: Path, repository: str) -> int:
    attempts, cause = 0, None
    refreshed = 0.0
    # `spawn` records this supervisor right after starting it: wait for that record.
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and (st := read_state(state_dir)) is not None and \
            st.supervisor_pid is None:
        time.sleep(0.05)
    while True:
        state = read_state(state_dir)
        if state is None or state.repository != repository or \
                state.supervisor_pid != os.getpid():
            return 0  # stopped, or another deploy took over
        why = problem(state)
        if why is None:
            attempts, cause = 0, None
            if time.monotonic() - refreshed > REFRESH_S:
                _record_new_models(state_dir, state)
                refreshed = time.monotonic()
            time.sleep(POLL_S)
            continue
        failed_at = time.time()
        cause = cause or why
        if ranks_only(state) and state.restarts < state.max_restarts:
            log.warning("%s; starting the rank group's workers again", why)
            restart_ranks(state_dir, state)
            continue
        log.warning("%s; stopping what is left of the deployment", why)
        _clear_but_record(state_dir, state)
        if state.restarts >= state.max_restarts:
            (state_dir / "supervisor.json").write_text(json.dumps(
                {"gave_up": f"{cause}; gave up after {state.restarts} restart(s) "
                            f"(deploy.max_restarts: {state.max_restarts})",
                 "at": failed_at}) + "\n")
            (state_dir / "server.json").unlink(missing_ok=True)
            log.error("giving up after %d restart(s)", state.restarts)
            return 1
        if attempts:
            time.sleep(min(2 ** attempts, 10))
        attempts += 1
        try:
            new = restart(state_dir, state)
            log.warning("restarted tritonserver (pid %d) in %.1fs", new.pid,
                        time.time() - failed_at)
        except ServerError as e:
            log.error("restart failed: %s", e.message)
            cause = f"{cause}; the restart failed: {e.message}"
            state.restarts += 1
            state.pid = -1
            write_state(state_dir, state)


def _clear_but_record(state_dir: Path, state: ServerState) -> None:
    """Kill what is left of a failed server (and remove its shared memory), keeping the
    record that the restart reads."""
    clear(state_dir)
    write_state(state_dir, state)


def foreground(state_dir: Path, state: ServerState, max_restarts: int,
               echo: Callable[[str], None]) -> int:
    """``moepipe serve``: watch a server started in the foreground as the detached supervisor
    does - a dead server or model process gets the deployment killed and restarted, up to
    ``max_restarts`` times - until giving up (exit 1, nothing left running). A signal stops
    the deployment and is raised again (:class:`moepipe.utils.interrupt.Interrupted`)."""
    refreshed = time.monotonic()
    with guard(state_dir):
        while True:
            why = problem(state)
            if why is None:
                if time.monotonic() - refreshed > REFRESH_S:
                    _record_new_models(state_dir, state)
                    refreshed = time.monotonic()
                time.sleep(POLL_S)
                continue
            if ranks_only(state) and state.restarts < max_restarts:
                echo(f"{why}; starting the rank group's workers again "
                     f"({state.restarts + 1} of {max_restarts})")
                state = restart_ranks(state_dir, state)
                continue
            if state.restarts >= max_restarts:
                clear(state_dir)
                echo(f"{why}; gave up after {state.restarts} restart(s) (--max-restarts "
                     f"{max_restarts})")
                return 1
            _clear_but_record(state_dir, state)
            failed_at = time.monotonic()
            echo(f"{why}; restarting ({state.restarts + 1} of {max_restarts})")
            try:
                state = restart(state_dir, state)
            except ServerError as e:
                echo(f"the restart failed: {e.message}")
                return 1
            echo(f"serving again after {time.monotonic() - failed_at:.1f}s "
                 f"(tritonserver pid {state.pid})")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s moepipe supervisor: %(message)s")
    with interrupt.handled():
        try:
            code = run(Path(sys.argv[1]), sys.argv[2])
        except interrupt.Interrupted as e:
            log.warning("%s: stopped the deployment", e.line)
            code = e.exit_code
    sys.exit(code)


if __name__ == "__main__":
    main()
