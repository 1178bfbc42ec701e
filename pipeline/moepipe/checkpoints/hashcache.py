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
    """sha256 of ``path`` (hex), from the cache when the file is unchanged."""
    path = Path(path).resolve()
    cache = cache_file()
    key, sig = str(path), _signature(path)
    entry = _load(cache).get(key)
    if entry and entry.get("stat") == sig:
        return entry["sha256"]
    digest = sha256_file(path)
    if _signature(path) != sig:  # changed while hashing: do not remember
        return digest
    with _lock:
        data = _load(cache)
        data[key] = {"stat": sig, "sha256": digest}
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(cache, json.dumps(data))
        except OSError:
            pass  # a read-only home only costs time
    return digest
