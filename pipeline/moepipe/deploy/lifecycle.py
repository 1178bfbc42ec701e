"""Status and stop of a deployment's server, from what the deploy recorded or, when
``server.json`` is gone, from the processes themselves.

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
(server, backend stubs that a killed server left behind, the supervisor) is gone when ``stop``
returns.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from moepipe.deploy import processes
from moepipe.deploy.state import STATE_FILE, ServerError, ServerState, read_state

# In-flight requests with no visible progress for this long are hung: stop without waiting.
NO_PROGRESS_S = 2.0
# Triton waiting for client connections or in-flight inferences while nothing progresses (no
# token, no finished request, no engine iteration) for this long is waiting in vain: an idle
# keep-alive connection, or a hung request whose engine never published it as running.
DRAIN_IDLE_S = 5.0
# Unloading that has not released a model for this long, with nothing in flight, is stuck
# (Python backends can take seconds to wind down on a busy machine; ensembles take none).
UNLOAD_STALL_S = 12.0
POLL_S = 0.25


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


def locate(state_dir: Path, repository: Path | None) -> tuple[ServerState | None, bool]:
    """(the deployment's server, whether ``server.json`` recorded it). Without a record, a
    running tritonserver on ``repository`` is found by its command line."""
    state = read_state(state_dir)
    if state is not None:
        return state, True
    if repository is None:
        return None, False
    servers = [p for p in processes.deployment_processes(repository) if p.kind == "server"]
    return (_found_state(servers[0], state_dir), False) if servers else (None, False)


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


def status(state_dir: Path, repository: Path | None = None) -> dict:
    """What runs for this workdir. ``running`` means serving: the server is up and none of
    its model processes has died."""
    state, recorded = locate(state_dir, repository)
    if state is None:
        failed = _failure(state_dir)
        return {"running": False, **({"failure": failed} if failed else {})}
    server_alive = processes.alive(state.pid)
    dead = dead_models(state) if server_alive else []
    info = state.to_status(server_alive and not dead)
    info.update(server_alive=server_alive, dead_models=dead, recorded=recorded,
                supervised=bool(state.supervisor_pid and processes.alive(state.supervisor_pid)))
    if not recorded:
        info["note"] = f"{STATE_FILE} is missing; found the server by its command line"
    failed = _failure(state_dir)
    if failed and not info["running"]:
        info["failure"] = failed
    return info


def _failure(state_dir: Path) -> str | None:
    try:
        return json.loads((state_dir / "supervisor.json").read_text()).get("gave_up")
    except (OSError, ValueError):
        return None


_METRIC = re.compile(r"^(\w+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")


def _metrics(state: ServerState) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"http://{state.metrics}/metrics", timeout=1) as r:
            text = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(2) != "NaN":
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(2))
    return sums


def _progress(state: ServerState) -> tuple[float, tuple] | None:
    """(requests in flight, a value that changes whenever any of them progresses)."""
    m = _metrics(state)
    if m is None:
        return None
    in_flight = m.get("moepipe_running_requests", 0) \
        + m.get("nv_inference_pending_request_count", 0)
    return in_flight, (m.get("moepipe_generated_tokens_total", 0),
                       m.get("nv_inference_request_success", 0),
                       m.get("nv_inference_request_failure", 0),
                       # TensorRT-LLM's backend: iteration counter and timestamp (per step)
                       m.get("nv_trt_llm_general_metrics", 0))


_LIVE = re.compile(r"Found (\d+) live models and 0 in-flight non-inference requests")
_UNLOADED = re.compile(r"successfully unloaded '([^']+)'")
_UNLOADING = "All models are stopped, unloading models"
_EXIT_TIMEOUT = "Exit timeout expired"
# Triton 2.51's shutdown countdowns (http_server.cc, grpc server, server.cc) while it waits.
_WAITING = re.compile(r"Found (\d+) (HTTP service connections|GRPC service connections|"
                      r"model versions that have in-flight inferences)")


class _ShutdownLog:
    """What Triton's log says about its shutdown since :meth:`__init__` (the SIGTERM)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.offset = path.stat().st_size
        except OSError:
            self.offset = 0
        self.live: int | None = None  # live models, from the latest countdown line
        self.live_since = time.monotonic()
        self.unloaded: list[str] = []
        self.unloading = False
        self.timed_out = False
        self.waiting_for: str | None = None  # what Triton's latest countdown waits for

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return
        cut = text.rfind("\n") + 1  # leave a half-written line for the next read
        self.offset += len(text[:cut].encode())
        for line in text[:cut].splitlines():
            self.unloading = self.unloading or _UNLOADING in line
            self.timed_out = self.timed_out or _EXIT_TIMEOUT in line
            if m := _WAITING.search(line):
                self.waiting_for = f"{m.group(1)} {m.group(2)}" if int(m.group(1)) else None
            if m := _UNLOADED.search(line):
                self.unloaded.append(m.group(1))
            if (m := _LIVE.search(line)) and int(m.group(1)) != self.live:
                self.live, self.live_since = int(m.group(1)), time.monotonic()

    def stuck(self, models: dict[str, bool]) -> bool:
        """Unloading with nothing in flight, and the live-model count has not moved for
        :data:`UNLOAD_STALL_S` - or, when only ensembles are left (they have no backend to
        wind down), for :data:`NO_PROGRESS_S`."""
        if not (self.unloading and self.live):
            return False
        left = [name for name in models if name not in self.unloaded]
        only_ensembles = bool(left) and all(models[name] for name in left)
        stalled = time.monotonic() - self.live_since
        return stalled > (NO_PROGRESS_S if only_ensembles else UNLOAD_STALL_S)


def _models(state: ServerState) -> dict[str, bool]:
    """Model name -> is it an ensemble, for the deployment's repository."""
    repo = Path(state.repository) if state.repository else None
    if repo is None or not repo.is_dir():
        return {}
    found = {}
    for config in sorted(repo.glob("*/config.pbtxt")):
        text = config.read_text(errors="replace")
        found[config.parent.name] = re.search(r'platform:\s*"ensemble"', text) is not None
    return found


def terminate(state: ServerState, grace: float) -> tuple[bool, str | None]:
    """SIGTERM, then SIGKILL when Triton's wait for in-flight requests is pointless (a model
    process died, or nothing progresses) or after ``grace``. Returns (graceful, why forced)."""
    dead = dead_models(state)
    if dead:  # requests routed to it can never finish: Triton would wait its exit timeout
        os.kill(state.pid, signal.SIGKILL)
        return False, f"model process {dead[0]} had died"
    before = _progress(state)
    models = _models(state)
    shutdown = _ShutdownLog(Path(state.log))
    try:
        os.kill(state.pid, signal.SIGTERM)
    except ProcessLookupError:
        return True, None
    deadline = time.monotonic() + grace
    last, since = before, time.monotonic()
    reason = f"still running after {grace:.0f}s"
    while time.monotonic() < deadline:
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
        now = _progress(state)
        if now is not None and last is not None and now[1] != last[1]:
            since = time.monotonic()
        if now is not None:
            last = now
        idle = time.monotonic() - since
        if now is not None and now[0] > 0 and idle > NO_PROGRESS_S:
            reason = f"{now[0]:.0f} request(s) in flight made no progress for {NO_PROGRESS_S:.0f}s"
            break
        if shutdown.waiting_for and not shutdown.unloading and idle > DRAIN_IDLE_S:
            reason = (f"Triton waited for {shutdown.waiting_for} while nothing progressed for "
                      f"{DRAIN_IDLE_S:.0f}s; killed instead of waiting {state.exit_timeout}s")
            break
        time.sleep(POLL_S)
    return False, reason


def stop(state_dir: Path, repository: Path | None = None, grace: float | None = None) -> dict:
    """Stop the deployment's server and every process that belongs to it."""
    state, recorded = locate(state_dir, repository)
    repo = Path(state.repository) if state is not None and state.repository else repository
    procs = processes.deployment_processes(repo, state.pid if state else None) if repo else []
    if state is None and not procs:
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        raise ServerError("no server is recorded or running for this workdir", "nothing to stop")
    # The supervisor first: it would restart what is being stopped.
    processes.kill_all([p for p in procs if p.kind == "supervisor"])
    running = state is not None and processes.alive(state.pid)
    graceful, forced = True, None
    if running and state is not None:
        graceful, forced = terminate(state, state.exit_timeout + 10 if grace is None else grace)
    # What is left: the server after SIGKILL, stubs a dead server left behind (same process
    # group, or naming the repository).
    left = processes.deployment_processes(repo, state.pid if state else None) if repo else []
    killed = processes.kill_all(left)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    pid = state.pid if state is not None else None
    return {"pid": pid, "was_running": running, "graceful": graceful, "forced": forced,
            "leftovers": len([k for k in killed if k != pid]),
            "recorded": recorded}
