"""The geometry of one rank's tensor: which slices of which HF source tensors it is made of.

Each rule (:mod:`moepipe.arch.rules`) describes its rank's tensor once, as a :class:`Geometry`.
The plain conversion streams the parts in order (``Rule.chunks``); the quantized conversion
(:mod:`moepipe.quant.trtllm`) slices the quantized weights and their scales with the same parts,
so the sharding arithmetic exists in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

COLUMN = "column"  # split along the output rows (scales follow the rows)
ROW = "row"  # split along the input columns (scales follow the input slice)
REPLICATED = "replicated"  # the whole source on every rank


@dataclass(frozen=True)
class Zeros:
    """``rows`` x ``cols`` zeros of the output (vocabulary padding)."""

    rows: int
    cols: int


@dataclass(frozen=True)
class Part:
    """One slice of a source tensor; a rank's tensor is its parts concatenated in order."""

    src: str  # HF tensor name (layer and expert filled in)
    rows: slice | None = None  # output rows taken (column-parallel), None: all
    cols: slice | None = None  # input columns taken (row-parallel), None: all
    expert: int | None = None  # leading index into a fused [E, ...] source

    @property
    def module(self) -> str:
        """The HF module path (the source name without ``.weight``)."""
        return self.src.removesuffix(".weight")

    @property
    def index(self) -> tuple:
        """The index of this part in its source tensor (``tensor[index]``)."""
        lead: tuple = () if self.expert is None else (self.expert,)
        if self.cols is not None:
            return (*lead, slice(None) if self.rows is None else self.rows, self.cols)
        return lead if self.rows is None else (*lead, self.rows)


@dataclass(frozen=True)
class Geometry:
    """A rank's tensor as source slices.

    ``groups`` are stacked along the output in order: one group per local expert for expert
    tensors, otherwise one group (the parts fused into one tensor, e.g. q/k/v or up/gate).
    ``quantizable``: the weight of a linear layer a quantizer may have quantized (not a bias,
    norm, router or lm_head). ``layer_sources``: every source that shares the tensor's one
    activation scale - for experts all experts of the layer, not only this rank's.
    """

    parallel: str  # COLUMN, ROW or REPLICATED
    groups: tuple[tuple[Part, ...], ...]
    layer_sources: tuple[str, ...]
    experts: bool = False
    quantizable: bool = False
    padding: Zeros | None = None  # appended after the parts

    def parts(self) -> list[Part]:
        """All parts, in output order."""
        return [p for group in self.groups for p in group]


def chunk(total: int, parts: int, index: int) -> slice:
    """The ``index``-th of ``parts`` equal contiguous chunks of ``range(total)``."""
    size = total // parts
    return slice(index * size, (index + 1) * size)
