"""Weight-mapping rules: how one TensorRT-LLM tensor of one rank is made from HF tensors.

Each rule is data (HF source names) plus one sharding recipe from TensorRT-LLM's converters
(``tensorrt_llm/models/{llama,qwen}/convert.py``):

* :class:`Replicated` - copied to every rank (norms);
* :class:`Split` - equal contiguous chunks along ``dim`` over the tensor-parallel group;
* :class:`QKV` - ``[q_r; k_r; v_r]``, K/V heads duplicated first when ``num_kv_heads < tp``;
* :class:`GatedPair` - dense gated MLP ``fc = [up_r; gate_r]`` (shared expert), split over tp;
* :class:`Router` - float32, never split, never quantised;
* :class:`ExpertsGatedPair` / :class:`ExpertsDown` - experts of this EP rank stacked, then split
  over moe_tp (``fc = [up_r | gate_r]`` per expert: up first, the activation applies to the
  second half);
* :class:`VocabSplit` - ``lm_head``: vocabulary padded to a multiple of tp, then split.

Each rule describes its rank's tensor once, as a :class:`~moepipe.arch.geometry.Geometry` (the
source slices, column/row-parallel or replicated); the quantized conversion slices weights and
scales with the same description. A rule yields its output as *chunks* whose concatenation is the
tensor: slices of source tensors (:class:`SliceRef`, resolved lazily) or literal tensors
(padding). The converter streams them, so it never holds more than a bounded block of one expert.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from moepipe.arch.geometry import COLUMN, REPLICATED, ROW, Geometry, Part, Zeros, chunk
from moepipe.checkpoints.dtypes import F32, DType

if TYPE_CHECKING:

    from moepipe.arch.spec import ModelSpec
    from moepipe.mapping import Mapping


@dataclass(frozen=True)
class RankContext:
    """Everything a rule needs to know about the rank it is producing."""

    spec: ModelSpec
    mapping: Mapping
    rank: int
    layer: int | None  # global HF layer index, None for model-level tensors
    dtype: DType  # output dtype of ordinary weights

    @property
    def tp(self) -> int:
        return self.mapping.tp

    @property
    def tp_rank(self) -> int:
        return self.mapping.tp_rank(self.rank)

    def name(self, template: str, **kw) -> str:
        return template.format(layer=self.layer, **kw)


@dataclass(frozen=True)
class SliceRef:
    """``tensor[index]`` of a source tensor, resolved (and streamed) by the converter."""

    name: str
    index: tuple = ()


class Reader(Protocol):
    """What rules see of the source checkpoint."""

    def has(self, name: str) -> bool: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def ref(self, name: str, index: tuple = ()) -> SliceRef: ...


@dataclass(frozen=True)
class ExpertSource:
    """Where a family's expert weights live on disk: per-expert keys (hub layout) or fused 3-D
    tensors (``[E, 2I, H]`` gate then up, and ``[E, H, I]``)."""

    gate: str  # per-expert templates with {layer} and {expert}
    up: str
    down: str
    fused_gate_up: str | None = None  # {layer} only
    fused_down: str | None = None

    def fused(self, ctx: RankContext, reader: Reader) -> bool:
        return (self.fused_gate_up is not None
                and not reader.has(ctx.name(self.gate, expert=0))
                and reader.has(ctx.name(self.fused_gate_up)))


@dataclass(frozen=True)
class Rule:
    when: str | None = field(default=None, kw_only=True)  # a ModelSpec bool that enables it
    float32: bool = field(default=False, kw_only=True)

    def enabled(self, spec: ModelSpec) -> bool:
        return self.when is None or bool(getattr(spec, self.when))

    def out_dtype(self, ctx: RankContext) -> DType:
        return F32 if self.float32 else ctx.dtype

    def sources(self, ctx: RankContext, reader: Reader) -> list[str]:
        raise NotImplementedError

    def source_shapes(self, ctx: RankContext) -> dict[str, tuple[int, ...]]:
        """Expected HF shape of each (non-expert) source, for validation."""
        raise NotImplementedError

    def expert_shapes(self, ctx: RankContext, reader: Reader) -> dict[str, tuple[int, ...]]:
        """Expected HF shape of each expert source (their layout depends on the checkpoint)."""
        return {}

    def shape(self, ctx: RankContext) -> tuple[int, ...]:
        raise NotImplementedError

    def fused(self, ctx: RankContext, reader: Reader) -> bool:
        """Whether the checkpoint stores this rule's sources as fused expert tensors."""
        return False

    def geometry(self, ctx: RankContext, fused: bool = False) -> Geometry:
        """The rank's tensor as source slices (``fused``: the fused-experts source layout)."""
        raise NotImplementedError

    def chunks(self, ctx: RankContext, reader: Reader) -> Iterator[SliceRef | Zeros]:
        """The rank's tensor as lazily read source slices (then any padding)."""
        geo = self.geometry(ctx, self.fused(ctx, reader))
        for p in geo.parts():
            yield reader.ref(p.src, p.index)
        if geo.padding is not None:
            yield geo.padding


