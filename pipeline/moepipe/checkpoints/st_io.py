"""Streaming safetensors I/O with the checks a converter needs.

* :class:`CheckpointReader` reads a folder of ``.safetensors`` shards (honouring
  ``model.safetensors.index.json``), validates every header against the file (truncation,
  offsets that lie, overlapping tensors) before anything is converted, and reads only the bytes a
  slice needs with ``pread`` - no mmap, so resident memory stays bounded by what is in flight.
* :class:`SafetensorsWriter` writes the header first (all names, shapes and dtypes are known from
  the plan) and then streams tensor data chunk by chunk, hashing (BLAKE3) as it goes.
"""

from __future__ import annotations

import errno
import json
import math
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from moepipe.errors import CheckpointError


@dataclass(frozen=True)
class DType:
    """A safetensors dtype. Kept apart from torch so that copying bytes needs no torch import
    (``moepipe convert`` of a same-dtype checkpoint starts in a fraction of a second)."""

    name: str  # safetensors spelling
    itemsize: int
    torch_name: str

    @property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)

    def __str__(self) -> str:
        return self.torch_name


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("F64", 8, "float64"), DType("F32", 4, "float32"), DType("F16", 2, "float16"),
    DType("BF16", 2, "bfloat16"), DType("I64", 8, "int64"), DType("I32", 4, "int32"),
    DType("I16", 2, "int16"), DType("I8", 1, "int8"), DType("U8", 1, "uint8"),
    DType("BOOL", 1, "bool"), DType("F8_E4M3", 1, "float8_e4m3fn"),
    DType("F8_E5M2", 1, "float8_e5m2"))}
F32, F16, BF16 = DTYPES["F32"], DTYPES["F16"], DTYPES["BF16"]
BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in DTYPES.values()}


INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024
_MAX_READ = 1 << 30


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: DType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def parse_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header against the file itself."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (no safetensors header)",
                                      "re-download or re-save the shard")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise CheckpointError(
                    f"{path}: header length {hlen} does not fit a {size}-byte file "
                    "(truncated, or not a safetensors file)", "re-download or re-save the shard")
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: safetensors header is not valid JSON",
                              "the file is corrupt; re-download or re-save it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    infos: dict[str, TensorInfo] = {}
    spans = []
    base = 8 + hlen
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for '{name}'",
                                  "the file is corrupt; re-download or re-save it") from None
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise CheckpointError(f"{path}: header entry for '{name}' has a negative size")
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise CheckpointError(
                f"{path}: header lies about '{name}': shape {list(shape)} {entry['dtype']} needs "
                f"{want} bytes but its offsets span {end - begin}",
                "the file is corrupt; re-download or re-save it")
        infos[name] = TensorInfo(name, path, dtype, shape, base + begin, want)
        spans.append((begin, end, name))
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin < cursor:
            raise CheckpointError(f"{path}: tensor '{name}' overlaps another tensor's bytes",
                                  "the file is corrupt; re-download or re-save it")
        cursor = max(cursor, end)
    if base + cursor > size:
        raise CheckpointError(
            f"{path}: truncated: header promises {cursor} bytes of tensor data, the file holds "
            f"{size - base}", "the download or copy was cut short; fetch the shard again")
    if base + cursor < size:
        raise CheckpointError(f"{path}: {size - base - cursor} unexpected bytes after the last "
                              "tensor", "the file is corrupt; re-download or re-save it")
    return infos


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:done + _MAX_READ]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{path}: unexpected end of file while reading tensor data",
                                  "the file changed or was truncated while converting")
        done += n


@dataclass(frozen=True)
class Region:
    """A contiguous byte range of a tensor in its file that covers a requested slice."""

    info: TensorInfo
    offset: int  # absolute, in the file
    nbytes: int
    block_shape: tuple[int, ...]
    cut: tuple | None  # index into the block that gives the request; None = the whole block
    shape: tuple[int, ...]  # shape of the request


