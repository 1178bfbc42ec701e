"""TensorRT-LLM's expert statistics: the routed-expert counts its PyTorch backend dumps, read
exactly and combined over ranks as the mapping requires.

What TensorRT-LLM 1.2 writes (``tensorrt_llm/_torch/expert_statistic.py``; the same on main):
with ``EXPERT_STATISTIC_ITER_RANGE=START-STOP`` set, every rank counts, for iterations
``START <= iter < STOP``, ``torch.bincount`` of the expert ids its fused MoE modules route
(slot ids when the MoE load balancer is on: ``maybe_add_info(num_slots, token_selected_slots)``
in ``_torch/modules/fused_moe/``), under the key ``"{iter}_{layer}"`` (``layer`` = the MoE
module's ``layer_idx``, the decoder layer's index, which the load balancer's
``initial_global_assignments`` uses too). When the iteration ``STOP`` begins it writes, into
``EXPERT_STATISTIC_PATH`` (default ``expert_statistic``), ``rank{r}.safetensors`` (int64 count
vectors ``[num_experts]``) and, rank 0 only, ``meta_info.json``
(``{"num_experts", "num_experts_per_token"}``). Once: the window does not repeat. An older
version wrote pickle, which is refused here by its magic bytes and never loaded.

Which tokens a rank counts is the mapping's: routing runs before the MoE all-to-all, on the
tokens the rank holds. With attention data parallelism each rank of a pipeline stage holds its
own requests, so a layer's load is the sum over the stage's ranks. Without it, the stage's tp
ranks hold the same tokens (attention is tensor-parallel) and route them identically: each
rank's count is already the layer's load, and the ranks must agree. Pipeline stages hold
disjoint layers (rank r is stage ``r // tp``).

This module is plain Python and numpy: ``moepipe balance`` reads dumps with it, and the
trtllm-pytorch deployment ships a copy beside its Triton model, which exports the counts
(NVIDIA's container has no moepipe).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ENV_ITER_RANGE = "EXPERT_STATISTIC_ITER_RANGE"
ENV_PATH = "EXPERT_STATISTIC_PATH"
DEFAULT_PATH = "expert_statistic"  # TensorRT-LLM's default, relative to its working directory
META_FILE = "meta_info.json"
RANK_FILE = re.compile(r"^rank(\d+)\.safetensors$")
KEY = re.compile(r"^(\d+)_(\d+)$")
# A dump of 10k iterations x 100 layers x 512 experts is 4 GiB of int64: refuse more.
MAX_FILE_BYTES = 4 << 30
MAX_HEADER_BYTES = 256 << 20
MAX_META_BYTES = 1 << 20
READ_TIMEOUT_S = 120.0
_DTYPES = {"I64": "<i8", "I32": "<i4"}
_CHUNK = 8 << 20


class StatisticError(ValueError):
    """A dump that cannot be read as TensorRT-LLM wrote it (message and a hint)."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message, self.hint = message, hint


def parse_range(text: str) -> tuple[int, int]:
    """``START-STOP`` as TensorRT-LLM parses ``EXPERT_STATISTIC_ITER_RANGE`` (``split('-')``,
    ``int`` each), with ``0 <= START < STOP`` (else nothing would ever be written)."""
    try:
        start_s, stop_s = text.strip().split("-")
        start, stop = int(start_s), int(stop_s)
    except ValueError:
        raise StatisticError(f"iteration range {text!r} is not START-STOP",
                             "e.g. 100-1100: iterations 100 to 1099 are counted") from None
    if not 0 <= start < stop:
        raise StatisticError(f"iteration range {text!r}: START must be < STOP",
                             "e.g. 100-1100: iterations 100 to 1099 are counted")
    return start, stop


def environment(start: int, stop: int, path: str) -> dict[str, str]:
    """The variables that make TensorRT-LLM count iterations ``start..stop-1`` into ``path``
    (its worker processes read them: they must be in the server's environment)."""
    window = f"{start}-{stop}"
    parse_range(window)
    return {ENV_ITER_RANGE: window, ENV_PATH: path}


