"""Expert routing, the reference: router logits -> (expert ids, weights[, counts]).

``route`` implements every mode of :class:`moepipe.arch.routing.RoutingSpec` (its docstring
states the semantics) with plain torch ops; it is checked against each family's Hugging Face
router and is what the fused Triton kernel (``plugins/kernel.py``) is tested against.

``torch.ops.moepipe.route`` is the same routing as a PyTorch custom op returning ids int32,
weights float32 and per-expert counts int32. Its CPU implementation is ``route`` and it has a
fake (meta) implementation for ``torch.compile``/export; ``moepipe.plugins.torch_op`` registers
the Triton kernel as its CUDA implementation. The reference runtime routes through this op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moepipe.arch.routing import RoutingSpec
from moepipe.errors import UnsupportedError

__all__ = ["RouteFn", "RoutingSpec", "expert_counts", "op_args", "route", "route_op"]

# (logits, spec, router_bias=, correction_bias=) -> (ids, weights, counts), like route_op
RouteFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _order(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, descending; ties to the lower index."""
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]


def route(logits: torch.Tensor, spec: RoutingSpec, *, router_bias: torch.Tensor | None = None,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [tokens, experts] -> (expert ids [tokens, k] int64, weights [tokens, k]
    float32), following ``spec`` (module docstring). Biases are [experts] tensors, required
    exactly when the spec asks for them."""
    if spec.router_bias != (router_bias is not None) \
            or spec.correction_bias != (correction_bias is not None):
        raise UnsupportedError("routing: biases passed do not match the routing spec",
                               "pass router_bias / correction_bias exactly when the spec has them")
    z = logits.float()
    if router_bias is not None:
        z = z + router_bias.float()
    tokens, experts = z.shape
    zmax = z.max(dim=-1, keepdim=True).values
    if spec.selects_on_scores:
        key = torch.sigmoid(z) if spec.score == "sigmoid" else \
            torch.exp(z - zmax) / torch.exp(z - zmax).sum(-1, keepdim=True)
        if correction_bias is not None:
            key = key + correction_bias.float()
    else:
        key = z
    if spec.n_group > 1:
        groups = key.view(tokens, spec.n_group, spec.group_size)
        if spec.group_score == "max":
            group_key = groups.max(dim=-1).values
        else:
            group_key = torch.sort(groups, dim=-1, descending=True).values[..., :2].sum(-1)
        keep = torch.zeros_like(group_key, dtype=torch.bool)
        keep.scatter_(1, _order(group_key, spec.topk_group), True)
        key = key.masked_fill(~keep.repeat_interleave(spec.group_size, dim=1), float("-inf"))
    ids = _order(key, spec.top_k)
    picked = z.gather(1, ids)
    if spec.topk_first:
        weights = torch.softmax(picked, dim=-1)
    elif spec.score == "sigmoid":
        weights = torch.sigmoid(picked)
    else:
        weights = torch.exp(picked - zmax) / torch.exp(z - zmax).sum(-1, keepdim=True)
    if spec.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return ids, weights


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: int32 [experts] (a token counts once per selected slot)."""
    return torch.bincount(ids.reshape(-1).long(), minlength=num_experts).to(torch.int32)


@torch.library.custom_op("moepipe::route", mutates_args=())
def _route_op(logits: torch.Tensor, router_bias: torch.Tensor | None,
              correction_bias: torch.Tensor | None, num_experts: int, top_k: int, score: str,
              topk_first: bool, renormalize: bool, n_group: int, topk_group: int,
              group_score: str, routed_scaling_factor: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the CPU (and any-device) implementation: the reference
    spec = RoutingSpec(num_experts, top_k, score=score, topk_first=topk_first,
                       renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                       group_score=group_score, routed_scaling_factor=routed_scaling_factor,
                       router_bias=router_bias is not None,
                       correction_bias=correction_bias is not None)
    ids, weights = route(logits, spec, router_bias=router_bias, correction_bias=correction_bias)
    return ids.to(torch.int32), weights, expert_counts(ids, num_experts)


@_route_op.register_fake
def _route_fake(logits, router_bias, correction_bias, num_experts, top_k, score, topk_first,
                renormalize, n_group, topk_group, group_score, routed_scaling_factor):
    tokens = logits.shape[0]
    return (logits.new_empty((tokens, top_k), dtype=torch.int32),
            logits.new_empty((tokens, top_k), dtype=torch.float32),
            logits.new_empty((num_experts,), dtype=torch.int32))


def op_args(spec: RoutingSpec) -> tuple:
    """The op's non-tensor arguments for ``spec``, in schema order."""
    return (spec.num_experts, spec.top_k, spec.score, spec.topk_first, spec.renormalize,
            spec.n_group, spec.topk_group, spec.group_score, float(spec.routed_scaling_factor))


def route_op(logits: torch.Tensor, spec: RoutingSpec, *, router_bias: torch.Tensor | None = None,
             correction_bias: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.moepipe.route`` for ``spec``: (ids int32 [T, k], weights f32 [T, k],
    counts int32 [E])."""
    if spec.router_bias != (router_bias is not None) \
            or spec.correction_bias != (correction_bias is not None):
        raise UnsupportedError("routing: biases passed do not match the routing spec",
                               "pass router_bias / correction_bias exactly when the spec has them")
    return torch.ops.moepipe.route(logits, router_bias, correction_bias, *op_args(spec))