class CheckpointReader:
    """Lazy, validated access to the tensors of a safetensors checkpoint folder."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.files = self._shard_files()
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for name, info in parse_header(path).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor '{name}' appears in both "
                                          f"{self.tensors[name].file.name} and {path.name}")
                self.tensors[name] = info
        self._check_index()
        self._fds: dict[Path, int] = {}

    def _shard_files(self) -> list[Path]:
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: no such directory",
                                  "pass the folder that holds config.json and *.safetensors")
        index = self.folder / INDEX_FILE
        if index.exists():
            try:
                self._index = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index}: not a valid safetensors index (weight_map)",
                                      "the index file is corrupt") from None
            files = sorted(set(self._index.values()))
            root = self.folder.resolve()
            outside = [f for f in files if not isinstance(f, str)
                       or not (self.folder / f).resolve().is_relative_to(root)]
            if outside:
                raise CheckpointError(f"{index}: shard path {outside[0]!r} points outside the "
                                      "checkpoint folder",
                                      "an index may only name shard files inside the folder "
                                      "(the index is corrupt or was edited)")
            missing = [f for f in files if not (self.folder / f).is_file()]
            if missing:
                raise CheckpointError(f"{self.folder}: shard(s) listed in {INDEX_FILE} are "
                                      f"missing: {', '.join(missing)}",
                                      "the download is incomplete; fetch the missing shards")
            return [self.folder / f for f in files]
        self._index = None
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            bins = list(self.folder.glob("*.bin")) + list(self.folder.glob("*.pt"))
            hint = ("moepipe loads safetensors only (no pickle); convert the .bin weights with "
                    "`save_pretrained(..., safe_serialization=True)`" if bins else
                    "pass a Hugging Face checkpoint folder")
            raise CheckpointError(f"{self.folder}: no *.safetensors files", hint)
        return files

    def _check_index(self) -> None:
        if self._index is None:
            return
        for name, fname in self._index.items():
            info = self.tensors.get(name)
            if info is None or info.file.name != fname:
                raise CheckpointError(f"{INDEX_FILE} maps '{name}' to {fname}, which does not "
                                      "contain it", "the index and the shards disagree")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor '{name}' is missing",
                                  "the checkpoint is incomplete or not of the declared "
                                  "architecture") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def fd(self, path: Path) -> int:
        """The open file descriptor of a shard (for copies the kernel makes: copy_range)."""
        return self._fd(path)

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def region(self, name: str, index: tuple = ()) -> Region:
        """The smallest contiguous block of the file that covers ``tensor[index]`` (ints and
        basic slices on leading dims), and how to cut the request out of it."""
        info = self.info(name)
        shape = info.shape
        ranges, squeeze = [], []
        for dim, size in enumerate(shape):
            ix = index[dim] if dim < len(index) else slice(None)
            if isinstance(ix, int):
                ranges.append((ix, ix + 1))
                squeeze.append(dim)
            else:
                start, stop, step = ix.indices(size)
                if step != 1:
                    raise ValueError("strided reads are not supported")
                ranges.append((start, max(start, stop)))
        # First dim whose range spans more than one index: the covering block takes that range
        # and everything after it.
        pivot = next((d for d, (a, b) in enumerate(ranges) if b - a != 1), len(shape))
        if pivot == len(shape):
            pivot = len(shape) - 1 if shape else 0
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        first = sum(ranges[d][0] * strides[d] for d in range(pivot))
        if shape:
            first += ranges[pivot][0] * strides[pivot]
            count = (ranges[pivot][1] - ranges[pivot][0]) * strides[pivot]
            block_shape = (ranges[pivot][1] - ranges[pivot][0], *shape[pivot + 1:])
        else:
            count, block_shape = 1, ()
        rest = tuple(slice(a, b) for a, b in ranges[pivot + 1:])
        exact = all(r == slice(0, shape[pivot + 1 + i]) for i, r in enumerate(rest))
        out_shape = tuple(b - a for d, (a, b) in enumerate(ranges) if d not in squeeze)
        item = info.dtype.itemsize
        return Region(info, info.offset + first * item, count * item, block_shape,
                      None if exact else (slice(None), *rest), out_shape)

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """Read ``tensor[index]``, touching only the smallest covering block of the file."""
        import torch

        region = self.region(name, index)
        raw = torch.empty(region.nbytes, dtype=torch.uint8)
        self.read_bytes(region.info.file, region.offset, raw.numpy().data)
        block = raw.view(region.info.dtype.torch).reshape(region.block_shape)
        if region.cut is not None:
            block = block[region.cut]
        return block.reshape(region.shape).contiguous()

    def read_bytes(self, path: Path, offset: int, buf: memoryview) -> None:
        if len(buf):
            _pread_into(self._fd(path), buf, offset, path)


class BufferPool:
    """A few reusable byte blocks: reading into them avoids page-faulting fresh memory for
    every block, and bounds the bytes in flight. Blocks are made when first needed (a
    conversion that only copies bytes needs none)."""

    def __init__(self, count: int, size: int):
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._size, self._unmade = size, count
        self._lock = threading.Lock()

    def get(self) -> bytearray:
        with self._lock:
            if self._free.empty() and self._unmade:
                self._unmade -= 1
                return bytearray(self._size)
        return self._free.get()

    def put(self, buf: bytearray) -> None:
        self._free.put(buf)


def write_all(fd: int, data) -> None:
    """Write ``data`` (bytes-like) at the file's position."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view):]


