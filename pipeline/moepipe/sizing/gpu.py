"""What one GPU holds besides its weights: the KV cache per token and the reserve the engine
needs for a step (activations, the MoE workspace, NCCL buffers and the CUDA context).

KV bytes per token on one GPU (TensorRT-LLM ``KVCacheManager``): GQA ``2 x layers x
ceil(kv_heads / tp) x head_dim x bytes`` (heads duplicated when fewer than tp); MLA ``layers x
(kv_lora_rank + qk_rope_head_dim) x bytes`` (one latent, K only, not split by tp). With
attention data parallelism each rank keeps whole heads for its own requests.

The reserve follows aiconfigurator's TensorRT-LLM fit for MoE models (planner-deepseek-facts
A1), with T tokens per step and A the attention output width (heads x value head dim: MLA's
``v_head_dim``, not the rope dimension):

* activations = max(act_bytes x T x A x c(tp), 70 MiB), c = 22, 13, 10, 10 for tp = 1, 2, 4,
  8+ (TensorRT sizes the activation workspace at build time from max_num_tokens; pp does not
  shrink it);
* moe_workspace = T x A x num_experts x top_k / moe_ep / 128 x 4;
* runtime = NCCL buffers (0, 342, 392, 392 MiB for tp = 1, 2, 4, 8+) + 3.5 GiB for the CUDA
  context, cuBLAS and the runtime (aiconfigurator's nccl_mem and other_mem).
"""

from __future__ import annotations

import math

from moepipe.checkpoints.dtypes import itemsize
from moepipe.sizing.shapes import ModelShape
from moepipe.sizing.weights import Sharding

MIB = 1 << 20
# aiconfigurator's TensorRT-LLM coefficients for MoE families, keyed by tp (planner facts A1).
ACTIVATION_COEFF = {1: 22, 2: 13, 4: 10, 8: 10}
ACTIVATION_MIN = 70 * MIB
# aiconfigurator's NCCL buffers by tp and fixed "other" memory (CUDA context, cuBLAS, runtime).
NCCL_BYTES = {1: 0, 2: 342 * MIB, 4: 392 * MIB, 8: 392 * MIB}
OTHER_BYTES = 3584 * MIB
# Quantized KV-cache formats: bytes per element (the unquantized cache is in the model dtype).
KV_FORMAT_BYTES = {"fp8": 1, "int8": 1}


def _by_tp(table: dict[int, int], tp: int) -> int:
    """``table`` at the largest key <= tp (aiconfigurator indexes by min(tp, 8))."""
    return table[max(k for k in table if k <= tp)]


def kv_itemsize(kv_format: str, dtype: str) -> int:
    """Bytes of one KV-cache element: 1 for an FP8 / INT8 cache, else the model dtype's."""
    return KV_FORMAT_BYTES.get(kv_format) or itemsize(dtype)


def kv_bytes_per_token(model: ModelShape, s: Sharding, layers: int, kv_bytes: int) -> int:
    """KV-cache bytes one GPU keeps per token for ``layers`` layers."""
    if model.mla:
        return layers * (model.kv_lora_rank + model.qk_rope_head_dim) * kv_bytes
    return 2 * layers * math.ceil(model.num_kv_heads / s.attn_tp) * model.head_dim * kv_bytes


def step_reserve(model: ModelShape, s: Sharding, tokens_per_step: int, act_bytes: int
                 ) -> dict[str, int]:
    """``activations``, ``moe_workspace`` and ``runtime`` of one GPU for steps of
    ``tokens_per_step`` tokens computed in ``act_bytes``-byte activations."""
    width = model.attn_width
    return {
        "activations": max(act_bytes * tokens_per_step * width
                           * _by_tp(ACTIVATION_COEFF, s.attn_tp), ACTIVATION_MIN),
        "moe_workspace": (tokens_per_step * width * model.num_experts * model.top_k * 4
                          // (s.moe_ep * 128)),
        "runtime": _by_tp(NCCL_BYTES, s.tp) + OTHER_BYTES,
    }
