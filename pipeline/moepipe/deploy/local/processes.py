"""The processes of one deployment, found from ``/proc`` by what started them.

Every process moepipe starts for a local deployment - the server, the supervisor - is started
with :func:`tagged`'s environment: :data:`DEPLOYMENT_ENV` names the deployment's state folder.
Whatever those start in turn inherits it (Triton's Python backend stubs, worker ranks, an
``mpirun`` and its children), and ``/proc/<pid>/environ`` keeps it for the process's life: also
when its parent died (stubs of a SIGKILLed server are re-parented to PID 1) and when
``server.json`` is lost. No other deployment's processes carry it - a ``moepipe serve`` of the
same repository, another workdir's server on the same machine - so stop, status, the supervisor
and the next deploy act on exactly the processes this deployment started.

A new kind of child joins the deployment by being started with :func:`tagged`'s environment
(or by any process that has it): :func:`deployment_processes` lists it (kind ``"child"`` unless
it is a server, stub or supervisor) and every stop kills it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SERVER_NAME = "tritonserver"
STUB_NAME = "triton_python_backend_stub"
SUPERVISOR_MODULE = "moepipe.deploy.local.supervisor"
DEPLOYMENT_ENV = "MOEPIPE_DEPLOYMENT"
KINDS = ("supervisor", "server", "stub", "rank", "child")
RANK_MODULE = "moepipe.ranks.worker"  # its MODULE (not imported here: it loads torch)


@dataclass(frozen=True)
class Proc:
    pid: int
    pgid: int
    kind: str  # one of KINDS
    argv: tuple[str, ...]

    @property
    def model(self) -> str | None:
        """A stub's model instance (e.g. ``tensorrt_llm_0_0``)."""
        return self.argv[8] if self.kind == "stub" and len(self.argv) > 8 else None

    @property
    def server_pid(self) -> int | None:
        """The server that started a stub (Triton passes its pid on the stub's command line:
        python_backend src/stub_launcher.cc, ``StubLauncher::Launch``)."""
        if self.kind != "stub" or len(self.argv) <= 5 or not self.argv[5].isdigit():
            return None
        return int(self.argv[5])

    def option(self, name: str) -> str | None:
        """``--name=value`` of a server's command line."""
        prefix = f"--{name}="
        return next((a[len(prefix):] for a in self.argv if a.startswith(prefix)), None)


def tagged(env: Mapping[str, str], state_dir: Path) -> dict[str, str]:
    """``env`` for a process of the deployment kept in ``state_dir``."""
    return {**env, DEPLOYMENT_ENV: deployment_id(state_dir)}


def deployment_id(state_dir: Path) -> str:
    return str(Path(state_dir).resolve())


def _kind(argv: tuple[str, ...]) -> str:
    name = os.path.basename(argv[0])
    if name == SERVER_NAME:
        return "server"
    if name == STUB_NAME:
        return "stub"
    if RANK_MODULE in argv:
        return "rank"
    return "supervisor" if SUPERVISOR_MODULE in argv else "child"


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
    return Proc(pid, int(fields[2]), _kind(argv), argv)


def _tag(pid: int) -> str | None:
    """The deployment a process belongs to (None: none, or not ours to read)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    key = DEPLOYMENT_ENV.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode(errors="replace")
    return None


def _pids() -> list[int]:
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != me]


def deployment_processes(state_dir: Path) -> list[Proc]:
    """Every live process of the deployment kept in ``state_dir`` (this process excepted):
    supervisor first, then the server, its stubs, any other child."""
    want = deployment_id(state_dir)
    found = [p for pid in _pids() if _tag(pid) == want and (p := _read(pid)) is not None]
    return sorted(found, key=lambda p: KINDS.index(p.kind))


def servers_of(repository: Path) -> list[tuple[Proc, str | None]]:
    """Live ``tritonserver`` processes serving ``repository``, whoever started them, each with
    its deployment's state folder (None: not started by moepipe)."""
    repo = str(Path(repository).resolve())
    found = []
    for pid in _pids():
        proc = _read(pid)
        if proc is not None and proc.kind == "server":
            served = proc.option("model-repository")
            if served is not None and os.path.realpath(served) == repo:
                found.append((proc, _tag(pid)))
    return found


def triton_processes() -> list[Proc]:
    """Every live Triton server and Python backend stub on the machine, whoever started it."""
    return [p for pid in _pids() if (p := _read(pid)) is not None and p.kind in ("server", "stub")]


def catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler installed for ``signum`` (SigCgt of /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines()
                 if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live server, stub or supervisor (a recorded pid that a finished
    process left and another program took over is not)."""
    proc = _read(pid)
    return proc is not None and proc.kind != "child"


def freeze(procs: list[Proc]) -> None:
    """SIGSTOP ``procs`` (before :func:`kill_all`: what they hold can be read unchanged)."""
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            pass


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
        while _read(pid) is not None and time.monotonic() < deadline:
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
