"""Stage ``convert``: Hugging Face checkpoint -> TensorRT-LLM checkpoint (tp/pp/moe_tp/moe_ep).

The conversion is planned completely before a byte is written: every output tensor of every
rank, its shape and dtype, and the HF tensors it reads. Planning validates the checkpoint
(missing tensors, wrong shapes, unmapped tensors, impossible splits). Writing then streams: each
rank file's header is written first and tensor data follows expert by expert, so resident memory
stays around one expert slice, not a layer and never the model. The output appears atomically.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moepipe import __version__
from moepipe.arch.family import Family
from moepipe.arch.geometry import Zeros
from moepipe.arch.hf import HFCheckpoint, open_hf_checkpoint
from moepipe.arch.rules import RankContext, Rule, SliceRef
from moepipe.arch.spec import ModelSpec
from moepipe.checkpoints.casts import convert_bytes
from moepipe.checkpoints.digest import ALGORITHM, file_digest
from moepipe.checkpoints.dtypes import BF16, F16, F32, DType
from moepipe.checkpoints.fp8_block import SCALE_SUFFIX, Fp8BlockReader
from moepipe.checkpoints.hashcache import remember
from moepipe.checkpoints.modelopt import QuantInfo
from moepipe.checkpoints.mxfp4 import BLOCKS, SCALES
from moepipe.checkpoints.reader import CheckpointReader
from moepipe.checkpoints.writer import BufferPool, SafetensorsWriter
from moepipe.config import MoepipeConfig
from moepipe.errors import CheckpointError, ConfigError
from moepipe.mapping import Mapping, check_mapping
from moepipe.quant.trtllm import quantized_rules
from moepipe.stages.base import BuildContext, Stage, gib
from moepipe.stages.integrity import STAGE_FILE
from moepipe.trtllm.checkpoint_config import build_config, quantization_block
from moepipe.trtllm.versions import TRTLLM_ENGINE_VERSION
from moepipe.utils.fs import atomic_dir

log = logging.getLogger("moepipe")

MXFP4_PARTS = (BLOCKS, SCALES)  # an MXFP4 weight's companions (read with it)
DTYPES = {"float32": F32, "float16": F16, "bfloat16": BF16}
MANIFEST = "moepipe-manifest.json"
# Streaming block: small enough to stay in CPU cache between read, hash and write.
BLOCK_BYTES = 1 << 20


class AliasReader:
    """A reader that also finds a tensor under the family's alternative name."""

    def __init__(self, reader, aliases: dict[str, str]):
        self.reader = reader
        self.aliases = aliases

    def resolve(self, name: str) -> str:
        if not self.reader.has(name) and name in self.aliases:
            return self.aliases[name]
        return name

    def has(self, name: str) -> bool:
        return self.reader.has(self.resolve(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self.resolve(name))

    def ref(self, name: str, index: tuple = ()) -> SliceRef:
        return SliceRef(self.resolve(name), index)

    def read(self, name: str, index: tuple = ()):
        """A computed chunk's input (torch): quantized checkpoints need arithmetic."""
        return self.reader.read(self.resolve(name), index)


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: DType
    rule: Rule
    ctx: RankContext


@dataclass
class Plan:
    family: Family
    spec: ModelSpec
    mapping: Mapping
    dtype: str
    ranks: list[list[PlannedTensor]]
    sources: set[str] = field(default_factory=set)
    quant: QuantInfo | None = None

    def rank_bytes(self, rank: int) -> int:
        return sum(t.dtype.itemsize * _numel(t.shape) for t in self.ranks[rank])

    def config(self) -> dict:
        block = quantization_block(self.quant) if self.quant is not None else None
        return build_config(self.family, self.spec, self.mapping, self.dtype, block)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _aliases(family: Family, spec: ModelSpec) -> dict[str, str]:
    out = {}
    for orig, alt in family.source_aliases.items():
        for layer in range(spec.num_layers):
            out[orig.format(layer=layer)] = alt.format(layer=layer)
    return out


def plan_conversion(family: Family, spec: ModelSpec, mapping: Mapping, dtype: str,
                    reader, quant: QuantInfo | None = None) -> Plan:
    """Plan every rank's tensors and validate the source checkpoint against the plan.

    ``reader`` only needs ``has`` and ``shape`` (so a shape-only reader of a meta-device model
    plans full-size models without weights).
    """
    check_mapping(spec, mapping)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype '{dtype}' is not supported",
                          f"choose one of {', '.join(DTYPES)}")
    reader = AliasReader(reader, _aliases(family, spec))
    out_dtype = DTYPES[dtype]
    ranks: list[list[PlannedTensor]] = []
    sources: set[str] = set()
    expected: dict[str, tuple[int, ...]] = {}
    for rank in range(mapping.world_size):
        tensors = []
        layers = mapping.pp_layers(spec.num_layers, rank)
        for layer in layers:
            ctx = RankContext(spec, mapping, rank, layer, out_dtype)
            for suffix, rule in family.rules_for(spec, layer).items():
                if not rule.enabled(spec):
                    continue
                rules = {suffix: rule} if quant is None else quantized_rules(
                    suffix, rule, reader, ctx, quant, out_dtype)
                for sfx, r in rules.items():
                    name = f"transformer.layers.{layer - layers.start}.{sfx}"
                    tensors.append(_plan_one(name, r, ctx, reader, sources, expected))
        ctx = RankContext(spec, mapping, rank, None, out_dtype)
        for name, (stage, rule) in family.model_rules.items():
            on_stage = (mapping.is_first_stage(rank) if stage == "first"
                        else mapping.is_last_stage(rank))
            if on_stage and rule.enabled(spec):
                tensors.append(_plan_one(name, rule, ctx, reader, sources, expected))
        ranks.append(tensors)
    _validate_sources(reader, expected)
    return Plan(family, spec, mapping, dtype, ranks, {reader.resolve(s) for s in sources}, quant)


