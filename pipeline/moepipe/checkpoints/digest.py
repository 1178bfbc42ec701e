"""File digests: BLAKE3, named wherever one is recorded.

Every digest moepipe records of a file (converter manifests, stage records, the build manifest,
the hash cache) is BLAKE3 under a key that names it (``"blake3"``): nothing compares these
digests with a digest computed elsewhere, and BLAKE3 costs about 0.2 CPU-seconds per GB here
against 0.6 for sha256 (``benchmarks/convert_bench.py``; the converter hashes its input and its
output). Records written by older moepipe versions name ``"sha256"`` and are still checked with
it (:func:`file_digest`).

Files are hashed where their bytes lie: the page cache is mapped a window at a time and hashed
in place (:func:`update_from_fd`), never copied into a buffer first (a read costs a quarter of
the hashing again).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import blake3

ALGORITHM = "blake3"
ALGORITHMS = ("blake3", "sha256")  # what recorded digests may name (sha256: older records)
WINDOW = 64 << 20  # bytes mapped at a time: bounds the resident pages a digest maps
_BLOCK = 1 << 20


def new_hasher():
    """A streaming hasher of :data:`ALGORITHM` (``update`` releases the GIL)."""
    return blake3.blake3()


def update_from_fd(h, fd: int, start: int, end: int) -> None:
    """Feed bytes ``[start, end)`` of the open (readable) file ``fd`` to the hasher ``h``,
    mapping the page cache :data:`WINDOW` bytes at a time and hashing it in place; where the
    file cannot be mapped (some FUSE or network filesystems) it is read in 1 MiB blocks."""
    pos = start
    while pos < end:
        base = pos - pos % mmap.ALLOCATIONGRANULARITY
        size = min(end, base + WINDOW) - base
        try:
            window = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                               offset=base)
        except (OSError, ValueError):
            _update_by_reading(h, fd, pos, end)
            return
        try:
            window.madvise(mmap.MADV_WILLNEED)  # from disk: read the window ahead, not by faults
            view = memoryview(window)
            part = view[pos - base:]
            h.update(part)
            part.release()
            view.release()
        finally:
            window.close()
        pos = base + size


def _update_by_reading(h, fd: int, pos: int, end: int) -> None:
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    while pos < end:
        n = os.preadv(fd, [view[:min(_BLOCK, end - pos)]], pos)
        if n <= 0:
            raise OSError(f"file ended at byte {pos} while hashing (expected {end})")
        h.update(view[:n])
        pos += n


def file_digest(path: Path, algorithm: str = ALGORITHM) -> str:
    """Hex digest of the file's bytes (hashed in place, see :func:`update_from_fd`)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}")
    h = new_hasher() if algorithm == "blake3" else hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        update_from_fd(h, fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return h.hexdigest()
