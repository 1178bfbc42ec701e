"""The least a first conversion can cost on this machine, against `cp -r` in the same run.

    python benchmarks/convert_floor.py [--gb 2.2] [--repeat 3] [--workdir DIR] [--keep]
        [--reuse-input]

A first conversion that records the manifest's digests must do three things with every byte:
hash the input file it is in (BLAKE3, ``source.blake3``), put it into the rank file (here a
tp=1 conversion, where the bytes are unchanged), and hash the rank file (``output.blake3``).
The two digests are of different byte streams (the rank file has its own header and order), so
neither can be derived from the other. This script times each of the three on its own, as bare
loops with no planning, no Python start-up and no converter around them, on the same synthetic
checkpoint as ``convert_bench.py``, with the page cache warm:

* ``copy``: the input's tensor bytes into one preallocated file with ``copy_file_range`` (the
  kernel copy ``cp`` uses; the converter's path for unchanged bytes);
* ``digest``: BLAKE3 of every input file, read in 1 MiB blocks (what the converter does for
  each of the two digests);
* ``cp -r`` of the same folder, just before.

From these it prints the floor: the CPU seconds of copy + 2 x digest, and the shortest wall time
those can take on this machine's cores (``max(longest single stream, total CPU / cores)``),
as a multiple of ``cp -r``'s wall time. A converter cannot beat that figure on this machine
however it is arranged; ``convert_bench.py`` measures what it actually takes.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_bench import make_checkpoint  # noqa: E402

from moepipe.checkpoints.digest import file_digest  # noqa: E402
from moepipe.checkpoints.st_io import parse_header, preallocate  # noqa: E402


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def warm(files: list[Path]) -> None:
    subprocess.run(["sync"], check=True)
    for f in files:
        f.read_bytes()
    subprocess.run(["sync"], check=True)


def time_cp(src: Path, dst: Path) -> tuple[float, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(["cp", "-r", str(src), str(dst)])
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit("cp -r failed")
    return wall, usage.ru_utime + usage.ru_stime


def time_copy(files: list[Path], out: Path) -> tuple[float, float]:
    """Every tensor's bytes, file by file in offset order, into one preallocated file."""
    spans = []
    for f in files:
        infos = parse_header(f)
        spans += [(f, i.offset, i.nbytes) for i in sorted(infos.values(), key=lambda i: i.offset)]
    total = sum(n for _, _, n in spans)
    c0, start = cpu_now(), time.perf_counter()
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    preallocate(fd, total)
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    for f, offset, nbytes in spans:
        done = 0
        while done < nbytes:
            n = os.copy_file_range(fds[f], fd, min(nbytes - done, 8 << 20), offset + done)
            if n <= 0:
                sys.exit("copy_file_range copied nothing (not supported here?)")
            done += n
    for src_fd in fds.values():
        os.close(src_fd)
    os.close(fd)
    return time.perf_counter() - start, cpu_now() - c0


def time_digest(files: list[Path]) -> tuple[float, float]:
    c0, start = cpu_now(), time.perf_counter()
    for f in files:
        file_digest(f)
    return time.perf_counter() - start, cpu_now() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.2, help="input size in GB (>= 2)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moepipe-convert-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--reuse-input", action="store_true",
                    help="reuse the input a --keep run left in --workdir")
    args = ap.parse_args()
    src = args.workdir / "hf"
    if not (args.reuse_input and (src / "config.json").is_file()):
        if args.workdir.exists():
            shutil.rmtree(args.workdir)
        make_checkpoint(src, args.gb * 1e9)
    files = sorted(src.glob("*.safetensors"))
    gb = sum(f.stat().st_size for f in files) / 1e9
    cores = len(os.sched_getaffinity(0))
    print(f"input: {gb:.2f} GB in {len(files)} shards; {cores} cores; page cache warm")
    print(f"{'cp -r s':>8} {'copy s':>7} {'digest s':>9} | CPU s/GB: {'cp':>5} {'copy':>5} "
          f"{'digest':>6} {'floor':>6} | floor wall s  floor/cp  load")
    floors = []
    for _ in range(args.repeat):
        load = os.getloadavg()[0]
        warm(files)
        cp_s, cp_cpu = time_cp(src, args.workdir / "copy")
        shutil.rmtree(args.workdir / "copy")
        warm(files)
        copy_s, copy_cpu = time_copy(files, args.workdir / "out.bin")
        (args.workdir / "out.bin").unlink()
        warm(files)
        dig_s, dig_cpu = time_digest(files)
        cpu = copy_cpu + 2 * dig_cpu
        floor_s = max(copy_s, dig_s, cpu / cores)
        floors.append(floor_s / cp_s)
        print(f"{cp_s:8.2f} {copy_s:7.2f} {dig_s:9.2f} | {'':10}{cp_cpu / gb:5.2f} "
              f"{copy_cpu / gb:5.2f} {dig_cpu / gb:6.2f} {cpu / gb:6.2f} | {floor_s:12.2f} "
              f"{floor_s / cp_s:9.2f} {load:5.1f}")
    print(f"floor of a first conversion with both digests: {min(floors):.2f}-{max(floors):.2f}x "
          f"cp -r on {cores} cores (before Python start-up and planning)")
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
