"""File digests: BLAKE3, named wherever one is recorded.

Every digest moepipe records of a file (converter manifests, stage records, the build manifest,
the hash cache) is BLAKE3 under a key that names it (``"blake3"``): nothing compares these
digests with a digest computed elsewhere, and BLAKE3 costs about 0.2 CPU-seconds per GB here
against 0.6 for sha256 (``benchmarks/convert_bench.py``; the converter hashes its input and its
output). Records written by older moepipe versions name ``"sha256"`` and are still checked with
it (:func:`file_digest`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import blake3

ALGORITHM = "blake3"
ALGORITHMS = ("blake3", "sha256")  # what recorded digests may name (sha256: older records)
_BLOCK = 1 << 20


def new_hasher():
    """A streaming hasher of :data:`ALGORITHM` (``update`` releases the GIL)."""
    return blake3.blake3()


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """Hex digest of the file's bytes (read once, in 1 MiB blocks)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}")
    h = new_hasher() if algorithm == "blake3" else hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
