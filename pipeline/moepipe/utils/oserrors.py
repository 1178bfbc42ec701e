"""Operating-system failures as one-line user errors: a read-only or full disk, a path that is
a file where a folder is needed, missing permissions. The CLI turns any ``OSError`` that
reaches it into one of these; :func:`check_disk_space` refuses to start a stage whose output
cannot fit."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from moepipe.errors import MoepipeError


class DiskError(MoepipeError):
    """The filesystem refused a write: full, read-only, not a folder, or not permitted."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer can still use on the filesystem holding ``path``."""
    return shutil.disk_usage(_existing_parent(path)).free


def describe_os_error(e: OSError, needed: int | None = None) -> DiskError:
    """The user error for ``e`` (``needed``: bytes the failed step wanted to write, if known)."""
    path = e.filename or "(unknown path)"
    reason = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        where = _existing_parent(Path(path)) if e.filename else None
        free = f"{_gib(free_bytes(where))} free" if where else "the disk is full"
        need = f"; the step needs about {_gib(needed)}" if needed else ""
        return DiskError(f"{path}: no space left on device ({free}{need})",
                         f"free space on the filesystem of {where or 'the workdir'}, or set "
                         "`workdir:` in moepipe.yaml to a larger disk")
    if e.errno == errno.EROFS:
        return DiskError(f"{path}: read-only file system",
                         "set `workdir:` in moepipe.yaml to a writable folder")
    if e.errno in (errno.EACCES, errno.EPERM):
        return DiskError(f"{path}: permission denied",
                         "choose a folder you can write (`workdir:` in moepipe.yaml) or fix "
                         "its permissions")
    if e.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return DiskError(f"{path}: {reason.lower()}",
                         "a file is in the way of a folder moepipe needs (or the reverse); "
                         "move it, or choose another path")
    return DiskError(f"{path}: {reason}")


def check_workdir(workdir: Path) -> None:
    """Refuse a workdir that cannot be one before anything is written into it."""
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise DiskError(f"workdir {workdir}: exists and is not a directory",
                        "set `workdir:` in moepipe.yaml to a folder (it is created if missing)")
    parent = _existing_parent(workdir)
    if not parent.is_dir():
        raise DiskError(f"workdir {workdir}: {parent} is a file, not a directory",
                        "set `workdir:` in moepipe.yaml to a folder")
    if not os.access(parent, os.W_OK):
        raise DiskError(f"workdir {workdir}: {parent} is not writable",
                        "set `workdir:` in moepipe.yaml to a writable folder")


def check_disk_space(where: Path, needed: int, what: str) -> None:
    """Refuse to start writing ``needed`` bytes under ``where`` when they do not fit."""
    free = free_bytes(where)
    if needed > free:
        raise DiskError(f"{what} needs about {_gib(needed)} in {_existing_parent(where)}; only "
                        f"{_gib(free)} is free there",
                        "free space, or set `workdir:` in moepipe.yaml to a larger disk")
