"""File digests (BLAKE3, see :mod:`moepipe.checkpoints.digest`), remembered by stat signature.

Hashing a 100 GB checkpoint takes minutes; its digests are needed by every conversion and by the
build's fingerprints. A digest is reused while the file's (device, inode, size, mtime_ns) are
unchanged - the signal build systems and git's index trust - and recomputed otherwise. The
cache lives in ``$MOEPIPE_CACHE_DIR`` (default ``~/.cache/moepipe``); losing it costs time only.
Entries name their algorithm; the sha256 cache of older versions (``sha256.json``) is not read.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from moepipe.checkpoints.digest import ALGORITHM
from moepipe.checkpoints.digest import file_digest as _hash_file
from moepipe.utils.fs import cache_root, write_text_atomic

_lock = threading.Lock()
_SIG = "stat:"  # keys of entries found by stat signature alone (see remember)


def cache_file() -> Path:
    return cache_root() / "digests.json"


def _signature(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _load(path: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def lookup(path: Path) -> str | None:
    """The remembered digest of ``path`` if the file is unchanged since (found under its path,
    or by its stat signature when :func:`remember` recorded it under another path); None
    otherwise. Reads nothing but the cache and a ``stat``."""
    path = Path(path).resolve()
    data = _load(cache_file())
    sig = _signature(path)
    entry = data.get(str(path)) or data.get(_SIG + sig)
    if entry and entry.get("stat") == sig and isinstance(entry.get(ALGORITHM), str):
        return entry[ALGORITHM]
    return None


def cached_digest(path: Path) -> str:
    """BLAKE3 of ``path`` (hex), from the cache when the file is unchanged; computed and
    remembered otherwise."""
    path = Path(path).resolve()
    cached = lookup(path)
    if cached is not None:
        return cached
    sig = _signature(path)
    digest = _hash_file(path)
    if _signature(path) != sig:  # changed while hashing: do not remember
        return digest
    _store({str(path): {"stat": sig, ALGORITHM: digest}})
    return digest


def remember(path: Path, digest: str) -> None:
    """Record the digest of a file just written by a writer that hashed its bytes as they
    passed, so that nothing reads it again to hash it. Kept under its stat signature too: the
    build renames finished outputs into place, which keeps device, inode, size and mtime."""
    path = Path(path).resolve()
    sig = _signature(path)
    entry = {"stat": sig, ALGORITHM: digest}
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
