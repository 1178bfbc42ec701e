"""TensorRT-LLM quantized checkpoints from modelopt's unified Hugging Face export.

modelopt writes per-module tensors (``weight`` in the quantized dtype, ``weight_scale``,
``input_scale``, ``pre_quant_scale``, ``k_scale``/``v_scale``). TensorRT-LLM wants them fused and
sharded like the unquantized weights, with its own names (``tensorrt_llm/quantization/layers.py``,
``layers/moe.py``):

======================  ==================================================================
FP8                     ``weight`` fp8; ``weights_scaling_factor`` [1] (experts [E_local, 1]);
                        ``activation_scaling_factor`` [1]. Parts fused into one tensor (q/k/v,
                        up/gate) share one weight scale: the max, the others requantized to it
                        (moepipe's own export shares it before quantizing: nothing to redo).
                        The experts' activation scale is the max over all experts.
W4A16_AWQ               ``weight`` int8 [out/2, in] (two int4 rows per byte, low nibble = even
                        row); ``weights_scaling_factor`` [out, in/128] (f32, TensorRT-LLM
                        transposes it at load); ``prequant_scaling_factor`` [in] (experts
                        [E_local, in]) in the model dtype; ones where modelopt folded it into
                        the norm (q/k/v).
W8A8_SQ_PER_CHANNEL     TensorRT-LLM 1.2's non-plugin path (``Int8SmoothQuantLinear`` /
                        ``Int8SmoothQuantRowLinear``): ``weight`` int8 [out, in];
                        ``weights_scaling_factor`` [out]; ``activation_scaling_factor`` [1];
                        ``prequant_scaling_factor`` [in] in the model dtype (the input is
                        multiplied by it); norms unchanged. The MoE block is excluded: there is
                        no SmoothQuant MoE, routed experts stay in the model dtype (quantized
                        ones are refused).
KV cache (FP8 / INT8)   ``attention.kv_cache_scaling_factor`` [1] = max(k_scale, v_scale)
                        (FP8 clamped to >= 1, as modelopt's TensorRT-LLM export does).
======================  ==================================================================

Sharding is the unquantized one: each rule's :class:`~moepipe.arch.geometry.Geometry` (the same
description the plain conversion streams) says which rows / columns of which module a rank takes;
column-parallel scales follow their rows, row-parallel AWQ scales and pre-quant scales follow the
input slice, per-tensor scales are replicated. Every value is computed from the whole source
tensors, so any mapping holds exactly the same quantized values as tp=1.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from moepipe.arch.geometry import COLUMN, ROW, Geometry, Part
from moepipe.arch.rules import RankContext, Rule
from moepipe.checkpoints.dtypes import DTYPES, F32, DType
from moepipe.checkpoints.modelopt import AWQ, FP8, FP8_MAX, GROUP, SQ, QuantInfo
from moepipe.errors import MappingError, UnsupportedError


def _quantizable(geo: Geometry) -> bool:
    return geo.quantizable and geo.parallel in (COLUMN, ROW)


# -- the tensors ----------------------------------------------------------------------------
@dataclass(frozen=True)
class QTensor(Rule):
    """One TensorRT-LLM tensor of a quantized linear layer (``kind``: weight,
    weights_scaling_factor, activation_scaling_factor, prequant_scaling_factor)."""

    base: Rule
    kind: str
    algo: str
    model_dtype: DType = field(default=F32, kw_only=True)

    def sources(self, ctx, reader):
        parts = self.base.geometry(ctx).parts()
        return [n for p in parts for n in (f"{p.module}.weight",)] \
            + [n for p in parts for n in _companions(p.module, reader)]

    def source_shapes(self, ctx):
        return {}

    def out_dtype(self, ctx) -> DType:
        if self.kind == "weight":
            return {FP8: DTYPES["F8_E4M3"], AWQ: DTYPES["I8"], SQ: DTYPES["I8"]}[self.algo]
        if self.kind == "prequant_scaling_factor":
            return self.model_dtype
        return F32

    def shape(self, ctx) -> tuple[int, ...]:
        base_shape = self.base.shape(ctx)
        experts = base_shape[0] if self.base.geometry(ctx).experts else None
        out, inp = base_shape[-2], base_shape[-1]
        lead = (experts,) if experts is not None else ()
        k, a = self.kind, self.algo
        if k == "weight":
            return (*lead, out // 2, inp) if a == AWQ else base_shape
        if k == "weights_scaling_factor":
            if a == FP8:
                return (experts, 1) if experts is not None else (1,)
            if a == SQ:
                return (out,)
            return (*lead, out, inp // GROUP)
        if k == "activation_scaling_factor":
            return (1,)
        if k == "prequant_scaling_factor":
            return (*lead, inp)
        raise ValueError(k)

    def chunks(self, ctx, reader) -> Iterator:
        import torch

        k, a = self.kind, self.algo
        geo = self.base.geometry(ctx)
        if geo.parallel == COLUMN:
            groups = geo.groups
            if k == "weight":
                for group in groups:
                    target = _group_scale(group, reader) if a == FP8 else None
                    for p in group:
                        yield _column_weight(p, reader, a, target)
            elif k == "weights_scaling_factor":
                if a == FP8:
                    yield torch.tensor([_group_scale(g, reader) for g in groups],
                                       dtype=torch.float32).reshape(self.shape(ctx))
                else:  # AWQ blocks and SmoothQuant channels follow their rows
                    for group in groups:
                        for p in group:
                            yield reader.read(f"{p.module}.weight_scale", (p.rows,))
            elif k == "activation_scaling_factor":
                yield torch.tensor(_input_scale_max(geo, reader)).reshape(self.shape(ctx))
            elif k == "prequant_scaling_factor":
                for group in groups:
                    yield _pqs(group[0].module, reader, ctx.spec.hidden_size)
            else:
                raise ValueError(k)
            return
        parts = geo.parts()
        if k == "weight":
            for p in parts:
                yield reader.ref(f"{p.module}.weight", (slice(None), p.cols))
        elif k == "weights_scaling_factor":
            if a == FP8:
                yield torch.tensor([_scale(reader, f"{p.module}.weight_scale") for p in parts],
                                   dtype=torch.float32).reshape(self.shape(ctx))
            elif a == SQ:  # per output channel; a row-parallel output is not split
                yield reader.read(f"{parts[0].module}.weight_scale").reshape(-1)
            else:
                blocks = slice(p0.cols.start // GROUP, p0.cols.stop // GROUP) \
                    if (p0 := parts[0]).cols is not None else None
                for p in parts:
                    yield reader.read(f"{p.module}.weight_scale", (slice(None), blocks))
        elif k == "activation_scaling_factor":
            yield torch.tensor(_input_scale_max(geo, reader)).reshape(self.shape(ctx))
        elif k == "prequant_scaling_factor":
            for p in parts:
                yield _pqs(p.module, reader, None)[p.cols]
        else:
            raise ValueError(k)


def _companions(module: str, reader) -> list[str]:
    return [f"{module}.{n}" for n in ("weight_scale", "input_scale", "pre_quant_scale")
            if reader.has(f"{module}.{n}")]


def _scale(reader, name: str) -> float:
    return float(reader.read(name).float().reshape(-1)[0])


def _group_scale(group: tuple[Part, ...], reader) -> float:
    """FP8 parts fused into one tensor share the largest weight scale."""
    return max(_scale(reader, f"{p.module}.weight_scale") for p in group)


def _column_weight(p: Part, reader, algo: str, target: float | None):
    import torch

    rows = p.rows if p.rows is not None else slice(None)  # column parts always have rows
    if algo == AWQ:  # two logical rows per packed row
        packed = slice(rows.start // 2, rows.stop // 2)
        return reader.read(f"{p.module}.weight", (packed,)).view(torch.int8)
    w = reader.read(f"{p.module}.weight", (rows,))
    if algo == FP8 and target is not None:
        own = _scale(reader, f"{p.module}.weight_scale")
        if own != target:  # requantize to the shared scale
            w = (w.float() * (own / target)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w


def _input_scale_max(geo: Geometry, reader) -> float:
    """One activation scale per fused tensor; for experts the max over ALL experts (the same on
    every rank, as TensorRT-LLM's MoE takes one scale per layer)."""
    return max(_scale(reader, f"{n.removesuffix('.weight')}.input_scale")
               for n in geo.layer_sources)


def _pqs(module: str, reader, size: int | None):
    """pre_quant_scale of a module; ones where modelopt folded it into the preceding norm."""
    import torch

    name = f"{module}.pre_quant_scale"
    if reader.has(name):
        return reader.read(name).float()
    if size is None:
        size = reader.shape(f"{module}.weight")[-1]
    return torch.ones(size)


@dataclass(frozen=True)
class KvScale(Rule):
    """``attention.kv_cache_scaling_factor`` from the k/v projections' k_scale / v_scale."""

    qkv: Rule  # the attention.qkv.weight rule
    kv_algo: str
    float32: bool = field(default=True, kw_only=True)

    def sources(self, ctx, reader):
        _, k, v = self.qkv.geometry(ctx).layer_sources  # q, k, v
        return [f"{k.removesuffix('.weight')}.k_scale", f"{v.removesuffix('.weight')}.v_scale"]

    def source_shapes(self, ctx):
        return {}

    def shape(self, ctx):
        return (1,)

    def chunks(self, ctx, reader):
        import torch

        k, v = (_scale(reader, n) for n in self.sources(ctx, reader))
        scale = max(k, v)
        if self.kv_algo == "FP8":
            scale = max(scale, 1.0)
        yield torch.tensor([scale], dtype=torch.float32)


KINDS = {
    FP8: ("weight", "weights_scaling_factor", "activation_scaling_factor"),
    AWQ: ("weight", "weights_scaling_factor", "prequant_scaling_factor"),
    SQ: ("weight", "weights_scaling_factor", "activation_scaling_factor",
         "prequant_scaling_factor"),
}


def quantized_rules(suffix: str, rule: Rule, reader, ctx: RankContext, info: QuantInfo,
                    dtype: DType) -> dict[str, Rule]:
    """TensorRT-LLM tensors for one family rule of a quantized checkpoint (suffix -> rule)."""
    extra: dict[str, Rule]
    if suffix == "attention.qkv.weight" and info.kv_algo is not None:
        extra = {"attention.kv_cache_scaling_factor": KvScale(rule, info.kv_algo)}
    else:
        extra = {}
    geo = rule.geometry(ctx)
    if not _quantizable(geo) or not reader.has(f"{geo.parts()[0].module}.weight_scale"):
        return {suffix: rule, **extra}
    if info.algo == AWQ:
        _check_awq_split(geo)
    if info.algo == SQ and geo.experts:
        raise UnsupportedError(
            f"this int8_sq (SmoothQuant) checkpoint has quantized routed experts ({suffix}); "
            "TensorRT-LLM 1.2 has no SmoothQuant MoE (it keeps the MoE block in the model "
            "dtype)", "quantize with moepipe (its int8_sq leaves the routed experts "
            "unquantized), or use fp8 / int4_awq")
    prefix = suffix.removesuffix(".weight")
    tensors: dict[str, Rule] = {f"{prefix}.{k}": QTensor(rule, k, info.algo, model_dtype=dtype)
                                for k in KINDS[info.algo]}
    return tensors | extra


def _check_awq_split(geo: Geometry) -> None:
    width = geo.parts()[0].cols
    if geo.parallel == ROW and width is not None and (width.stop - width.start) % GROUP:
        raise MappingError(
            f"int4_awq: a rank's slice of the row-parallel input has "
            f"{width.stop - width.start} channels, not a multiple of the AWQ block {GROUP}",
            "use a smaller tp / moe_tp (or expert parallelism) for this model")
