"""Safetensors dtypes, kept apart from torch so that copying bytes needs no torch import
(``moepipe convert`` of a same-dtype checkpoint starts in a fraction of a second)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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


def itemsize(torch_name: str) -> int:
    """Bytes of one element of the dtype torch calls ``torch_name`` (``"bfloat16"``: 2)."""
    return BY_TORCH_NAME[torch_name].itemsize