_fallocate: Any = None  # libc fallocate once looked up; False where there is none


def preallocate(fd: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` for the file up front (Linux ``fallocate``, mode 0), where the
    filesystem can: a full disk fails here, before anything is written, and the kernel copies
    into a preallocated file cheaper than into one that grows (measured: 0.40 against 0.49
    CPU-s for 1.4 GB of ``copy_file_range`` into one file). Elsewhere nothing happens (no
    emulation by writing zeros, as ``posix_fallocate`` does); returns whether it was done."""
    global _fallocate
    if _fallocate is None:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            _fallocate = libc.fallocate
            _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            _fallocate.restype = ctypes.c_int
        except (OSError, AttributeError):
            _fallocate = False
    if not _fallocate or nbytes <= 0:
        return False
    if _fallocate(fd, 0, 0, nbytes) == 0:
        return True
    import ctypes

    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT):
        raise OSError(err, os.strerror(err))
    return False  # EOPNOTSUPP and the like: the file grows as it is written


class SafetensorsWriter:
    """Write a safetensors file whose layout is fixed up front, streaming the data.

    The BLAKE3 digest of the file is computed on a second thread (it releases the GIL) from
    the file itself, a little behind the writer: the bytes just written are read back from the
    page cache in 1 MiB blocks and hashed, so the digest is of what was written. Bytes copied
    unchanged from another file go through :meth:`copy_range`: the kernel copies them page
    cache to page cache (``copy_file_range``, what ``cp`` does); the process reads them once,
    for the digest.
    """

    def __init__(self, path: Path, entries: list[tuple[str, DType, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._sizes = []
        for name, dtype, shape in entries:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": dtype.name, "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            self._sizes.append((name, dtype, n))
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        from moepipe.checkpoints.digest import new_hasher  # readers (the runtime) need no blake3

        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            preallocate(self._fd, 8 + len(blob) + offset)
        except OSError:
            os.close(self._fd)
            raise
        self._hash = new_hasher()
        self._written = 0  # bytes in the file
        self._hashed = 0  # of which the digest has seen
        self._closing = self._abandon = False
        self._failure: BaseException | None = None
        self._progress = threading.Condition()
        self._hasher = threading.Thread(target=self._hash_loop, daemon=True)
        self._hasher.start()
        self._copy_ok = True  # copy_file_range works between these files (until it fails once)
        self._emit(struct.pack("<Q", len(blob)) + blob)
        self._entry = 0
        self._left = self._sizes[0][2] if self._sizes else 0

    def _emit(self, data) -> None:
        write_all(self._fd, data)
        self._wrote(memoryview(data).nbytes)

    def _wrote(self, nbytes: int) -> None:
        """Tell the hasher ``nbytes`` more are in the file; wait while it lags far behind (the
        bytes it has not seen should still be in the page cache when it gets to them)."""
        with self._progress:
            self._written += nbytes
            self._progress.notify_all()
            while self._written - self._hashed > _HASH_LAG and self._failure is None:
                self._progress.wait()
        if self._failure is not None:
            raise self._failure

    def _hash_loop(self) -> None:
        from moepipe.checkpoints.digest import BLOCK, update_from_fd

        buf = bytearray(BLOCK)  # reused: fresh memory for every block costs page faults
        try:
            while True:
                with self._progress:
                    while self._hashed == self._written and not self._closing:
                        self._progress.wait()
                    start, end = self._hashed, self._written
                    if start == end or self._abandon:  # closing (everything hashed) or aborted
                        return
                update_from_fd(self._hash, self._fd, start, end, buf)
                with self._progress:
                    self._hashed = end
                    self._progress.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the writing thread
            with self._progress:
                self._failure = e
                self._progress.notify_all()

    def _current(self) -> tuple[str, DType]:
        while self._left == 0 and self._entry < len(self._sizes) - 1:
            self._entry += 1
            self._left = self._sizes[self._entry][2]
        name, dtype, _ = self._sizes[self._entry]
        return name, dtype

    def write(self, chunk: torch.Tensor) -> None:
        """Append the next chunk of the current tensor (chunks of one tensor, in order),
        cast to the tensor's declared dtype."""
        import torch

        _, dtype = self._current()
        self.write_bytes(chunk.to(dtype.torch).contiguous().reshape(-1)
                         .view(torch.uint8).numpy().data)

    def write_zeros(self, nbytes: int) -> None:
        self.write_bytes(memoryview(bytes(nbytes)))

    def write_bytes(self, data: memoryview) -> None:
        """Append raw bytes (already in the declared dtype) to the current tensor; ``data``
        may be reused as soon as this returns."""
        name, _ = self._current()
        if data.nbytes > self._left:
            raise RuntimeError(f"{self.path.name}: too much data for '{name}'")
        self._emit(data)
        self._left -= data.nbytes

    def copy_range(self, src_fd: int, offset: int, nbytes: int) -> None:
        """Append ``nbytes`` that ``src_fd`` holds at ``offset``: the kernel copies them from
        the source file. Filesystems or kernels that cannot (``EXDEV``, ``EINVAL``,
        ``ENOSYS``...) get them read and written in 1 MiB blocks."""
        name, _ = self._current()
        if nbytes > self._left:
            raise RuntimeError(f"{self.path.name}: too much data for '{name}'")
        done = 0
        while self._copy_ok and done < nbytes:
            try:
                n = os.copy_file_range(src_fd, self._fd, min(nbytes - done, _COPY_STEP),
                                       offset + done)
            except OSError:
                n = 0
            if n <= 0:  # not supported here (or the source shrank): read and write
                self._copy_ok = False
            else:
                done += n
                self._wrote(n)
        if done < nbytes:
            buf = memoryview(bytearray(min(nbytes - done, 1 << 20)))
            while done < nbytes:
                part = buf[:min(len(buf), nbytes - done)]
                _pread_into(src_fd, part, offset + done,
                            Path(f"the source of {self.path.name}"))
                self._emit(part)
                done += len(part)
        self._left -= nbytes

    def close(self) -> str:
        """Finish the file; returns its BLAKE3 digest (hex)."""
        if self._left or self._entry < len(self._sizes) - 1:
            raise RuntimeError(f"{self.path.name}: tensor '{self._sizes[self._entry][0]}' "
                               "is incomplete")
        self._stop()
        os.close(self._fd)
        if self._failure is not None:
            raise self._failure
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._abandon = True
        self._stop()
        os.close(self._fd)

    def _stop(self) -> None:
        with self._progress:
            self._closing = True
            self._progress.notify_all()
        self._hasher.join()


# The hasher may lag this far behind the writer (bytes) before the writer waits for it.
_HASH_LAG = 256 << 20
# Bytes per copy_file_range call: the hasher follows the copy in steps of this size.
_COPY_STEP = 8 << 20


def load_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load every tensor of one safetensors file (validated first; no pickle, no mmap)."""
    import torch

    path = Path(path)
    infos = parse_header(path)
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, info in infos.items():
            raw = torch.empty(info.nbytes, dtype=torch.uint8)
            if info.nbytes:
                _pread_into(fd, raw.numpy().data, info.offset, path)
            out[name] = raw.view(info.dtype.torch).reshape(info.shape)
    finally:
        os.close(fd)
    return out


_SMALL_CAST = 1 << 18  # bytes: bf16 -> f32 casts up to this size are done without numpy


def convert_bytes(data: memoryview, src: DType, dst: DType) -> memoryview:
    """Cast raw little-endian float data between float32, float16 and bfloat16 with numpy
    (bfloat16 rounding: to nearest even, as torch does), so that converting a checkpoint never
    needs torch. A small bfloat16 -> float32 cast (a router, which TensorRT-LLM keeps in float32,
    in a conversion that otherwise only copies bytes) is done without numpy: it is exact, and
    importing numpy would cost more than the cast (0.12-0.24 s here)."""
    if src == dst or {src.name, dst.name} == {"U8", "I8"}:  # same bytes (packed int4)
        return data
    if src == BF16 and dst == F32 and data.nbytes <= _SMALL_CAST:
        raw = bytes(data)
        wide = bytearray(2 * len(raw))  # the bf16 bits are the high half of the float32
        wide[2::4] = raw[0::2]
        wide[3::4] = raw[1::2]
        return memoryview(wide)
    import numpy as np

    if src == F32:
        x = np.frombuffer(data, dtype=np.float32)
    elif src == F16:
        x = np.frombuffer(data, dtype=np.float16).astype(np.float32)
    elif src == BF16:
        x = (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"cannot convert {src.name} to {dst.name}")
    out: np.ndarray
    if dst == F32:
        out = x
    elif dst == F16:
        with np.errstate(over="ignore"):  # out of range -> inf, as torch gives
            out = x.astype(np.float16)
    elif dst == BF16:
        bits = x.view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():  # keep NaNs NaN (rounding could carry into the exponent)
            rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        out = rounded
    else:
        raise ValueError(f"cannot convert {src.name} to {dst.name}")
    return np.ascontiguousarray(out).data.cast("B")
