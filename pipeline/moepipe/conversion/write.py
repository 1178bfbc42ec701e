"""Writing a planned conversion: each rank file's header first, then tensor data expert by
expert, so resident memory stays around one expert slice, not a layer and never the model.
Contiguous bytes are copied by the kernel; the output appears atomically, with a manifest of
source and output digests.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moepipe import __version__
from moepipe.arch.geometry import Zeros
from moepipe.arch.hf import HFCheckpoint, open_hf_checkpoint
from moepipe.arch.rules import SliceRef
from moepipe.checkpoints.casts import convert_bytes
from moepipe.checkpoints.digest import ALGORITHM, file_digest
from moepipe.checkpoints.dtypes import DType
from moepipe.checkpoints.fp8_block import Fp8BlockReader
from moepipe.checkpoints.hashcache import cached_digest, remember
from moepipe.checkpoints.manifest import MANIFEST, rank_file
from moepipe.checkpoints.reader import CheckpointReader
from moepipe.checkpoints.writer import BufferPool, SafetensorsWriter
from moepipe.conversion.plan import (
    AliasReader,
    Plan,
    check_float_sources,
    plan_conversion,
    source_aliases,
    unmapped_tensors,
)
from moepipe.errors import CheckpointError, ConfigError
from moepipe.mapping import Mapping
from moepipe.trtllm.versions import TRTLLM_ENGINE_VERSION
from moepipe.utils.fs import STAGE_FILE, atomic_dir
from moepipe.utils.progress import Task, task

log = logging.getLogger("moepipe")

# Streaming block: small enough to stay in CPU cache between read, hash and write.
BLOCK_BYTES = 1 << 20


@dataclass
class ConvertResult:
    output: Path
    plan: Plan
    files: dict[str, str]
    bytes_written: int
    seconds: float


def convert(model_dir: str | Path, output: str | Path, *, dtype: str = "auto", tp: int = 1,
            pp: int = 1, moe_tp: int | None = None, moe_ep: int | None = None, workers: int = 1,
            overwrite: bool = False) -> ConvertResult:
    """Convert an HF checkpoint folder into a TensorRT-LLM checkpoint folder."""
    ckpt = open_hf_checkpoint(model_dir)
    mapping = Mapping.create(tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep)
    return convert_checkpoint(ckpt, Path(output), mapping, dtype=dtype, workers=workers,
                              overwrite=overwrite)


def convert_checkpoint(ckpt: HFCheckpoint, output: Path, mapping: Mapping, *, dtype: str = "auto",
                       workers: int = 1, overwrite: bool = False,
                       progress: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert into ``output``, which appears (atomically) only when complete."""
    start = time.perf_counter()
    with atomic_dir(output, overwrite) as tmp:
        res = convert_into(ckpt, tmp, mapping, dtype=dtype, workers=workers, progress=progress)
    res.output, res.seconds = output, time.perf_counter() - start
    return res


