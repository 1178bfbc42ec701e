"""The processes of one deployment, found from ``/proc`` rather than trusted from a pid file.

A deployment is a ``tritonserver`` started on a model repository, the Python backend stubs it
forks (one per model instance; their command lines name the repository), the worker ranks of a
rank group (``--deployment REPO``) and moepipe's supervisor (its command line names the
repository too). Stubs outlive a server killed with
SIGKILL (they are re-parented to PID 1) and a lost ``server.json`` loses nothing that ``/proc``
does not still say, so stop, status and the next deploy look here.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

SERVER_NAME = "tritonserver"
STUB_NAME = "triton_python_backend_stub"
SUPERVISOR_MODULE = "moepipe.deploy.local.supervisor"
RANK_MODULE = "moepipe.ranks.worker"  # its MODULE (not imported here: it loads torch)


@dataclass(frozen=True)
class Proc:
    pid: int
    pgid: int
    kind: str  # "server" | "stub" | "rank" | "supervisor"
    argv: tuple[str, ...]

    @property
    def model(self) -> str | None:
        """A stub's model instance (e.g. ``tensorrt_llm_0_0``)."""
        return self.argv[8] if self.kind == "stub" and len(self.argv) > 8 else None

    def option(self, name: str) -> str | None:
        """``--name=value`` of a server's command line."""
        prefix = f"--{name}="
        return next((a[len(prefix):] for a in self.argv if a.startswith(prefix)), None)


def _read(pid: int) -> Proc | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if not raw or fields[0] in ("Z", "X"):  # zombies are gone for every purpose here
        return None
    argv = tuple(a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0"))
    name = os.path.basename(argv[0])
    if name == SERVER_NAME:
        kind = "server"
    elif name == STUB_NAME:
        kind = "stub"
    elif SUPERVISOR_MODULE in argv:
        kind = "supervisor"
    elif RANK_MODULE in argv:
        kind = "rank"
    else:
        return None
    return Proc(pid, int(fields[2]), kind, argv)


def deployment_processes(repository: str | Path, pgid: int | None = None) -> list[Proc]:
    """Every live server, stub, worker rank and supervisor of the deployment serving
    ``repository`` (and of the process group ``pgid``, the recorded server's), ours or not yet
    reaped."""
    repo = str(repository).rstrip("/")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        proc = _read(int(entry))
        if proc is None:
            continue
        mine = any(a == repo or a.startswith(repo + "/") or a.endswith("=" + repo)
                   for a in proc.argv)
        if mine or (pgid is not None and proc.pgid == pgid and proc.kind != "supervisor"):
            found.append(proc)
    return sorted(found, key=lambda p: ("supervisor", "server", "stub", "rank").index(p.kind))


def alive(pid: int) -> bool:
    return _read(pid) is not None


def kill_all(procs: list[Proc], wait: float = 10.0) -> list[int]:
    """SIGKILL ``procs`` and wait until they are gone; returns the pids that were killed."""
    killed = []
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait
    for pid in killed:
        while alive(pid) and time.monotonic() < deadline:
            reap(pid)
            time.sleep(0.02)
        reap(pid)
    return killed


def reap(pid: int) -> None:
    """Collect a child that has exited (a no-op for anyone else's process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