def _whole(src: str) -> Geometry:
    return Geometry(REPLICATED, ((Part(src),),), (src,))


@dataclass(frozen=True)
class Replicated(Rule):
    src: str
    dims: tuple[str, ...] = ("hidden_size",)

    def sources(self, ctx, reader):
        return [ctx.name(self.src)]

    def source_shapes(self, ctx):
        return {ctx.name(self.src): tuple(getattr(ctx.spec, d) for d in self.dims)}

    def shape(self, ctx):
        return next(iter(self.source_shapes(ctx).values()))

    def geometry(self, ctx, fused=False):
        return _whole(ctx.name(self.src))


@dataclass(frozen=True)
class Split(Rule):
    """A [out, in] linear split over tp along ``dim`` (0: column parallel, 1: row parallel)."""

    src: str
    out_dim: str
    in_dim: str
    dim: int

    def _full(self, ctx):
        return (_size(ctx.spec, self.out_dim), _size(ctx.spec, self.in_dim))

    def sources(self, ctx, reader):
        return [ctx.name(self.src)]

    def source_shapes(self, ctx):
        return {ctx.name(self.src): self._full(ctx)}

    def shape(self, ctx):
        full = list(self._full(ctx))
        full[self.dim] //= ctx.tp
        return tuple(full)

    def geometry(self, ctx, fused=False):
        out, inp = self._full(ctx)
        src = ctx.name(self.src)
        if self.dim == 0:
            part = Part(src, rows=chunk(out, ctx.tp, ctx.tp_rank))
        else:
            part = Part(src, cols=chunk(inp, ctx.tp, ctx.tp_rank))
        return Geometry(COLUMN if self.dim == 0 else ROW, ((part,),), (src,), quantizable=True)


def kv_rows(ctx: RankContext) -> slice:
    """Rows of the K (or V) projection a tensor-parallel rank holds: its KV heads, or the one
    duplicated head when there are fewer KV heads than ranks (TensorRT-LLM ``dup_kv_weight``:
    each KV head repeated tp/num_kv times, then split)."""
    s = ctx.spec
    if s.num_kv_heads >= ctx.tp:
        per = s.num_kv_heads // ctx.tp
        return slice(ctx.tp_rank * per * s.head_dim, (ctx.tp_rank + 1) * per * s.head_dim)
    head = ctx.tp_rank // (ctx.tp // s.num_kv_heads)
    return slice(head * s.head_dim, (head + 1) * s.head_dim)