def convert_into(ckpt: HFCheckpoint, folder: Path, mapping: Mapping, *, dtype: str = "auto",
                 workers: int = 1,
                 progress: Callable[[str], None] | None = None) -> ConvertResult:
    """Write the TensorRT-LLM checkpoint into the (empty, temporary) ``folder``."""
    start = time.perf_counter()
    if dtype == "auto":
        dtype = ckpt.spec.torch_dtype
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    with ckpt.reader() as reader:
        plan = plan_conversion(ckpt.family, ckpt.spec, mapping, dtype, reader, ckpt.quant)
        if ckpt.quant is None:
            check_float_sources(plan.sources, reader)
        extra = unmapped_tensors(plan, reader.tensors, ckpt.family)
        if extra:
            raise CheckpointError(
                f"{len(extra)} tensor(s) in the checkpoint have no mapping, e.g. {extra[0]}",
                f"the checkpoint has parts {ckpt.family.hf_architecture} does not define; "
                "moepipe refuses to drop weights silently")
        source_hashes: dict[str, str] = {}
        hasher = threading.Thread(target=_hash_sources, args=(ckpt.path, source_hashes),
                                  daemon=True)
        hasher.start()
        files: dict[str, str] = {}
        (folder / "config.json").write_text(json.dumps(plan.config(), indent=4) + "\n")
        alias = AliasReader(reader, source_aliases(ckpt.family, ckpt.spec))
        world = mapping.world_size
        finished = itertools.count(1)  # next() is atomic: the rank threads share it

        def write(rank: int) -> tuple[str, dict[str, str]]:
            written = _write_rank(plan, rank, alias, folder, meter, progress)
            meter.say(f"{next(finished)} of {world} rank files written")
            return written

        # the bytes of every rank file, counted block by block as they are written
        with task("convert", sum(plan.rank_bytes(r) for r in range(world)), "bytes",
                  f"0 of {world} rank files written") as meter, \
                ThreadPoolExecutor(max_workers=min(workers, world)) as pool:
            written = list(pool.map(write, range(world)))
        files["config.json"] = file_digest(folder / "config.json")
        tensors: dict[str, dict[str, str]] = {}
        for rank, (digest, per_tensor) in enumerate(written):
            files[rank_file(rank)] = digest
            tensors[rank_file(rank)] = per_tensor
            remember(folder / rank_file(rank), digest)  # the build needs no re-read
        hasher.join()
        manifest = {
            "kind": "trtllm-checkpoint",
            "architecture": ckpt.family.trtllm_architecture,
            "dtype": dtype,
            "mapping": {"tp": mapping.tp, "pp": mapping.pp, "moe_tp": mapping.moe_tp,
                        "moe_ep": mapping.moe_ep, "world_size": mapping.world_size},
            # digests under the name of their algorithm (older manifests: "sha256")
            "source": {"name": ckpt.path.resolve().name, ALGORITHM: source_hashes},
            "output": {ALGORITHM: files},
            # each tensor's bytes: a live update reads only the tensors that changed
            "tensors": {ALGORITHM: tensors},
            "versions": {"moepipe": __version__, "trtllm_format": TRTLLM_ENGINE_VERSION},
        }
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        size = sum(p.stat().st_size for p in folder.iterdir())
    return ConvertResult(folder, plan, files, size, time.perf_counter() - start)


def _hash_sources(folder: Path, out: dict[str, str]) -> None:
    """Digest every source file (on a thread, while the conversion runs; remembered by stat
    signature, so a build that fingerprinted the source already reads nothing here)."""
    for path in sorted(folder.iterdir()):
        # The build's record of the stage that wrote the folder (file mtimes, timings) is
        # bookkeeping, not model data: the same model must give the same manifest.
        if path.is_file() and path.suffix in (".safetensors", ".json") \
                and path.name != STAGE_FILE:
            out[path.name] = cached_digest(path)


def _write_rank(plan: Plan, rank: int, reader: AliasReader, folder: Path, meter: Task,
                progress: Callable[[str], None] | None = None) -> tuple[str, dict[str, str]]:
    """Write one rank file; returns its digest and its tensors' digests."""
    tensors = plan.ranks[rank]
    writer = SafetensorsWriter(folder / rank_file(rank),
                               [(t.name, t.dtype, t.shape) for t in tensors],
                               on_data=meter.advance)
    pool, scratch = BufferPool(16, BLOCK_BYTES), Scratch()
    try:
        for t in tensors:
            for chunk in t.rule.chunks(t.ctx, reader):
                _emit(writer, chunk, t.dtype, reader.reader, pool, scratch)
        digest = writer.close()
    except BaseException:
        writer.abort()
        raise
    log.info("rank %d: %d tensors written", rank, len(tensors))
    if progress is not None:
        progress(f"rank {rank}: {len(tensors)} tensors")
    return digest, writer.tensor_digests


class Scratch:
    """Reused arrays for column slices (the covering block, and the cut): a fresh array for
    every sliced tensor costs its page faults each time (measured: ~0.1 CPU-s per GB of
    output at tp=4, moe_ep=2)."""

    def __init__(self):
        self._arrays: dict[str, Any] = {}

    def get(self, slot: str, nbytes: int):
        """A uint8 array of ``nbytes`` (contents undefined), reusing the slot's memory."""
        import numpy as np

        array = self._arrays.get(slot)
        if array is None or array.nbytes < nbytes:
            array = self._arrays[slot] = np.empty(nbytes, dtype=np.uint8)
        return array[:nbytes]


