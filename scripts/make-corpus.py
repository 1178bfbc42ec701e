#!/usr/bin/env python3
"""Rebuild pipeline/moepipe/examples/pride-and-prejudice.txt from the Debian package it comes from.

Source: Jane Austen, "Pride and Prejudice" (1813; public domain), as shipped in the Debian
package r-cran-janeaustenr 1.0.0-1 (CRAN package janeaustenr by Julia Silge, MIT licence; its
texts are the Project Gutenberg editions). The novel's lines are stored in the package's R
lazy-load database (data/Rdata.rdb, one zlib-compressed R serialization per novel); this script
reads them without R, keeps chapters 1-36 (a few hundred KB), joins the hard-wrapped lines of each
paragraph and writes one paragraph per line.

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb pkg
    scripts/make-corpus.py pkg/usr/lib/R/site-library/janeaustenr/data
"""

from __future__ import annotations

import gzip
import re
import struct
import sys
import zlib
from pathlib import Path

CHAPTERS = 36
OUT = Path(__file__).resolve().parent.parent / "pipeline/moepipe/examples/pride-and-prejudice.txt"


def _index(rdx: bytes) -> dict[str, tuple[int, int]]:
    """Variable name -> (offset, length) in Rdata.rdb, from the serialized index list."""
    raw = gzip.decompress(rdx)
    symbols = re.findall(rb"\x00\x04\x00\x09\x00\x00\x00.([a-z]+)", raw, re.S)
    names = [s for s in symbols if s not in (b"names", b"variables", b"references", b"compressed")]
    pairs = re.findall(rb"\x00\x00\x00\x0d\x00\x00\x00\x02(.{8})", raw, re.S)
    if len(names) != len(pairs):
        raise SystemExit("unexpected Rdata.rdx layout")
    return {n.decode(): struct.unpack(">ii", p) for n, p in zip(names, pairs, strict=True)}


def _strings(blob: bytes) -> list[str]:
    """The character vector of one lazy-load entry (R serialization format, version 3)."""
    size = struct.unpack(">I", blob[:4])[0]
    raw = zlib.decompress(blob[4:])
    if len(raw) != size or raw[:2] != b"X\n":
        raise SystemExit("not an R XDR serialization")
    pos = 14
    (enc_len,) = struct.unpack(">i", raw[pos:pos + 4])
    pos += 4 + enc_len
    flags, count = struct.unpack(">ii", raw[pos:pos + 8])
    pos += 8
    if flags & 0xFF != 16:
        raise SystemExit("not a character vector")
    lines = []
    for _ in range(count):
        _, length = struct.unpack(">ii", raw[pos:pos + 8])
        pos += 8
        if length < 0:
            continue  # NA
        lines.append(raw[pos:pos + length].decode("utf-8"))
        pos += length
    return lines


def main(data_dir: str) -> None:
    folder = Path(data_dir)
    offset, length = _index((folder / "Rdata.rdx").read_bytes())["prideprejudice"]
    with open(folder / "Rdata.rdb", "rb") as f:
        f.seek(offset)
        text = "\n".join(_strings(f.read(length)))
    starts = [m.start() for m in re.finditer(r"^Chapter \d+$", text, re.M)]
    body = text[starts[0]:starts[CHAPTERS]]
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body)]
    OUT.write_text("\n".join(p for p in paragraphs if p) + "\n")
    print(f"{OUT}: {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
