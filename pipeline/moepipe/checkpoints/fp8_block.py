"""Block-scaled FP8 checkpoints as DeepSeek publishes them (DeepSeek-V3 / R1 on the Hub).

``config.json`` says ``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size:
[128, 128], activation_scheme: dynamic}``; every quantized linear ``X.weight`` is stored as
``F8_E4M3`` beside ``X.weight_scale_inv`` (float32, one value per ``128 x 128`` block, the edge
blocks partial), and ``weight = fp8 value * weight_scale_inv[row // 128, col // 128]``
(DeepSeek-V3 ``inference/fp8_cast_bf16.py`` ``weight_dequant``). Embeddings, norms, the router
and ``lm_head`` stay in bf16 / float32.

:class:`Fp8BlockReader` reads such a folder as if it held the dequantized weights: ``shape`` is
unchanged, ``read`` returns float32 values (whole matrices are dequantized, then sliced), and the
``*_scale_inv`` tensors are the weights' companions (never mapped on their own).
"""

from __future__ import annotations

import os
from typing import Any

from moepipe.checkpoints.reader import CheckpointReader
from moepipe.errors import CheckpointError, UnsupportedError

SCALE_SUFFIX = "_scale_inv"


def block_size(quantization_config: dict[str, Any], where: str) -> tuple[int, int] | None:
    """The (rows, cols) scale block of a DeepSeek-style fp8 ``quantization_config``; None when
    the config is not one."""
    if quantization_config.get("quant_method") != "fp8":
        return None
    block = quantization_config.get("weight_block_size")
    fmt = quantization_config.get("fmt", "e4m3")
    if not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and b > 0 for b in block)) or fmt != "e4m3":
        raise UnsupportedError(f"{where}: fp8 quantization_config with weight_block_size "
                               f"{block!r}, fmt {fmt!r} is not supported",
                               "moepipe reads DeepSeek's block-scaled e4m3 checkpoints "
                               "(weight_block_size: [rows, cols])")
    return block[0], block[1]


class Fp8BlockReader(CheckpointReader):
    """A :class:`CheckpointReader` that dequantizes block-scaled fp8 weights on read."""

    def __init__(self, folder: str | os.PathLike, block: tuple[int, int]):
        super().__init__(folder)
        self.block = block

    def quantized(self, name: str) -> bool:
        """Whether ``name`` is stored as fp8 with a block scale."""
        return name + SCALE_SUFFIX in self.tensors

    def companions(self) -> set[str]:
        """The scale tensors (read with their weight, never mapped by themselves)."""
        return {n for n in self.tensors if n.endswith(SCALE_SUFFIX)
                and n.removesuffix(SCALE_SUFFIX) in self.tensors}

    def read(self, name: str, index: tuple = ()):
        if not self.quantized(name):
            return super().read(name, index)
        return self.dequantize(name)[index] if index else self.dequantize(name)

    def dequantize(self, name: str):
        """The whole weight ``name`` as float32."""
        weight = super().read(name)
        scale = super().read(name + SCALE_SUFFIX).float()
        if weight.dim() != 2:
            raise CheckpointError(f"{name}: fp8 weight of shape {list(weight.shape)}",
                                  "block-scaled fp8 weights are matrices")
        (rows, cols), (br, bc) = weight.shape, self.block
        want = (-(-rows // br), -(-cols // bc))
        if tuple(scale.shape) != want:
            raise CheckpointError(
                f"{name}{SCALE_SUFFIX} has shape {list(scale.shape)}; a {rows}x{cols} weight "
                f"in {br}x{bc} blocks needs {list(want)}",
                "the checkpoint's scales do not match quantization_config.weight_block_size")
        full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
        return weight.float() * full
