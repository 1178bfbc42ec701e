"""Reading safetensors checkpoints with the checks a converter needs.

:class:`CheckpointReader` reads a folder of ``.safetensors`` shards (honouring
``model.safetensors.index.json``), validates every header against the file (truncation, offsets
that lie, overlapping tensors) before anything is converted, and reads only the bytes a slice
needs with ``pread`` - no mmap, so resident memory stays bounded by what is in flight.
:func:`load_file` loads one file, or some of its tensors (the reference runtime's rank files).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

from moepipe.checkpoints.dtypes import DTYPES, DType
from moepipe.errors import CheckpointError
from moepipe.utils.bounded import ReadError, loads_json
from moepipe.utils.fs import read_json

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
        header = loads_json(raw, str(path))
    except ReadError:
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


def pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Fill ``buf`` from ``offset`` of ``fd`` (``path`` names it in the error of a short file)."""
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
            self._index = read_json(index, "the checkpoint folder").get("weight_map")
            if not isinstance(self._index, dict):
                raise CheckpointError(f"{index}: not a valid safetensors index (weight_map)",
                                      "the index file is corrupt")
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
            pread_into(self._fd(path), buf, offset, path)


def load_file(path: str | os.PathLike,
              names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Load the tensors ``names`` (default: every tensor) of one safetensors file (validated
    first; no pickle, no mmap: the file may be replaced while its tensors are in use)."""
    import torch

    path = Path(path)
    infos = parse_header(path)
    if names is not None:
        wanted = list(names)
        missing = [n for n in wanted if n not in infos]
        if missing:
            raise CheckpointError(f"{path}: no tensor '{missing[0]}'",
                                  "the file does not match its manifest; build it again")
        infos = {n: infos[n] for n in wanted}
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, info in infos.items():
            raw = torch.empty(info.nbytes, dtype=torch.uint8)
            if info.nbytes:
                pread_into(fd, raw.numpy().data, info.offset, path)
            out[name] = raw.view(info.dtype.torch).reshape(info.shape)
    finally:
        os.close(fd)
    return out
