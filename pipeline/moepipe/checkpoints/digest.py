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
import os
from pathlib import Path

import blake3

ALGORITHM = "blake3"
ALGORITHMS = ("blake3", "sha256")  # what recorded digests may name (sha256: older records)
BLOCK = 1 << 20  # bytes read and hashed at a time


def new_hasher():
    """A streaming hasher of :data:`ALGORITHM` (``update`` releases the GIL)."""
    return blake3.blake3()


def update_from_fd(h, fd: int, start: int, end: int, buf: bytearray | None = None) -> None:
    """Feed bytes ``[start, end)`` of the open file ``fd`` to the hasher ``h``, read in blocks
    into one reused buffer (``buf``, or a new one of :data:`BLOCK` bytes): it stays in the
    CPU's cache between the read and the hash. Hashing mapped pages in place instead was
    measured slower here while the converter's other threads ran (a whole conversion: 1.00-1.10
    against 0.91-0.95 CPU-s/GB): the page faults cost more than this copy."""
    if buf is None:
        buf = bytearray(min(BLOCK, max(end - start, 0)))
    view = memoryview(buf)
    pos = start
    while pos < end:
        n = os.preadv(fd, [view[:min(len(view), end - pos)]], pos)
        if n <= 0:
            raise OSError(f"file ended at byte {pos} while hashing (expected {end})")
        h.update(view[:n])
        pos += n


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """Hex digest of the file's bytes (read once, see :func:`update_from_fd`)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}")
    h = new_hasher() if algorithm == "blake3" else hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        update_from_fd(h, fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return h.hexdigest()