def _plan_one(name, rule, ctx, reader, sources, expected) -> PlannedTensor:
    srcs = rule.sources(ctx, reader)
    sources.update(srcs)
    shapes = dict(rule.source_shapes(ctx))
    shapes.update(rule.expert_shapes(ctx, reader))
    expected.update(shapes)
    return PlannedTensor(name, rule.shape(ctx), rule.out_dtype(ctx), rule, ctx)


def _validate_sources(reader: AliasReader, expected: dict[str, tuple[int, ...]]) -> None:
    missing = [n for n in expected if not reader.has(n)]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s) {', '.join(missing[:3])}{more}",
                              "the checkpoint is incomplete or its config.json does not match "
                              "its weights")
    for name, shape in expected.items():
        got = tuple(reader.shape(name))
        if got != tuple(shape):
            raise CheckpointError(f"tensor '{name}' has shape {list(got)} but config.json implies "
                                  f"{list(shape)}",
                                  "config.json and the weights disagree (wrong config?)")


FLOAT_DTYPES = ("F32", "F16", "BF16")


def check_float_sources(names: set[str], reader: CheckpointReader) -> None:
    """Every weight an unquantized conversion reads must be stored as a float: a header that
    relabels a tensor (F32 called I32: same bytes, so the sizes still agree) is caught here,
    while planning, before anything is written."""
    for name in sorted(names):
        if isinstance(reader, Fp8BlockReader) and reader.quantized(name):
            continue  # read dequantized
        info = reader.info(name)
        if info.dtype.name not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{info.file}: tensor '{name}' is stored as {info.dtype.name}; the weights of an "
                f"unquantized checkpoint are {', '.join(FLOAT_DTYPES)}",
                "the shard's header mislabels the tensor (the file is corrupt); re-download "
                "or re-save the shard")


def unmapped_tensors(plan: Plan, names, family: Family) -> list[str]:
    """HF tensors the plan neither reads nor explicitly drops."""
    dropped = [re.compile(p) for p in family.dropped_for(plan.spec)]
    return sorted(n for n in names
                  if n not in plan.sources and not any(p.match(n) for p in dropped)
                  and not (n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX)
                           in plan.sources)
                  and not (n.endswith(MXFP4_PARTS) and n.rsplit("_", 1)[0] in plan.sources))


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
        alias = AliasReader(reader, _aliases(ckpt.family, ckpt.spec))
        with ThreadPoolExecutor(max_workers=min(workers, mapping.world_size)) as pool:
            digests = list(pool.map(lambda r: _write_rank(plan, r, alias, folder, progress),
                                    range(mapping.world_size)))
        files["config.json"] = file_digest(folder / "config.json")
        for rank, digest in enumerate(digests):
            files[f"rank{rank}.safetensors"] = digest
            remember(folder / f"rank{rank}.safetensors", digest)  # the build needs no re-read
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
            "versions": {"moepipe": __version__, "trtllm_format": TRTLLM_ENGINE_VERSION},
        }
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        written = sum(p.stat().st_size for p in folder.iterdir())
    return ConvertResult(folder, plan, files, written, time.perf_counter() - start)


