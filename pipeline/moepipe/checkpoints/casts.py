"""Casts of raw float bytes between float32, float16 and bfloat16 without torch."""

from __future__ import annotations

from moepipe.checkpoints.dtypes import BF16, F16, F32, DType

_SMALL_CAST = 1 << 18  # bytes: bf16 -> f32 casts up to this size are done without numpy


def convert_bytes(data: memoryview, src: DType, dst: DType) -> memoryview:
    """Cast raw little-endian float data between float32, float16 and bfloat16 with numpy
    (bfloat16 rounding: to nearest even, as torch does), so that converting a checkpoint never
    needs torch. A small bfloat16 -> float32 cast (a router, which TensorRT-LLM keeps in float32,
    in a conversion that otherwise only copies bytes) is done without numpy: it is exact, and
    importing numpy would cost more than the cast (0.12-0.24 s here)."""
    if src == dst or {src.name, dst.name} == {"U8", "I8"}:  # same bytes (packed int4)
        return data
    if src == BF16 and dst == F32 and data.nbytes <= _SMALL_CAST:
        raw = bytes(data)
        wide = bytearray(2 * len(raw))  # the bf16 bits are the high half of the float32
        wide[2::4] = raw[0::2]
        wide[3::4] = raw[1::2]
        return memoryview(wide)
    import numpy as np

    if src == F32:
        x = np.frombuffer(data, dtype=np.float32)
    elif src == F16:
        x = np.frombuffer(data, dtype=np.float16).astype(np.float32)
    elif src == BF16:
        x = (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise ValueError(f"cannot convert {src.name} to {dst.name}")
    out: np.ndarray
    if dst == F32:
        out = x
    elif dst == F16:
        with np.errstate(over="ignore"):  # out of range -> inf, as torch gives
            out = x.astype(np.float16)
    elif dst == BF16:
        bits = x.view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():  # keep NaNs NaN (rounding could carry into the exponent)
            rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        out = rounded
    else:
        raise ValueError(f"cannot convert {src.name} to {dst.name}")
    return np.ascontiguousarray(out).data.cast("B")
