"""The least a first conversion can cost on this machine, against `cp -r` in the same run.

    python benchmarks/convert_floor.py [--gb 2.2] [--repeat 3] [--workdir DIR] [--keep]
        [--reuse-input]

A first conversion that records the manifest's digests must do three things with every byte:
hash the input file it is in (BLAKE3, ``source.blake3``), put it into the rank file (here a
tp=1 conversion, where the bytes are unchanged), and hash the rank file (``output.blake3``).
The two digests are of different byte streams (the rank file has its own header, and stacks
each layer's experts in another order than the shards hold them), so neither can be derived
from the other. This script times each on its own, as bare loops with no planning and no
converter around them, on the same synthetic checkpoint as ``convert_bench.py``, page cache
warm, always giving the converter the cheapest way:

* ``copy``: the input's tensor bytes into one preallocated file, the cheaper of the kernel copy
  (``copy_file_range``, what ``cp`` uses) and ``pread`` + ``pwrite`` through a 512 KiB buffer;
* ``digest in``: BLAKE3 of every input file, read in 1 MiB blocks;
* ``digest out``: BLAKE3 of the same number of bytes already in memory (as if the rank file's
  digest were taken from the copy's buffer, with no read of its own);
* ``start``: a Python that imports what ``moepipe convert`` needs (``moepipe.cli`` and the
  convert stage), and exits;
* ``cp -r`` of the same folder, just before.

The floor is ``start + max(longest stream, CPU of the three streams / cores)``, as a multiple
of ``cp -r``'s wall time: no arrangement of these passes on this machine's cores can beat it.
Then the three are run together as threads, with either copy (``time_together``), to show what
an arrangement of them achieves before any planning; ``convert_bench.py`` measures what the
converter actually takes.
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_bench import make_checkpoint, timed  # noqa: E402

from moepipe.checkpoints.digest import file_digest, new_hasher  # noqa: E402
from moepipe.checkpoints.reader import parse_header
from moepipe.checkpoints.writer import preallocate


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def warm(files: list[Path]) -> None:
    subprocess.run(["sync"], check=True)
    for f in files:
        f.read_bytes()
    subprocess.run(["sync"], check=True)


def tensor_spans(files: list[Path]) -> tuple[list[tuple[Path, int, int]], int]:
    """(file, offset, bytes) of every tensor, file by file in offset order; and their total."""
    spans = []
    for f in files:
        infos = parse_header(f)
        spans += [(f, i.offset, i.nbytes) for i in sorted(infos.values(), key=lambda i: i.offset)]
    return spans, sum(n for _, _, n in spans)


def copy_step(src: int, dst: int, offset: int, want: int, pos: int,
              view: memoryview | None) -> int:
    """Copy up to ``want`` bytes at ``offset`` of ``src`` to ``pos`` of ``dst``: by the kernel
    (``view`` None; 8 MiB at most) or through ``view``; returns the bytes copied."""
    if view is None:
        n = os.copy_file_range(src, dst, min(want, 8 << 20), offset)
    else:
        n = os.preadv(src, [view[:min(len(view), want)]], offset)
        n = os.pwrite(dst, view[:n], pos) if n > 0 else n
    if n <= 0:
        sys.exit("the copy copied nothing (copy_file_range not supported here?)")
    return n


def time_copy(files: list[Path], out: Path, kernel: bool) -> tuple[float, float]:
    """Every tensor's bytes into one preallocated file: by the kernel (``copy_file_range``) or
    through a reused 512 KiB buffer (``pread`` + ``pwrite``)."""
    spans, total = tensor_spans(files)
    view = None if kernel else memoryview(bytearray(512 << 10))
    c0, start = cpu_now(), time.perf_counter()
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    preallocate(fd, total)
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    pos = 0
    for f, offset, nbytes in spans:
        done = 0
        while done < nbytes:
            done += copy_step(fds[f], fd, offset + done, nbytes - done, pos + done, view)
        pos += nbytes
    for src_fd in fds.values():
        os.close(src_fd)
    os.close(fd)
    return time.perf_counter() - start, cpu_now() - c0


def time_together(files: list[Path], out: Path, kernel: bool) -> tuple[float, float]:
    """The three passes at once, as threads (what a converter can do with them): the input
    digest on one thread; the copy on this one, its output digest on a third - read back
    behind the kernel copy (the converter's way), or taken from the 512 KiB buffer just written
    (``kernel=False``)."""
    spans, total = tensor_spans(files)
    ring: queue.SimpleQueue = queue.SimpleQueue()  # buffers free to fill
    done: queue.SimpleQueue = queue.SimpleQueue()  # (buffer or None, bytes) written, to hash
    for _ in range(8):
        ring.put(bytearray(512 << 10))
    c0, start = cpu_now(), time.perf_counter()
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    preallocate(fd, total)

    def hash_output() -> None:
        h, back, pos = new_hasher(), memoryview(bytearray(1 << 20)), 0
        while (item := done.get())[1]:
            buf, n = item
            if buf is not None:
                h.update(memoryview(buf)[:n])
                ring.put(buf)
                continue
            end = pos + n
            while pos < end:
                k = os.preadv(fd, [back[:min(len(back), end - pos)]], pos)
                h.update(back[:k])
                pos += k

    threads = [threading.Thread(target=lambda: [file_digest(f) for f in files]),
               threading.Thread(target=hash_output)]
    for t in threads:
        t.start()
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    pos = 0
    for f, offset, nbytes in spans:
        copied = 0
        while copied < nbytes:
            buf = None if kernel else ring.get()
            n = copy_step(fds[f], fd, offset + copied, nbytes - copied, pos + copied,
                          None if buf is None else memoryview(buf))
            done.put((buf, n))
            copied += n
        pos += nbytes
    done.put((None, 0))
    for t in threads:
        t.join()
    for src_fd in fds.values():
        os.close(src_fd)
    os.close(fd)
    return time.perf_counter() - start, cpu_now() - c0


def time_hash_only(nbytes: int) -> tuple[float, float]:
    """BLAKE3 of ``nbytes`` from a 1 MiB buffer that stays in memory (no read)."""
    h, block = new_hasher(), memoryview(os.urandom(1 << 20))
    c0, start = cpu_now(), time.perf_counter()
    for _ in range(nbytes // len(block)):
        h.update(block)
    h.update(block[:nbytes % len(block)])
    return time.perf_counter() - start, cpu_now() - c0


def time_start() -> float:
    """Wall time of a Python that imports what ``moepipe convert`` needs, and exits."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import moepipe.cli, moepipe.stages.convert"],
                   check=True)
    return time.perf_counter() - start


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
    print(f"{'cp -r':>6} {'kernel':>6} {'buffer':>6} {'dig in':>6} {'dig out':>7} "
          f"{'start':>5} | CPU s/GB {'cp':>4} {'copy':>4} {'in':>4} {'out':>4} {'sum':>4} | "
          f"floor s  floor/cp  load")
    floors: list[float] = []
    tries: list[list[float]] = []
    for _ in range(args.repeat):
        load = os.getloadavg()[0]
        warm(files)
        cp_s, cp_cpu, _ = timed(["cp", "-r", str(src), str(args.workdir / "copy")])
        shutil.rmtree(args.workdir / "copy")
        copies = []
        for kernel in (True, False):
            warm(files)
            copies.append(time_copy(files, args.workdir / "out.bin", kernel))
            (args.workdir / "out.bin").unlink()
        copy_s, copy_cpu = min(copies, key=lambda c: c[1])
        warm(files)
        in_s, in_cpu = time_digest(files)
        out_s, out_cpu = time_hash_only(int(gb * 1e9))
        start_s = time_start()
        cpu = copy_cpu + in_cpu + out_cpu
        floor_s = start_s + max(copy_s, in_s, out_s, cpu / cores)
        floors.append(floor_s / cp_s)
        print(f"{cp_s:6.2f} {copies[0][0]:6.2f} {copies[1][0]:6.2f} {in_s:6.2f} {out_s:7.2f} "
              f"{start_s:5.2f} | {'':8} {cp_cpu / gb:4.2f} {copy_cpu / gb:4.2f} "
              f"{in_cpu / gb:4.2f} {out_cpu / gb:4.2f} {cpu / gb:4.2f} | {floor_s:7.2f} "
              f"{floor_s / cp_s:9.2f} {load:5.1f}")
        together = []
        for kernel in (True, False):
            warm(files)
            together.append(time_together(files, args.workdir / "out.bin", kernel)[0])
            (args.workdir / "out.bin").unlink()
        tries.append([t / cp_s for t in together] + [(start_s + t) / cp_s for t in together])
        print(f"{'':6} together, without / with start: kernel copy {together[0]:.2f} s "
              f"({tries[-1][0]:.2f}x / {tries[-1][2]:.2f}x), buffered copy {together[1]:.2f} s "
              f"({tries[-1][1]:.2f}x / {tries[-1][3]:.2f}x)")
    print(f"floor of a first conversion with both digests: {min(floors):.2f}-{max(floors):.2f}x "
          f"cp -r on {cores} cores")
    best = [min(t[i] for t in tries) for i in range(4)]
    print(f"the three passes together as threads (best of the repeats): {min(best[:2]):.2f}x "
          f"cp -r without start-up, {min(best[2:]):.2f}x with it")
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