@dataclass(frozen=True)
class QKV(Rule):
    """Fused attention projection (weight ``[rows, H]`` or bias ``[rows]``)."""

    q: str
    k: str
    v: str
    bias: bool = False

    def _tail(self, ctx):
        return () if self.bias else (ctx.spec.hidden_size,)

    def sources(self, ctx, reader):
        return [ctx.name(self.q), ctx.name(self.k), ctx.name(self.v)]

    def source_shapes(self, ctx):
        s = ctx.spec
        return {ctx.name(self.q): (s.num_heads * s.head_dim, *self._tail(ctx)),
                ctx.name(self.k): (s.num_kv_heads * s.head_dim, *self._tail(ctx)),
                ctx.name(self.v): (s.num_kv_heads * s.head_dim, *self._tail(ctx))}

    def shape(self, ctx):
        s = ctx.spec
        kv_heads = max(1, s.num_kv_heads // ctx.tp)
        rows = (s.num_heads // ctx.tp + 2 * kv_heads) * s.head_dim
        return (rows, *self._tail(ctx))

    def geometry(self, ctx, fused=False):
        s = ctx.spec
        q, k, v = ctx.name(self.q), ctx.name(self.k), ctx.name(self.v)
        rows = kv_rows(ctx)
        parts = (Part(q, rows=chunk(s.num_heads * s.head_dim, ctx.tp, ctx.tp_rank)),
                 Part(k, rows=rows), Part(v, rows=rows))
        return Geometry(COLUMN, (parts,), (q, k, v), quantizable=not self.bias)


@dataclass(frozen=True)
class GatedPair(Rule):
    """Dense gated MLP input projection: ``[up_r; gate_r]`` split over the full tp."""

    gate: str
    up: str
    inter_dim: str

    def sources(self, ctx, reader):
        return [ctx.name(self.up), ctx.name(self.gate)]

    def source_shapes(self, ctx):
        shape = (_size(ctx.spec, self.inter_dim), ctx.spec.hidden_size)
        return {ctx.name(self.up): shape, ctx.name(self.gate): shape}

    def shape(self, ctx):
        return (2 * _size(ctx.spec, self.inter_dim) // ctx.tp, ctx.spec.hidden_size)

    def geometry(self, ctx, fused=False):
        rows = chunk(_size(ctx.spec, self.inter_dim), ctx.tp, ctx.tp_rank)
        up, gate = ctx.name(self.up), ctx.name(self.gate)
        return Geometry(COLUMN, ((Part(up, rows=rows), Part(gate, rows=rows)),), (up, gate),
                        quantizable=True)


@dataclass(frozen=True)
class Router(Rule):
    src: str
    rows: str | int = "num_experts"
    float32: bool = field(default=True, kw_only=True)

    def sources(self, ctx, reader):
        return [ctx.name(self.src)]

    def source_shapes(self, ctx):
        return {ctx.name(self.src): self.shape(ctx)}

    def shape(self, ctx):
        return (_size(ctx.spec, self.rows), ctx.spec.hidden_size)

    def geometry(self, ctx, fused=False):
        return _whole(ctx.name(self.src))


@dataclass(frozen=True)
class _Experts(Rule):
    """A rule over a layer's routed experts (their shapes are checked by ``expert_shapes``)."""

    experts: ExpertSource

    def source_shapes(self, ctx):
        return {}

    def fused(self, ctx, reader):
        return self.experts.fused(ctx, reader)


@dataclass(frozen=True)
class ExpertsGatedPair(_Experts):
    """MoE ``mlp.fc``: ``[E_local, 2*I/moe_tp, H]``, per expert ``[up_r; gate_r]``."""

    def sources(self, ctx, reader):
        e = self.experts
        if e.fused(ctx, reader):
            return [ctx.name(e.fused_gate_up)]
        n = ctx.spec.num_experts
        return [ctx.name(t, expert=x) for x in range(n) for t in (e.up, e.gate)]

    def expert_shapes(self, ctx, reader) -> dict[str, tuple[int, ...]]:
        s, e = ctx.spec, self.experts
        if e.fused(ctx, reader):
            return {ctx.name(e.fused_gate_up): (s.num_experts, 2 * s.expert_intermediate_size,
                                                s.hidden_size)}
        shape = (s.expert_intermediate_size, s.hidden_size)
        return {name: shape for name in self.sources(ctx, reader)}

    def shape(self, ctx):
        s, m = ctx.spec, ctx.mapping
        return (s.num_experts // m.moe_ep, 2 * s.expert_intermediate_size // m.moe_tp,
                s.hidden_size)

    def geometry(self, ctx, fused=False):
        s, m, e = ctx.spec, ctx.mapping, self.experts
        inter = s.expert_intermediate_size
        rows = chunk(inter, m.moe_tp, m.moe_tp_rank(ctx.rank))
        local = m.ep_experts(s.num_experts, ctx.rank)
        if fused:
            name = ctx.name(e.fused_gate_up)
            up_rows = slice(inter + rows.start, inter + rows.stop)
            groups = tuple((Part(name, rows=up_rows, expert=x), Part(name, rows=rows, expert=x))
                           for x in local)
            return Geometry(COLUMN, groups, (name,), experts=True, quantizable=True)
        groups = tuple((Part(ctx.name(e.up, expert=x), rows=rows),
                        Part(ctx.name(e.gate, expert=x), rows=rows)) for x in local)
        every = tuple(ctx.name(t, expert=x) for x in range(s.num_experts) for t in (e.up, e.gate))
        return Geometry(COLUMN, groups, every, experts=True, quantizable=True)


@dataclass(frozen=True)
class ExpertsDown(_Experts):
    """MoE ``mlp.proj``: ``[E_local, H, I/moe_tp]``."""

    def sources(self, ctx, reader):
        e = self.experts
        if e.fused(ctx, reader):
            return [ctx.name(e.fused_down)]
        return [ctx.name(e.down, expert=x) for x in range(ctx.spec.num_experts)]

    def expert_shapes(self, ctx, reader) -> dict[str, tuple[int, ...]]:
        s, e = ctx.spec, self.experts
        if e.fused(ctx, reader):
            return {ctx.name(e.fused_down): (s.num_experts, s.hidden_size,
                                             s.expert_intermediate_size)}
        shape = (s.hidden_size, s.expert_intermediate_size)
        return {name: shape for name in self.sources(ctx, reader)}

    def shape(self, ctx):
        s, m = ctx.spec, ctx.mapping
        return (s.num_experts // m.moe_ep, s.hidden_size, s.expert_intermediate_size // m.moe_tp)

    def geometry(self, ctx, fused=False):
        s, m, e = ctx.spec, ctx.mapping, self.experts
        cols = chunk(s.expert_intermediate_size, m.moe_tp, m.moe_tp_rank(ctx.rank))
        local = m.ep_experts(s.num_experts, ctx.rank)
        if fused:
            name = ctx.name(e.fused_down)
            groups = tuple((Part(name, cols=cols, expert=x),) for x in local)
            return Geometry(ROW, groups, (name,), experts=True, quantizable=True)
        groups = tuple((Part(ctx.name(e.down, expert=x), cols=cols),) for x in local)
        every = tuple(ctx.name(e.down, expert=x) for x in range(s.num_experts))
        return Geometry(ROW, groups, every, experts=True, quantizable=True)


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


@dataclass(frozen=True)
class VocabSplit(Rule):
    """``lm_head``: vocab padded with zero rows to a multiple of tp, then split on dim 0.
    ``tied`` names the embedding to use when the model ties its word embeddings."""

    src: str
    tied: str

    def _src(self, ctx):
        return self.tied if ctx.spec.tie_word_embeddings else self.src

    def sources(self, ctx, reader):
        return [self._src(ctx)]

    def source_shapes(self, ctx):
        return {self._src(ctx): (ctx.spec.vocab_size, ctx.spec.hidden_size)}

    def shape(self, ctx):
        return (padded_vocab(ctx.spec.vocab_size, ctx.tp) // ctx.tp, ctx.spec.hidden_size)

    def geometry(self, ctx, fused=False):
        rows, hidden = self.shape(ctx)
        start = ctx.tp_rank * rows
        stop = max(start, min(start + rows, ctx.spec.vocab_size))
        src = self._src(ctx)
        parts = (Part(src, rows=slice(start, stop)),) if stop > start else ()
        padding = Zeros(start + rows - stop, hidden) if start + rows > stop else None
        return Geometry(COLUMN, (parts,), (src,), padding=padding)


def _size(spec: ModelSpec, dim: str | int) -> int:
    return dim if isinstance(dim, int) else getattr(spec, dim)
