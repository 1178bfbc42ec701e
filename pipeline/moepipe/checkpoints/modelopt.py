"""What modelopt's ``hf_quant_config.json`` says about a unified (quantized) checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moepipe.errors import UnsupportedError

FP8, AWQ, SQ = "FP8", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL"
ALGOS = (FP8, AWQ, SQ)
KV_ALGOS = ("FP8", "INT8")
GROUP = 128
FP8_MAX = 448.0



@dataclass(frozen=True)
class QuantInfo:
    """What modelopt's ``hf_quant_config.json`` says about a unified checkpoint."""

    algo: str
    kv_algo: str | None
    group_size: int
    exclude: tuple[str, ...]

    @classmethod
    def parse(cls, data: dict[str, Any], where: str) -> QuantInfo:
        q = data.get("quantization", data)
        algo, kv = q.get("quant_algo"), q.get("kv_cache_quant_algo")
        if algo not in ALGOS:
            raise UnsupportedError(f"{where}: quant_algo {algo} cannot be converted to a "
                                   "TensorRT-LLM checkpoint here",
                                   f"supported: {', '.join(ALGOS)}")
        if kv is not None and kv not in KV_ALGOS:
            raise UnsupportedError(f"{where}: kv_cache_quant_algo {kv} is not supported")
        return cls(algo, kv, int(q.get("group_size") or GROUP),
                   tuple(q.get("exclude_modules") or ()))
