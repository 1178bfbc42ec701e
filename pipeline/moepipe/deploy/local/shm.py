"""Triton's Python backend shared memory: one region in ``/dev/shm`` per backend stub, created by
the server and removed by it when it stops gracefully - never when it is killed (the
supervisor's restart, a forced stop, a crash), which leaked a region per stub on every restart.

A region's name is the server's own (python_backend src/stub_launcher.cc: a fresh name per stub,
passed on the stub's command line), and the server maps every region it created
(``/proc/<pid>/maps``). A deployment records its regions while it runs
(``ServerState.regions``) and removes them once its processes are gone. Regions of other
servers on the machine are not named, and a region that any live Triton server or stub still
maps is left alone (python_backend releases before 24.x named regions by a per-server counter,
the same names in every server).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from moepipe.deploy.local.processes import Proc, triton_processes

SHM = Path("/dev/shm")
_NAME = re.compile(r"^triton_python_backend_shm_region_[A-Za-z0-9_.-]+$")


def regions(procs: Iterable[Proc]) -> set[str]:
    """The shared-memory regions of these servers and stubs."""
    names: set[str] = set()
    for proc in procs:
        if proc.kind == "stub" and len(proc.argv) > 2:
            names.add(proc.argv[2])
        if proc.kind in ("server", "stub"):
            names |= _mapped(proc.pid)
    return {n for n in names if _NAME.match(n)}


def _mapped(pid: int) -> set[str]:
    try:
        lines = Path(f"/proc/{pid}/maps").read_text(errors="replace").splitlines()
    except OSError:
        return set()
    prefix = f"{SHM}/"
    return {line.split(prefix, 1)[1].split()[0] for line in lines if prefix in line}


def remove(names: Iterable[str]) -> list[str]:
    """Remove these regions (names that are not Triton's are ignored); returns those removed."""
    removed = []
    wanted = {n for n in names if _NAME.match(n)}  # a record is not trusted with paths
    if wanted:
        wanted -= regions(triton_processes())
    for name in sorted(wanted):
        try:
            (SHM / name).unlink()
            removed.append(name)
        except OSError:  # gone already: the server removed it (graceful stop)
            pass
    return removed
