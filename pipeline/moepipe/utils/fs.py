"""Atomic output folders: write into a temporary sibling, rename into place when complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from moepipe.errors import MoepipeError


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
    on any error (or Ctrl-C) it is removed and ``path`` is left as it was."""
    path = Path(path)
    check_output(path, overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
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


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
