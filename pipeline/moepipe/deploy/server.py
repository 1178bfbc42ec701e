"""A real ``tritonserver`` process: found, started on loopback, watched, stopped by PID.

The server is ``tritonserver`` from PATH when there is one (NVIDIA's containers), else the one
shipped in ``nvidia-pytriton``, started with a backend folder of symlinks to its Python backend.
Python models see the running interpreter's environment: its ``bin`` goes first on PATH and its
``libpython`` on LD_LIBRARY_PATH (the backend stub may otherwise load a different libpython).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from moepipe.deploy.state import (  # noqa: F401 (the names callers import from here)
    STATE_FILE,
    ServerError,
    ServerState,
    read_state,
    write_state,
)
from moepipe.errors import EnvironmentMissing
from moepipe.utils.fs import tail_lines

LOG_FILE = "tritonserver.log"
# Lines of the server log that are noise on a machine without a GPU.
_HARMLESS = ("CudaDriverHelper", "unable to create stream", "CUDA driver",
             "Unable to get GPU count", "GPU metrics")


@dataclass
class TritonBinary:
    path: Path
    backend_dir: Path | None  # None: the server's default backends


def find_tritonserver(explicit: Path | None, state_dir: Path) -> TritonBinary:
    if explicit is not None:
        if not (explicit.is_file() and os.access(explicit, os.X_OK)):
            raise EnvironmentMissing(f"{explicit}: not an executable tritonserver",
                                     "fix deploy.tritonserver or remove it")
        return TritonBinary(explicit, None)
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonBinary(Path(on_path), None)
    try:
        import pytriton
    except ImportError:
        raise EnvironmentMissing(
            "no tritonserver on PATH and nvidia-pytriton is not installed",
            "pip install nvidia-pytriton==0.7.0, or run inside NVIDIA's Triton container") \
            from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not binary.is_file() or not stub.is_file():
        raise EnvironmentMissing(f"nvidia-pytriton has no tritonserver / Python {py} backend "
                                 "stub", "use Python 3.8-3.13, or a tritonserver on PATH")
    # The stub must sit in <backend_dir>/python; symlinks keep its RPATH to pytriton's libs.
    backend = state_dir / "backends"
    py_dir = backend / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    for src in (root / "backends" / "python" / "libtriton_python.so",
                root / "backends" / "python" / "triton_python_backend_utils.py", stub):
        link = py_dir / src.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return TritonBinary(binary, backend)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    libdir = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir:
        env["LD_LIBRARY_PATH"] = libdir + (os.pathsep + env["LD_LIBRARY_PATH"]
                                           if env.get("LD_LIBRARY_PATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"  # the deployment never downloads
    return env


def check_port(host: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                       socket.SOCK_STREAM) as s:
        # Like the server, ignore connections lingering in TIME_WAIT; a listener still fails.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as e:
            raise ServerError(f"{what} port {port} on {host} is not available ({e.strerror})",
                              f"stop whatever uses it or choose another deploy.{what}_port") \
                from None


def _alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return b"tritonserver" in cmdline and ") Z " not in stat


def status(state_dir: Path, repository: Path | None = None) -> dict:
    """See :func:`moepipe.deploy.lifecycle.status`."""
    from moepipe.deploy.lifecycle import status as _status

    return _status(state_dir, repository)


def log_tail(log: Path, lines: int = 15) -> str:
    """The useful end of the server log (Triton's harmless warnings left out)."""
    return tail_lines(log, lines, skip=_HARMLESS)


def failure_reason(log: Path) -> str | None:
    """The most telling error line of a failed start."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for needle in ("failed to load", "already in use", "Failed to initialize Python stub",
                   "error: creating server", "failed to start"):
        for line in text:
            if needle in line:
                reason = line.split('] "', 1)[-1].split("\\n")[0]
                return reason.strip().rstrip('"').strip()
    return None


# Stack size of the server's threads (glibc takes a new thread's default from RLIMIT_STACK).
# Triton's HTTP frontend (libevhtp) parses an ``application/x-www-form-urlencoded`` body (curl
# -d sends that content type) into two variable-length arrays of the body's size on the
# stack: with the usual 8 MiB, a body over ~4 MB overflows it and the server dies of SIGSEGV
# (evhtp_parse_query_wflags). Measured on Triton 2.51 (empty repository, form body of N MB):
# 64 MiB stacks survive 20 MB and die at 40 MB; 1 GiB stacks survive 400 MB and die at 900 MB.
# 1 GiB is address space reserved per thread, not memory (pages are touched only by such a
# request), and under the kernel's default overcommit heuristic one such reservation is
# refused only on a machine with less than 1 GiB of RAM + swap. JSON bodies never take this path.
SERVER_STACK_BYTES = 1 << 30


def _server_limits() -> None:
    """In the child, before exec: the larger stack limit (never above the hard limit)."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    want = SERVER_STACK_BYTES if hard == resource.RLIM_INFINITY else min(SERVER_STACK_BYTES,
                                                                          hard)
    resource.setrlimit(resource.RLIMIT_STACK, (want, hard))


