"""sha256 of files, remembered by their stat signature.

Hashing a 100 GB checkpoint takes minutes; its digests are needed by every conversion and by the
build's fingerprints. A digest is reused while the file's (device, inode, size, mtime_ns) are
unchanged - the signal build systems and git's index trust - and recomputed otherwise. The
cache lives in ``$MOEPIPE_CACHE_DIR`` (default ``~/.cache/moepipe``); losing it costs time only.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from moepipe.checkpoints.st_io import sha256_file
from moepipe.utils.fs import cache_root, write_text_atomic

_lock = threading.Lock()
_SIG = "stat:"  # keys of entries found by stat signature alone (see remember)


def cache_file() -> Path:
    return cache_root() / "sha256.json"


def _signature(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _load(path: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def file_sha256(path: Path) -> str:
    """sha256 of ``path`` (hex), from the cache when the file is unchanged (found under its
    path, or by its stat signature when :func:`remember` recorded it under another path)."""
    path = Path(path).resolve()
    cache = cache_file()
    key, sig = str(path), _signature(path)
    data = _load(cache)
    entry = data.get(key) or data.get(_SIG + sig)
    if entry and entry.get("stat") == sig:
        return entry["sha256"]
    digest = sha256_file(path)
    if _signature(path) != sig:  # changed while hashing: do not remember
        return digest
    _store({key: {"stat": sig, "sha256": digest}})
    return digest


def remember(path: Path, digest: str) -> None:
    """Record the sha256 of a file just written by a writer that hashed its bytes as they
    passed, so that nothing reads it again to hash it. Kept under its stat signature too: the
    build renames finished outputs into place, which keeps device, inode, size and mtime."""
    path = Path(path).resolve()
    sig = _signature(path)
    entry = {"stat": sig, "sha256": digest}
    _store({str(path): entry, _SIG + sig: entry})


def _store(entries: dict[str, dict[str, str]]) -> None:
    cache = cache_file()
    with _lock:
        data = _load(cache)
        data.update(entries)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(cache, json.dumps(data))
        except OSError:
            pass  # a read-only home only costs time
