"""Atomic output folders: write into a temporary sibling, rename into place when complete."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moepipe.errors import MoepipeError
from moepipe.utils.bounded import MiB, ReadError, file_kind, loads_json, read_file
from moepipe.utils.oserrors import DiskError, describe_os_error

# The build's record in a finished stage's folder (written by moepipe.stages.integrity):
# bookkeeping, not model data, so digests of a folder's model files leave it out.
STAGE_FILE = "moepipe-stage.json"
# A JSON file moepipe reads whole (config.json, a safetensors index, a stage record): far above
# any real one (DeepSeek-V3's safetensors index is 9 MB).
JSON_LIMIT = 64 * MiB


def cache_root() -> Path:
    """moepipe's per-machine cache: ``$MOEPIPE_CACHE_DIR``, else ``~/.cache/moepipe``."""
    root = os.environ.get("MOEPIPE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moepipe")
    return Path(root)


def check_output(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise MoepipeError(f"{path}: already exists", "pass --overwrite to replace it")
    if path.exists() and not path.is_dir():
        raise MoepipeError(f"{path}: exists and is not a directory")
    parent = path.parent
    if not parent.exists():
        raise MoepipeError(f"{parent}: parent directory does not exist")
    if not os.access(parent, os.W_OK):
        raise MoepipeError(f"{parent}: not writable")


@contextlib.contextmanager
def atomic_dir(path: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``path``; on success it replaces ``path`` atomically,
    on any error (or a signal: :mod:`moepipe.utils.interrupt`) it is removed and ``path`` is
    left as it was. Temporary folders that killed runs (SIGKILL, a power cut) left next to
    ``path`` are removed first."""
    path = Path(path)
    check_output(path, overwrite)
    remove_stale_partials(path)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_partial_prefix(path)}{os.getpid()}-",
                                dir=path.parent))
    owner = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)  # held while the folder is written: not stale
        yield tmp
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / "x")
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(owner)


def _partial_prefix(path: Path) -> str:
    return f".{path.name}.partial-"


def remove_stale_partials(path: Path) -> list[Path]:
    """Remove the temporary folders of :func:`atomic_dir` runs for ``path`` that were killed:
    those whose process (named in the folder's name) is gone and whose lock nobody holds.
    A folder of a run in progress - this machine's or, on a shared filesystem, another's -
    is left alone. Returns the folders removed."""
    prefix = _partial_prefix(path)
    removed: list[Path] = []
    try:
        candidates = [p for p in path.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for folder in candidates:
        pid = folder.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and _running(int(pid)):
            continue
        try:
            fd = os.open(folder, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its writer holds it
            continue
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file beside it, synced,
    then renamed over it. On any failure (a full disk, Ctrl-C) the temporary file is removed
    and ``path`` is left as it was. A path that exists and is not a regular file (a symbolic
    link, a named pipe, a device, a folder) is refused, not replaced; errors name ``path``."""
    path = Path(path)
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise describe_os_error(OSError(e.errno, e.strerror, str(path))) from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise DiskError(f"{path}: is {file_kind(st.st_mode)}; moepipe writes regular files "
                        "and does not replace it", "remove it, or choose another path")
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise describe_os_error(OSError(e.errno, e.strerror, str(path))) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0o22)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def tail_lines(path: Path, lines: int, skip: tuple[str, ...] = ()) -> str:
    """The last ``lines`` lines of a log file (without lines containing any of ``skip``);
    empty when it cannot be read."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([line for line in text if not any(s in line for s in skip)][-lines:])


def read_json(path: Path, what: str, limit: int = JSON_LIMIT) -> dict[str, Any]:
    """A JSON object from ``path`` (at most ``limit`` bytes); a CheckpointError naming the
    file when it is missing, corrupt, too large or not an object."""
    from moepipe.errors import CheckpointError

    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: not found", f"{what} must contain it")
    try:
        data = loads_json(read_file(path, limit, "JSON file"), str(path))
    except ReadError as e:
        raise CheckpointError(e.message, e.hint or "the file is corrupt") from None
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
            type(data), "a number")
        raise CheckpointError(f"{path}: expected a JSON object, not {kind}")
    return data
