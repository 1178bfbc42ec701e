"""Planning a conversion: every output tensor of every rank, its shape and dtype, and the HF
tensors it reads. Planning validates the checkpoint (missing tensors, wrong shapes, unmapped
tensors, impossible splits, relabelled dtypes) before anything is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from moepipe.arch.family import Family
from moepipe.arch.rules import RankContext, Rule, SliceRef
from moepipe.arch.spec import ModelSpec
from moepipe.checkpoints.dtypes import BF16, F16, F32, DType
from moepipe.checkpoints.fp8_block import SCALE_SUFFIX, Fp8BlockReader
from moepipe.checkpoints.modelopt import QuantInfo
from moepipe.checkpoints.mxfp4 import BLOCKS, SCALES
from moepipe.checkpoints.reader import CheckpointReader
from moepipe.errors import CheckpointError, ConfigError
from moepipe.mapping import Mapping, check_mapping
from moepipe.quant.trtllm import quantized_rules
from moepipe.trtllm.checkpoint_config import build_config, quantization_block

MXFP4_PARTS = (BLOCKS, SCALES)  # an MXFP4 weight's companions (read with it)
DTYPES = {"float32": F32, "float16": F16, "bfloat16": BF16}


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


def source_aliases(family: Family, spec: ModelSpec) -> dict[str, str]:
    """Per-layer source name -> the alternative name the family's checkpoints may use."""
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
    reader = AliasReader(reader, source_aliases(family, spec))
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
