"""Host memory of one serving pod, from the exact weight and KV-cache arithmetic: what
``moepipe deploy`` writes as the pod's memory request and limit (``deploy/k8s``) unless
``deploy.k8s.memory_gib`` sets it.

============== ==============================================================================
target         host memory of one pod
============== ==============================================================================
CPU (cpu)      one rank's weights as the reference runtime holds them (float32) x 1.25 and its
               KV cache (max_batch_size x max_seq_len tokens, float32; MLA: one latent per
               token and layer), plus 2 GiB for Triton and the Python models: world size > 1
               runs one rank process per pod (the largest rank's figure)
GPU targets    the pod's share of the weights in the built format, as the target's artifact
               lays them out (each rank's file passes through host memory while the engine or
               model loads), plus 8 GiB
============== ==============================================================================
"""

from __future__ import annotations

import math

from moepipe.mapping import stage_layers
from moepipe.sizing.gpu import kv_bytes_per_token
from moepipe.sizing.shapes import ModelShape
from moepipe.sizing.weights import Sharding, stage_weight_bytes
from moepipe.targets import get_target

GIB = 1 << 30
CPU_HEADROOM = 1.25
CPU_RESERVE = 2 * GIB
GPU_RESERVE = 8 * GIB


def pod_memory_bytes(model: ModelShape, s: Sharding, target: str, *, fmt: str = "none",
                     dtype: str | None = None, gpus_per_pod: int = 1, max_batch_size: int = 1,
                     max_seq_len: int = 1) -> int:
    """Host bytes one pod of a deployment needs (see the module's table)."""
    served = get_target(target)
    if not served.gpu:
        # moepipe's runtime holds a rank in float32; world size > 1 is a rank group with one
        # rank process per pod (moepipe.ranks), sized for the largest rank (its stage's)
        def rank(st: int) -> int:
            weights = stage_weight_bytes(model, s, st, "none", "float32")
            layers = len(stage_layers(model.num_layers, s.pp, st))
            kv = kv_bytes_per_token(model, s, layers, 4) * max_batch_size * max_seq_len
            return math.ceil(weights * CPU_HEADROOM) + kv

        return max(rank(st) for st in range(s.pp)) + CPU_RESERVE
    total = sum(s.tp * stage_weight_bytes(model, s, st, fmt, dtype,
                                          hf_layout=served.hf_layout)
                for st in range(s.pp))
    share = math.ceil(total * min(gpus_per_pod, s.world_size) / s.world_size)
    return share + GPU_RESERVE


def pod_memory_mib(*args, **kwargs) -> int:
    """:func:`pod_memory_bytes` rounded up to whole GiB, in MiB (what the manifests carry)."""
    return max(1024, math.ceil(pod_memory_bytes(*args, **kwargs) / GIB) * 1024)
