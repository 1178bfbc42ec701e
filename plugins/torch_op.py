"""The Triton kernel as the CUDA implementation of ``torch.ops.moepipe.route``.

The op itself (schema, CPU reference implementation, fake) is defined by
``moepipe.runtime.routing``; importing this module adds its CUDA kernel, so the runtime's
``route_op`` runs the fused kernel on GPU tensors.
"""

from __future__ import annotations

import torch

import moepipe.runtime.routing  # noqa: F401 - defines the op this module adds a kernel to
from moepipe.arch.routing import RoutingSpec


@torch.library.register_kernel("moepipe::route", "cuda")
def _route_cuda(logits, router_bias, correction_bias, num_experts, top_k, score, topk_first,
                renormalize, n_group, topk_group, group_score, routed_scaling_factor):
    from moepipe.plugins.kernel import route_triton

    spec = RoutingSpec(num_experts, top_k, score=score, topk_first=topk_first,
                       renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                       group_score=group_score, routed_scaling_factor=routed_scaling_factor,
                       router_bias=router_bias is not None,
                       correction_bias=correction_bias is not None)
    return route_triton(logits, spec, router_bias, correction_bias)

