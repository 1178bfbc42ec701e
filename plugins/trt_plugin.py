"""The routing kernel as a TensorRT quickly deployable plugin (``tensorrt.plugin``, TRT >= 10.9).

``moepipe::moe_route``: ``register`` gives the output shapes and dtypes, ``aot_impl`` hands
TensorRT the kernel's PTX with its launch parameters (the engine then runs without Python),
and ``impl`` runs the kernel from Python (JIT; for debugging). TensorRT is not installable on
the machines moepipe is developed on, so this module is a thin layer: everything it hands
TensorRT (PTX, launch parameters, attributes, output shapes) is produced and tested by
``plugins.aot`` / ``plugins.onnx_export``, and :func:`register` fails with one clear line where
TensorRT is missing.

Plugin I/O (the kernel's argument order): inputs ``logits f32 [T, E], router_bias f32 [E],
correction_bias f32 [E]``; extra scalar ``T`` (SymInt32); outputs ``ids i32 [T, k],
weights f32 [T, k], counts_partial i32 [P, E]`` (sum over axis 0 = per-expert counts).
Attributes: those of ``plugins.onnx_export.ATTRS`` (ints, a float and strings).
"""
# No ``from __future__ import annotations`` here: tensorrt.plugin reads the annotations of the
# functions below as objects (TensorDesc, Tuple[...]), which must be real at definition time.

from pathlib import Path

from moepipe.errors import EnvironmentMissing
from moepipe.plugins import PLUGIN_NAME, PLUGIN_NAMESPACE
from moepipe.plugins.launch import NUM_PROGRAMS
from moepipe.plugins.onnx_export import spec_from_attrs

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
# a folder of kernels compiled by `python -m moepipe.plugins.aot` for aot_impl to use
KERNELS_ENV = "MOEPIPE_ROUTING_KERNELS"
MIN_TENSORRT = (10, 9)  # ahead-of-time quickly deployable plugins


def _tensorrt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError:
        raise EnvironmentMissing(
            "TensorRT (tensorrt.plugin) is not installed: the moepipe routing plugin cannot be "
            "registered here",
            "use NVIDIA's TensorRT-LLM container (TensorRT >= 10.9) on a GPU machine") from None
    version = tuple(int(p) for p in trt.__version__.split(".")[:2])
    if version < MIN_TENSORRT:
        raise EnvironmentMissing(f"TensorRT {trt.__version__} has no ahead-of-time Python "
                                 "plugins", "TensorRT >= 10.9 is needed")
    return trt, trtp


def arch_of(major: int, minor: int) -> str:
    """The kernel target for a GPU of compute capability ``major.minor``."""
    if major >= 10:
        return "sm_100"
    if major == 9:
        return "sm_90"
    return "sm_80"


_REGISTERED = False


def register() -> str:
    """Register ``moepipe::moe_route`` with TensorRT (idempotent); returns the plugin id."""
    global _REGISTERED
    trt, trtp = _tensorrt()
    if _REGISTERED:
        return PLUGIN_ID
    from typing import Tuple

    @trtp.register(PLUGIN_ID)
    def _desc(logits: trtp.TensorDesc, router_bias: trtp.TensorDesc,
              correction_bias: trtp.TensorDesc, num_experts: int, top_k: int, score: str,
              topk_first: int, renormalize: int, n_group: int, topk_group: int,
              group_score: str, routed_scaling_factor: float, has_router_bias: int,
              has_correction_bias: int
              ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        tokens = logits.shape_expr[0]
        return (trtp.from_shape_expr((tokens, top_k), dtype=trt.int32),
                trtp.from_shape_expr((tokens, top_k), dtype=trt.float32),
                trtp.from_shape_expr((NUM_PROGRAMS, num_experts), dtype=trt.int32))


    @trtp.aot_impl(PLUGIN_ID)
    def _aot(logits: trtp.TensorDesc, router_bias: trtp.TensorDesc,
             correction_bias: trtp.TensorDesc, num_experts: int, top_k: int, score: str,
             topk_first: int, renormalize: int, n_group: int, topk_group: int,
             group_score: str, routed_scaling_factor: float, has_router_bias: int,
             has_correction_bias: int, outputs: Tuple[trtp.TensorDesc], tactic: int):
        import os

        import torch

        from moepipe.plugins.aot import compile_routing, load_kernel

        spec = spec_from_attrs(dict(
            num_experts=num_experts, top_k=top_k, score=score, topk_first=topk_first,
            renormalize=renormalize, n_group=n_group, topk_group=topk_group,
            group_score=group_score, routed_scaling_factor=routed_scaling_factor,
            has_router_bias=has_router_bias, has_correction_bias=has_correction_bias))
        arch = arch_of(*torch.cuda.get_device_capability())
        # PTX compiled ahead of time (python -m moepipe.plugins.aot), else compiled here
        folder = os.environ.get(KERNELS_ENV)
        kernel = load_kernel(Path(folder), spec, arch) if folder else \
            compile_routing(spec, arch, cubin=False)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = kernel.grid_x
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared_mem
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(logits.shape_expr[0])])
        return kernel.name.encode(), kernel.ptx.encode(), launch, extra

    @trtp.impl(PLUGIN_ID)
    def _impl(logits: trtp.Tensor, router_bias: trtp.Tensor, correction_bias: trtp.Tensor,
              num_experts: int, top_k: int, score: str, topk_first: int, renormalize: int,
              n_group: int, topk_group: int, group_score: str, routed_scaling_factor: float,
              has_router_bias: int, has_correction_bias: int, outputs: Tuple[trtp.Tensor],
              stream: int) -> None:
        import torch

        from moepipe.plugins.kernel import constexprs, launch_config, moe_route

        spec = spec_from_attrs(dict(
            num_experts=num_experts, top_k=top_k, score=score, topk_first=topk_first,
            renormalize=renormalize, n_group=n_group, topk_group=topk_group,
            group_score=group_score, routed_scaling_factor=routed_scaling_factor,
            has_router_bias=has_router_bias, has_correction_bias=has_correction_bias))
        config = launch_config(spec)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            t = [torch.as_tensor(x, device="cuda") for x in
                 (logits, router_bias, correction_bias, *outputs)]
            moe_route[(NUM_PROGRAMS,)](t[0], t[1], t[2], t[0].shape[0], t[3], t[4], t[5],
                                       num_warps=config.num_warps,
                                       **constexprs(spec, config))

    _REGISTERED = True
    return PLUGIN_ID


def plugin_attrs(spec) -> dict:
    """The plugin attributes of ``spec`` (a ``RoutingSpec``), as ``trtp.op`` keywords: the
    ONNX node's attributes, by the same names."""
    from moepipe.plugins.onnx_export import spec_attrs

    return spec_attrs(spec)
