"""MXFP4 checkpoints as OpenAI publishes GPT-OSS (``openai/gpt-oss-20b`` / ``-120b``).

``config.json`` says ``quantization_config: {quant_method: mxfp4, modules_to_not_convert:
[...]}``; each routed-expert weight ``X`` (``mlp.experts.gate_up_proj`` / ``down_proj``) is
stored as ``X_blocks`` (uint8 ``[E, out, in/32, 16]``: 32 FP4 E2M1 values per block, two per
byte, low nibble first) and ``X_scales`` (uint8 ``[E, out, in/32]``: the block's power of two,
biased by 127); everything else (attention, router, biases, embeddings) is bf16. The value is
``FP4[nibble] * 2 ** (scale - 127)``, and ``X`` is that ``[E, out, in]`` matrix transposed to
the bf16 layout ``[E, in, out]`` (transformers ``integrations/mxfp4.py``
``convert_moe_packed_tensors``, which the tests use as the oracle).

:class:`Mxfp4Reader` reads such a folder as if it held the dequantized ``X``: ``has``,
``shape`` and ``read`` (float32, one expert at a time when asked for ``X[e]``) know ``X``;
``X_blocks`` / ``X_scales`` stay in ``tensors`` as they are on disk. FP4 times a power of two
is exact in bf16 and float32, so the conversion is lossless.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moepipe.checkpoints.dtypes import F32
from moepipe.checkpoints.reader import CheckpointReader, TensorInfo
from moepipe.errors import CheckpointError

BLOCKS, SCALES = "_blocks", "_scales"
# Architectures whose MXFP4 checkpoints moepipe reads (their expert rules read whole experts
# through ``read``, never a byte range of the packed tensor).
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class Packed:
    blocks: TensorInfo
    scales: TensorInfo

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized tensor's shape, in the bf16 layout ``[..., in, out]``."""
        *lead, out, groups, _ = self.blocks.shape
        return (*lead, groups * 32, out)


class Mxfp4Reader(CheckpointReader):
    """A :class:`CheckpointReader` that dequantizes MXFP4 expert weights on read."""

    def __init__(self, folder: str | os.PathLike):
        super().__init__(folder)
        self.packed: dict[str, Packed] = {}
        for name, info in self.tensors.items():
            if not name.endswith(BLOCKS):
                continue
            base = name.removesuffix(BLOCKS)
            scales = self.tensors.get(base + SCALES)
            if scales is None:
                raise CheckpointError(f"{name} has no {base + SCALES}",
                                      "an MXFP4 weight needs its blocks and its scales")
            if info.dtype.name != "U8" or scales.dtype.name != "U8" \
                    or len(info.shape) < 3 or info.shape[-1] != 16 \
                    or tuple(scales.shape) != tuple(info.shape[:-1]):
                raise CheckpointError(
                    f"{name} {info.dtype.name} {list(info.shape)} / {base + SCALES} "
                    f"{scales.dtype.name} {list(scales.shape)} is not MXFP4",
                    "MXFP4 blocks are uint8 [..., out, in/32, 16] with uint8 scales "
                    "[..., out, in/32]")
            self.packed[base] = Packed(info, scales)

    def has(self, name: str) -> bool:
        return name in self.packed or super().has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.packed[name].shape if name in self.packed else super().shape(name)

    def info(self, name: str) -> TensorInfo:
        if name not in self.packed:
            return super().info(name)
        p = self.packed[name]  # what ``read`` returns: float32 values
        numel = 1
        for d in p.shape:
            numel *= d
        return TensorInfo(name, p.blocks.file, F32, p.shape, -1, numel * 4)

    def read(self, name: str, index: tuple = ()):
        if name not in self.packed:
            return super().read(name, index)
        if len(index) == 1 and isinstance(index[0], int):  # one expert
            return dequantize(super().read(name + BLOCKS, index),
                              super().read(name + SCALES, index))
        whole = dequantize(super().read(name + BLOCKS), super().read(name + SCALES))
        return whole[index] if index else whole

    def region(self, name: str, index: tuple = ()):
        if name in self.packed:
            raise CheckpointError(f"{name} is MXFP4: it is read dequantized, not streamed",
                                  "this family's rules cannot read MXFP4 weights")
        return super().region(name, index)


def dequantize(blocks, scales):
    """float32 ``[..., in, out]`` from MXFP4 ``blocks`` [..., out, G, 16] and ``scales``
    [..., out, G] (nibble 2j of a block is byte j's low half, 2j+1 its high half)."""
    import torch

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)
    values = values.reshape(*b.shape[:-1], 32)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None])
    out = values.reshape(*b.shape[:-2], b.shape[-2] * 32)  # [..., out, in]
    return out.transpose(-1, -2).contiguous()
