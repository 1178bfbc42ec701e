"""Which ``tritonserver`` runs a local deployment, with which environment and limits, and what
its log says when it fails (started and stopped by :mod:`moepipe.deploy.local.lifecycle`).

The server is ``tritonserver`` from PATH when there is one (NVIDIA's containers), else the one
shipped in ``nvidia-pytriton``, started with a backend folder of symlinks to its Python backend.
Python models see the running interpreter's environment: its ``bin`` goes first on PATH and its
``libpython`` on LD_LIBRARY_PATH (the backend stub may otherwise load a different libpython).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from moepipe.deploy.local.state import ServerError
from moepipe.deploy.tritonserver import SERVER_STACK_BYTES
from moepipe.errors import EnvironmentMissing
from moepipe.utils.fs import tail_lines

LOG_FILE = "tritonserver.log"
# Lines of the server log that are noise on a machine without a GPU.
_HARMLESS = ("CudaDriverHelper", "unable to create stream", "CUDA driver",
             "Unable to get GPU count", "GPU metrics")


def check_stub_numpy(version: str) -> None:
    """nvidia-pytriton's Python backend stub (Triton 2.51) returns empty output tensors when the
    models' environment has numpy 2: refuse to start it there rather than serve nothing."""
    if int(version.split(".")[0]) >= 2:
        raise EnvironmentMissing(
            f"numpy {version} is installed: the Triton server of nvidia-pytriton (the cpu "
            "target's, where none is on PATH) needs numpy < 2 in this environment",
            "pip install 'moepipe[cpu]' in a separate environment (it keeps numpy < 2), or "
            "run inside NVIDIA's Triton container")


@dataclass
class TritonBinary:
    path: Path
    backend_dir: Path | None  # None: the server's default backends


def find_tritonserver(explicit: Path | None, state_dir: Path) -> TritonBinary:
    """``explicit``, else the one on PATH, else nvidia-pytriton's (its Python backend linked
    into ``state_dir``)."""
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
            "pip install 'moepipe[cpu]', or run inside NVIDIA's Triton container") from None
    check_stub_numpy(importlib.metadata.version("numpy"))
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
    """The environment of the server and its Python models: this interpreter's."""
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
    """Refuse a port the server could not bind (named as ``deploy.<what>_port``)."""
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


def server_limits() -> None:
    """In the child, before exec: the larger stack limit (never above the hard limit)."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    want = SERVER_STACK_BYTES if hard == resource.RLIM_INFINITY else min(SERVER_STACK_BYTES,
                                                                          hard)
    resource.setrlimit(resource.RLIMIT_STACK, (want, hard))