def _hash_sources(folder: Path, out: dict[str, str]) -> None:
    """Digest every source file (on a thread, while the conversion runs; remembered by stat
    signature, so a build that fingerprinted the source already reads nothing here)."""
    from moepipe.checkpoints.hashcache import file_digest

    for path in sorted(folder.iterdir()):
        # The build's record of the stage that wrote the folder (file mtimes, timings) is
        # bookkeeping, not model data: the same model must give the same manifest.
        if path.is_file() and path.suffix in (".safetensors", ".json") \
                and path.name != STAGE_FILE:
            out[path.name] = file_digest(path)


def _write_rank(plan: Plan, rank: int, reader: AliasReader, folder: Path,
                progress: Callable[[str], None] | None = None) -> str:
    tensors = plan.ranks[rank]
    writer = SafetensorsWriter(folder / f"rank{rank}.safetensors",
                               [(t.name, t.dtype, t.shape) for t in tensors])
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
    return digest


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
        return CONVERT_BASE + 16 * BLOCK_BYTES
    ckpt = open_hf_checkpoint(source)  # clear errors for a broken folder
    fp8 = 0
    with ckpt.reader() as reader:
        if sliced:
            largest = max(i.nbytes for i in reader.tensors.values())
        if isinstance(reader, Fp8BlockReader):
            fp8 = max((i.nbytes for n, i in reader.tensors.items() if reader.quantized(n)),
                      default=0)
    return CONVERT_BASE + 16 * BLOCK_BYTES + max(3 * largest, 17 * fp8)


# -- the stage ---------------------------------------------------------------------------------
def _settings(cfg: MoepipeConfig) -> dict[str, Any]:
    m = cfg.parallel.to_mapping()
    return {"tp": m.tp, "pp": m.pp, "moe_tp": m.moe_tp, "moe_ep": m.moe_ep,
            "dtype": cfg.model.dtype}


def _run(ctx: BuildContext, out: Path) -> dict[str, Any]:
    res = convert_into(open_hf_checkpoint(ctx.model_dir), out, ctx.cfg.parallel.to_mapping(),
                       dtype=ctx.cfg.model.dtype, workers=ctx.cfg.convert.workers,
                       progress=ctx.step)
    world = res.plan.mapping.world_size
    return {"world_size": world, "dtype": res.plan.dtype, "bytes": res.bytes_written,
            "rank_bytes": [res.plan.rank_bytes(r) for r in range(world)]}


def _preflight(ctx: BuildContext) -> None:
    """Families the target cannot take are refused before anything runs."""
    from moepipe.arch import get_family
    from moepipe.arch.targets import check_quantizable, check_target
    from moepipe.stages.source import source_spec

    spec = source_spec(ctx)
    if spec is None:
        return
    family = get_family(spec.architecture)
    check_target(family, ctx.cfg.target, spec)
    check_quantizable(family, ctx.cfg.quantize.format)


def _memory(ctx: BuildContext) -> int:
    try:
        source: Path | None = ctx.model_dir
    except KeyError:
        source = None
    return convert_memory(source, ctx.cfg.parallel.to_mapping())


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _disk(ctx: BuildContext) -> int:
    """Bytes the output takes: the source's weights, scaled when the dtype changes."""
    source = ctx.model_dir
    total = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    ratio = 1.0
    if ctx.cfg.model.dtype != "auto" and ctx.cfg.quantize.format == "none" \
            and (source / "config.json").is_file():
        src = open_hf_checkpoint(source).spec.torch_dtype
        ratio = _ITEMSIZE[ctx.cfg.model.dtype] / _ITEMSIZE.get(src, 2)
    if (source / "config.json").is_file() and open_hf_checkpoint(source).fp8_block:
        # 1-byte weights come out in the model dtype (an upper bound: bf16 parts count twice)
        spec = open_hf_checkpoint(source).spec
        ratio = _ITEMSIZE[spec.torch_dtype if ctx.cfg.model.dtype == "auto"
                          else ctx.cfg.model.dtype]
    if (source / "config.json").is_file() and open_hf_checkpoint(source).mxfp4:
        # 4.25-bit MXFP4 experts come out in the model dtype (an upper bound, as above)
        spec = open_hf_checkpoint(source).spec
        ratio = 4 * _ITEMSIZE[spec.torch_dtype if ctx.cfg.model.dtype == "auto"
                              else ctx.cfg.model.dtype]
    return int(total * ratio * 1.05) + (1 << 20)  # padded vocab, duplicated KV heads


STAGE = Stage("convert", 1, applies=lambda cfg: cfg.target in ("cpu", "trtllm-engine"),
              settings=_settings, inputs=("source", "quantize"), tools=(), run=_run,
              estimate=lambda ctx: {"host memory (peak)": gib(_memory(ctx))}, memory=_memory,
              preflight=_preflight,
              memory_hint="free memory, or use a smaller tp / moe_tp (column slices read whole "
                          "tensors)", link="checkpoint", disk=_disk)