def _ready(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start(repository: Path, state_dir: Path, *, host: str, http_port: int, grpc_port: int,
          metrics_port: int, timeout: float = 180.0, exit_timeout: int = 30,
          binary: Path | None = None) -> ServerState:
    """Start tritonserver on ``repository`` and wait until it is ready."""
    state_dir.mkdir(parents=True, exist_ok=True)
    current = read_state(state_dir)
    if current is not None and _alive(current.pid):
        raise ServerError(f"a server is already running for this workdir (pid {current.pid}, "
                          f"http {current.http})", "run `moepipe stop` first")
    for what, port in (("http", http_port), ("grpc", grpc_port), ("metrics", metrics_port)):
        check_port(host, port, what)
    triton = find_tritonserver(binary, state_dir)
    log = state_dir / LOG_FILE
    cmd = [str(triton.path), f"--model-repository={repository}",
           f"--http-address={host}", f"--http-port={http_port}",
           f"--grpc-address={host}", f"--grpc-port={grpc_port}",
           f"--metrics-address={host}", f"--metrics-port={metrics_port}",
           "--allow-metrics=true", "--allow-gpu-metrics=false",
           "--metrics-config=summary_latencies=true",
           f"--exit-timeout-secs={exit_timeout}", "--log-verbose=0"]
    if triton.backend_dir is not None:
        cmd.append(f"--backend-directory={triton.backend_dir}")
    with open(log, "wb") as log_file:
        # Own session: Ctrl-C in the terminal reaches moepipe, which stops the server (and
        # its backend stubs, which share its process group) by PID.
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=server_env(),
                                start_new_session=True, preexec_fn=_server_limits)
    state = ServerState(pid=proc.pid, host=host, http_port=http_port, grpc_port=grpc_port,
                        metrics_port=metrics_port, repository=str(repository), log=str(log),
                        binary=str(triton.path), started=time.time(), exit_timeout=exit_timeout,
                        backend_dir=str(triton.backend_dir) if triton.backend_dir else None)
    (state_dir / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _kill_group(proc.pid)  # backend stubs it started may outlive it
            (state_dir / STATE_FILE).unlink(missing_ok=True)
            reason = failure_reason(log) or f"exit code {proc.returncode}"
            raise ServerError(f"tritonserver exited during start: {reason}",
                              f"full log: {log}", details=log_tail(log))
        if _ready(host, http_port):
            from moepipe.deploy.processes import deployment_processes

            # The model processes, so that one that dies later is noticed.
            state.models = {p.model: p.pid for p in deployment_processes(repository, proc.pid)
                            if p.kind == "stub" and p.model}
            write_state(state_dir, state)
            return state
        time.sleep(0.25)
    _terminate(proc.pid, exit_timeout)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    raise ServerError(f"tritonserver was not ready after {timeout:.0f}s (stopped it)",
                      f"raise deploy.ready_timeout_s, or see {log}", details=log_tail(log))


def terminate(pid: int, grace: float) -> bool:
    """Stop a foreground server: SIGTERM, SIGKILL after ``grace`` seconds, and what is left
    of its process group."""
    return _terminate(pid, grace)


def _terminate(pid: int, grace: float) -> bool:
    """SIGTERM, then SIGKILL after ``grace`` seconds; either way, backend stubs left in the
    server's process group (its session, see :func:`start`) are killed afterwards."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    graceful = False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _alive(pid):
            graceful = True
            break
        time.sleep(0.1)
    _kill_group(pid)
    _reap(pid)
    return graceful


def _kill_group(pgid: int, wait: float = 10.0) -> None:
    """SIGKILL what is left of the server's process group (pgid == the server's pid: it leads
    its own session) and wait until it is gone."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop(state_dir: Path, grace: float | None = None, repository: Path | None = None) -> dict:
    """Stop the workdir's server and every process of its deployment; see
    :func:`moepipe.deploy.lifecycle.stop`."""
    from moepipe.deploy.lifecycle import stop as _stop

    return _stop(state_dir, repository, grace)