def _emit(writer: SafetensorsWriter, chunk, dtype: DType, reader: CheckpointReader,
          pool: BufferPool, scratch: Scratch) -> None:
    """Write one chunk. Contiguous source bytes are copied by the kernel, or streamed through
    reusable block buffers when the dtype changes (converted block by block); other slices are
    read whole (at most one expert matrix) and cut in memory."""
    if isinstance(chunk, Zeros):
        writer.write_zeros(chunk.rows * chunk.cols * dtype.itemsize)
        return
    if not isinstance(chunk, SliceRef):  # computed (torch) chunk of a quantized tensor
        writer.write(chunk)
        return
    if isinstance(reader, Fp8BlockReader) and reader.quantized(chunk.name):
        writer.write(reader.read(chunk.name, chunk.index))  # dequantized block-scaled fp8
        return
    region = reader.region(chunk.name, chunk.index)
    src = region.info.dtype
    if region.cut is not None:  # a column slice: read the covering block, cut it in memory
        import numpy as np

        raw = scratch.get("block", region.nbytes)
        reader.read_bytes(region.info.file, region.offset, raw.data)
        unit = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[src.itemsize]
        block = raw.view(unit).reshape(region.block_shape)[region.cut]
        cut = scratch.get("cut", block.nbytes).view(unit).reshape(block.shape)
        np.copyto(cut, block)
        writer.write_bytes(convert_bytes(cut.data.cast("B"), src, dtype))
        return
    if src == dtype:  # unchanged bytes: the kernel copies them (they never enter the process)
        writer.copy_range(reader.fd(region.info.file), region.offset, region.nbytes)
        return
    step = BLOCK_BYTES - BLOCK_BYTES % src.itemsize
    for start in range(0, region.nbytes, step):
        n = min(step, region.nbytes - start)
        buf = pool.get()
        view = memoryview(buf)[:n]
        reader.read_bytes(region.info.file, region.offset + start, view)
        writer.write_bytes(convert_bytes(view, src, dtype))
        pool.put(buf)


# -- host memory ------------------------------------------------------------------------------
# Python, numpy and moepipe's modules, measured (about 60 MB) plus headroom.
CONVERT_BASE = 150 << 20


def peak_memory(largest_sliced: int = 0, largest_fp8: int = 0) -> int:
    """Peak host bytes of a conversion whose largest column-sliced source tensor has
    ``largest_sliced`` bytes and whose largest block-scaled fp8 matrix ``largest_fp8`` (see
    :func:`convert_memory`; the planner's estimate too)."""
    return CONVERT_BASE + 16 * BLOCK_BYTES + max(3 * largest_sliced, 17 * largest_fp8)


def convert_memory(source: Path | None, mapping: Mapping) -> int:
    """Peak host bytes of a conversion. The converter streams 1 MiB blocks (16 in flight); a
    column slice (row-parallel weights at tp > 1, expert down-projections at moe_tp > 1) reads
    one whole source tensor, cuts it and may cast it: about three copies of the largest such
    tensor. A block-scaled fp8 source (DeepSeek) is dequantized matrix by matrix at any mapping:
    the fp8 bytes, the expanded scales, the float32 weight, their product and a slice - about
    17 times the largest fp8 matrix."""
    largest = 0  # casts of contiguous data happen block by block: no whole-tensor copy
    sliced = mapping.tp > 1 or mapping.moe_tp > 1
    if source is None or not (source / "config.json").is_file() or not (
            sliced or "quantization_config" in (source / "config.json").read_text()):
        return peak_memory()
    ckpt = open_hf_checkpoint(source)  # clear errors for a broken folder
    fp8 = 0
    with ckpt.reader() as reader:
        if sliced:
            largest = max(i.nbytes for i in reader.tensors.values())
        if isinstance(reader, Fp8BlockReader):
            fp8 = max((i.nbytes for n, i in reader.tensors.items() if reader.quantized(n)),
                      default=0)
    return peak_memory(largest, fp8)
