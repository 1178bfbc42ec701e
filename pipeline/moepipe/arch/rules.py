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

A rule yields its output as *chunks* whose concatenation is the tensor: slices of source tensors
(:class:`SliceRef`, resolved lazily) or literal tensors (padding). The converter streams them, so
it never holds more than a bounded block of one expert.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from moepipe.checkpoints.st_io import F32, DType

if TYPE_CHECKING:

    from moepipe.arch.spec import ModelSpec
    from moepipe.trtllm.mapping import Mapping


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
class Zeros:
    """``rows`` x ``cols`` zeros of the output (vocabulary padding)."""

    rows: int
    cols: int


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

    def shape(self, ctx: RankContext) -> tuple[int, ...]:
        raise NotImplementedError

    def chunks(self, ctx: RankContext, reader: Reader) -> Iterator[SliceRef | Zeros]:
        raise NotImplementedError


def _chunk(total: int, parts: int, index: int) -> slice:
    size = total // parts
    return slice(index * size, (index + 1) * size)


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

    def chunks(self, ctx, reader):
        yield reader.ref(ctx.name(self.src))


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

    def chunks(self, ctx, reader):
        out, inp = self._full(ctx)
        if self.dim == 0:
            yield reader.ref(ctx.name(self.src), (_chunk(out, ctx.tp, ctx.tp_rank),))
        else:
            yield reader.ref(ctx.name(self.src), (slice(None), _chunk(inp, ctx.tp, ctx.tp_rank)))


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

    def kv_rows(self, ctx) -> slice:
        s = ctx.spec
        if s.num_kv_heads >= ctx.tp:
            per = s.num_kv_heads // ctx.tp
            return slice(ctx.tp_rank * per * s.head_dim, (ctx.tp_rank + 1) * per * s.head_dim)
        # dup_kv_weight: each KV head repeated tp/num_kv times, then split -> one head per rank.
        head = ctx.tp_rank // (ctx.tp // s.num_kv_heads)
        return slice(head * s.head_dim, (head + 1) * s.head_dim)

    def shape(self, ctx):
        s = ctx.spec
        kv_heads = max(1, s.num_kv_heads // ctx.tp)
        rows = (s.num_heads // ctx.tp + 2 * kv_heads) * s.head_dim
        return (rows, *self._tail(ctx))

    def chunks(self, ctx, reader):
        s = ctx.spec
        q_rows = _chunk(s.num_heads * s.head_dim, ctx.tp, ctx.tp_rank)
        yield reader.ref(ctx.name(self.q), (q_rows,))
        rows = self.kv_rows(ctx)
        yield reader.ref(ctx.name(self.k), (rows,))
        yield reader.ref(ctx.name(self.v), (rows,))


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

    def chunks(self, ctx, reader):
        rows = _chunk(_size(ctx.spec, self.inter_dim), ctx.tp, ctx.tp_rank)
        yield reader.ref(ctx.name(self.up), (rows,))
        yield reader.ref(ctx.name(self.gate), (rows,))


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

    def chunks(self, ctx, reader):
        yield reader.ref(ctx.name(self.src))


@dataclass(frozen=True)
class ExpertsGatedPair(Rule):
    """MoE ``mlp.fc``: ``[E_local, 2*I/moe_tp, H]``, per expert ``[up_r; gate_r]``."""

    experts: ExpertSource

    def sources(self, ctx, reader):
        e = self.experts
        if e.fused(ctx, reader):
            return [ctx.name(e.fused_gate_up)]
        n = ctx.spec.num_experts
        return [ctx.name(t, expert=x) for x in range(n) for t in (e.up, e.gate)]

    def source_shapes(self, ctx):
        return {}

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

    def chunks(self, ctx, reader):
        s, m, e = ctx.spec, ctx.mapping, self.experts
        inter = s.expert_intermediate_size
        rows = _chunk(inter, m.moe_tp, m.moe_tp_rank(ctx.rank))
        fused = e.fused(ctx, reader)
        for x in m.ep_experts(s.num_experts, ctx.rank):
            if fused:
                name = ctx.name(e.fused_gate_up)
                yield reader.ref(name, (x, slice(inter + rows.start, inter + rows.stop)))
                yield reader.ref(name, (x, rows))
            else:
                yield reader.ref(ctx.name(e.up, expert=x), (rows,))
                yield reader.ref(ctx.name(e.gate, expert=x), (rows,))


@dataclass(frozen=True)
class ExpertsDown(Rule):
    """MoE ``mlp.proj``: ``[E_local, H, I/moe_tp]``."""

    experts: ExpertSource

    def sources(self, ctx, reader):
        e = self.experts
        if e.fused(ctx, reader):
            return [ctx.name(e.fused_down)]
        return [ctx.name(e.down, expert=x) for x in range(ctx.spec.num_experts)]

    def source_shapes(self, ctx):
        return {}

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

    def chunks(self, ctx, reader):
        s, m, e = ctx.spec, ctx.mapping, self.experts
        cols = _chunk(s.expert_intermediate_size, m.moe_tp, m.moe_tp_rank(ctx.rank))
        fused = e.fused(ctx, reader)
        for x in m.ep_experts(s.num_experts, ctx.rank):
            if fused:
                yield reader.ref(ctx.name(e.fused_down), (x, slice(None), cols))
            else:
                yield reader.ref(ctx.name(e.down, expert=x), (slice(None), cols))


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

    def chunks(self, ctx, reader):
        rows, hidden = self.shape(ctx)
        start = ctx.tp_rank * rows
        stop = max(start, min(start + rows, ctx.spec.vocab_size))
        if stop > start:
            yield reader.ref(self._src(ctx), (slice(start, stop),))
        if start + rows > stop:
            yield Zeros(start + rows - stop, hidden)


def _size(spec: ModelSpec, dim: str | int) -> int:
    return dim if isinstance(dim, int) else getattr(spec, dim)