# -- reading ---------------------------------------------------------------------------------
# ``read(path, limit) -> bytes`` reads one file: moepipe passes its own bounded reader
# (:func:`moepipe.utils.bounded.read_file`); in NVIDIA's container this module's minimal one
# (the same bounds, and a deadline) is the default.
Reader = Callable[[Path, int], bytes]


def read_local(path: Path, limit: int) -> bytes:
    """A regular file of at most ``limit`` bytes, read within :data:`READ_TIMEOUT_S` (a FIFO
    or device would block or never end; a huge file is not a count dump)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise StatisticError(f"{path}: cannot read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StatisticError(f"{path}: not a regular file")
        if info.st_size > limit:
            raise StatisticError(f"{path}: {info.st_size} bytes, more than the {limit} a count "
                                 "dump may have", "is this the expert statistic folder?")
        os.set_blocking(fd, True)
        deadline, parts, size = time.monotonic() + READ_TIMEOUT_S, [], 0
        while chunk := f.read(_CHUNK):
            parts.append(chunk)
            size += len(chunk)
            if size > limit or time.monotonic() > deadline:
                raise StatisticError(f"{path}: more than {limit} bytes or {READ_TIMEOUT_S:g}s "
                                     "to read", "copy the folder to a local disk")
    return b"".join(parts)


def is_pickle(head: bytes) -> bool:
    """Pickle (protocol 2-5: ``0x80 <protocol>``) or torch.save's zip archive (a pickle
    inside), and not a safetensors header (8-byte length, then ``{``)."""
    if len(head) >= 9 and head[8:9] == b"{":
        return False
    return (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) \
        or head[:4] == b"PK\x03\x04"


def _refuse_pickle(path: Path) -> StatisticError:
    return StatisticError(f"{path}: a pickle file (the format of an older TensorRT-LLM); "
                          "moepipe never loads pickle",
                          "collect again with TensorRT-LLM 1.2, which writes safetensors")


def parse_counts(raw: bytes, where: Path) -> dict[tuple[int, int], np.ndarray]:
    """``(iter, layer) -> counts`` of one ``rank{r}.safetensors``'s bytes, every key, dtype
    and shape checked (a minimal safetensors parser: no pickle)."""
    if is_pickle(raw[:9]):
        raise _refuse_pickle(where)
    if len(raw) < 8:
        raise StatisticError(f"{where}: not a safetensors file ({len(raw)} bytes)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise StatisticError(f"{where}: not a safetensors file (header of {n} bytes)",
                             "was it still being written? read it once TensorRT-LLM logged "
                             "'[ExpertStatistic] ... saving'")
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError:
        raise StatisticError(f"{where}: not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise StatisticError(f"{where}: not a safetensors file")
    header.pop("__metadata__", None)
    data = memoryview(raw)[8 + n:]
    out = {}
    for key, spec in header.items():
        m = KEY.match(key)
        if m is None:
            raise StatisticError(f"{where}: tensor {key!r} is not an ITER_LAYER count",
                                 "is this a folder TensorRT-LLM's expert statistics wrote?")
        try:
            dtype = _DTYPES[spec["dtype"]]
            (length,) = spec["shape"]
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise StatisticError(f"{where}: tensor {key!r} is not a 1-D integer count vector "
                                 f"({spec!r})") from None
        if not 0 <= begin <= end <= len(data) or end - begin != int(length) * int(dtype[-1]):
            raise StatisticError(f"{where}: tensor {key!r} lies outside the file",
                                 "was it still being written, or cut short?")
        counts = np.frombuffer(data[begin:end], dtype=dtype).astype(np.int64)
        if (counts < 0).any():
            raise StatisticError(f"{where}: tensor {key!r} has negative counts")
        out[(int(m.group(1)), int(m.group(2)))] = counts
    return out


def read_counts(path: Path, read: Reader = read_local) -> dict[tuple[int, int], np.ndarray]:
    """The counts of one rank file (:func:`parse_counts` of what ``read`` reads)."""
    return parse_counts(read(path, MAX_FILE_BYTES), path)


@dataclass
class Dump:
    """One collection window as TensorRT-LLM wrote it."""

    folder: Path
    meta: dict  # meta_info.json (None-valued when rank 0 routed nothing)
    ranks: dict[int, dict[tuple[int, int], np.ndarray]]

    @property
    def width(self) -> int:
        """Length of every count vector (experts, or slots with the load balancer)."""
        sizes = {len(v) for r in self.ranks.values() for v in r.values()}
        if len(sizes) > 1:
            raise StatisticError(f"{self.folder}: count vectors of different lengths "
                                 f"{sorted(sizes)}", "a mixed folder? collect again into an "
                                 "empty one")
        width = sizes.pop() if sizes else int(self.meta.get("num_experts") or 0)
        declared = self.meta.get("num_experts")
        if declared is not None and int(declared) != width:
            raise StatisticError(f"{self.folder}: {META_FILE} says {declared} experts, the "
                                 f"counts have {width}")
        return width

    @property
    def iterations(self) -> tuple[int, int]:
        """[first, last + 1) of the counted iterations."""
        its = {i for r in self.ranks.values() for i, _ in r}
        return (min(its), max(its) + 1) if its else (0, 0)


def rank_files(folder: Path, read: Reader = read_local) -> dict[int, Path]:
    """``rank -> rank{r}.safetensors`` of a folder; an older pickle dump is refused."""
    if not folder.is_dir():
        raise StatisticError(f"{folder}: not a folder",
                             f"point at the folder TensorRT-LLM wrote ({ENV_PATH})")
    found, others = {}, []
    for path in sorted(folder.iterdir()):
        m = RANK_FILE.match(path.name)
        if m:
            found[int(m.group(1))] = path
        elif path.name.startswith("rank") and path.is_file():
            others.append(path)
    for path in others:  # rank0.pkl and the like: say what it is, never load it
        if is_pickle(read(path, MAX_FILE_BYTES)[:9]):
            raise _refuse_pickle(path)
    return found


def read_dump(folder: Path, world_size: int, since: float | None = None,
              read: Reader = read_local) -> Dump:
    """Every rank's counts and the meta of ``folder``, checked: ranks 0..world_size-1 all
    there (``since``: each file written at or after this time, so an earlier run's dump
    is not taken for this one)."""
    files = rank_files(folder, read)
    missing = [r for r in range(world_size) if r not in files]
    extra = sorted(set(files) - set(range(world_size)))
    if not files:
        raise StatisticError(f"{folder}: no rank*.safetensors",
                             f"TensorRT-LLM writes them when iteration STOP of "
                             f"{ENV_ITER_RANGE} begins; serve more traffic or lower STOP")
    if missing or extra:
        raise StatisticError(f"{folder}: rank files {sorted(files)} for a world size of "
                             f"{world_size}" + (f" (missing {missing})" if missing else ""),
                             "is the mapping (tp x pp) the one the deployment ran with?")
    meta_path = folder / META_FILE
    if not meta_path.is_file():
        raise StatisticError(f"{meta_path}: missing (rank 0 writes it with its counts)")
    try:
        meta = json.loads(read(meta_path, MAX_META_BYTES) or b"null")
    except ValueError:
        raise StatisticError(f"{meta_path}: not JSON") from None
    if meta is None:  # rank 0 counted nothing (its stage has only dense layers)
        meta = {}
    if not isinstance(meta, dict):
        raise StatisticError(f"{meta_path}: not a JSON object")
    if since is not None:
        stale = [p.name for p in [meta_path, *files.values()] if p.stat().st_mtime < since]
        if stale:
            raise StatisticError(f"{folder}: {', '.join(stale)} predate this run")
    return Dump(folder, meta, {r: read_counts(p, read) for r, p in sorted(files.items())})


# -- combining ------------------------------------------------------------------------------

@dataclass
class Counts:
    """Tokens per expert of every MoE layer over the window (TensorRT-LLM's layer indices)."""

    layers: dict[int, list[int]]
    iterations: tuple[int, int]
    top_k: int | None
    ranks_per_layer: dict[int, list[int]] = field(default_factory=dict)  # whose counts


def _sum_iterations(counts: dict[tuple[int, int], np.ndarray]) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for (_, layer), v in counts.items():
        out[layer] = out.get(layer, 0) + v
    return out


def combine(dump: Dump, *, tp: int, pp: int, attention_dp: bool,
            assignments: dict[int, list[int]] | None = None) -> Counts:
    """Per-layer expert loads of a dump from a ``tp x pp`` deployment (see the module
    docstring for the rule); ``assignments``: the load balancer's slot -> expert lists when it
    was on (counts are per slot then, and an expert's load is the sum over its slots)."""
    dump.width  # noqa: B018 - checks that every vector has the meta's length
    per_rank = {r: _sum_iterations(c) for r, c in dump.ranks.items()}
    iters = {r: {i for i, _ in c} for r, c in dump.ranks.items() if c}
    if len({frozenset(v) for v in iters.values()}) > 1:
        raise StatisticError(f"{dump.folder}: the ranks counted different iterations",
                             "a mixed folder? collect again into an empty one")
    layers: dict[int, np.ndarray] = {}
    owners: dict[int, list[int]] = {}
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        sets = {frozenset(per_rank[r]) for r in ranks}
        if len(sets) > 1:
            raise StatisticError(f"{dump.folder}: ranks {ranks} (pipeline stage {stage}) hold "
                                 "different layers", "is the mapping (tp x pp) the one the "
                                 "deployment ran with?")
        for layer in sorted(sets.pop()):
            if layer in layers:
                raise StatisticError(f"{dump.folder}: layer {layer} counted on two pipeline "
                                     "stages", "is pp the one the deployment ran with?")
            rows = [per_rank[r][layer] for r in ranks]
            if attention_dp:
                layers[layer], owners[layer] = sum(rows[1:], rows[0]), ranks
            else:
                if any(not np.array_equal(rows[0], row) for row in rows[1:]):
                    raise StatisticError(
                        f"{dump.folder}: ranks {ranks} disagree on layer {layer}; without "
                        "attention DP they route the same tokens",
                        "was the deployment run with attention DP (parallel.attention_dp)?")
                layers[layer], owners[layer] = rows[0], ranks[:1]
    if assignments is not None:
        layers = {layer: _by_expert(row, assignments, layer, dump.folder)
                  for layer, row in layers.items()}
    top_k = dump.meta.get("num_experts_per_token")
    return Counts({k: [int(x) for x in v] for k, v in sorted(layers.items())},
                  dump.iterations, None if top_k is None else int(top_k), owners)


def _by_expert(slots: np.ndarray, assignments: dict[int, list[int]], layer: int,
               where: Path) -> np.ndarray:
    row = assignments.get(layer)
    if row is None or len(row) != len(slots):
        raise StatisticError(f"{where}: layer {layer} has {len(slots)} slot counts, the "
                             f"placement {'has none for it' if row is None else len(row)}",
                             "pass the placement the deployment ran with")
    experts = np.zeros(max(row) + 1, dtype=np.int64)
    np.add.at(experts, np.asarray(row), slots)
    return experts


# -- waiting for a dump (the deployment's exporter) -----------------------------------------

class DumpWatcher:
    """Polled by the trtllm-pytorch model: the combined counts once every rank's file of this
    run is complete (written after ``started``, its size and time unchanged since the last
    poll, readable), else None."""

    def __init__(self, folder: str | Path, *, tp: int, pp: int, attention_dp: bool,
                 assignments: dict[int, list[int]] | None, started: float):
        self.folder, self.tp, self.pp = Path(folder), tp, pp
        self.attention_dp, self.assignments, self.started = attention_dp, assignments, started
        self._last: tuple | None = None

    def poll(self) -> Counts | None:
        paths = [self.folder / META_FILE] + [self.folder / f"rank{r}.safetensors"
                                             for r in range(self.tp * self.pp)]
        try:
            seen = tuple((p.stat().st_size, p.stat().st_mtime) for p in paths)
        except OSError:  # not all written yet
            return None
        if any(mtime < self.started for _, mtime in seen) or seen != self._last:
            self._last = seen
            return None
        dump = read_dump(self.folder, self.tp * self.pp, since=self.started)
        return combine(dump, tp=self.tp, pp=self.pp, attention_dp=self.attention_dp,
                       assignments=self.assignments)
