"""Launch configuration of the routing kernel: tile sizes, warps, grid and the compile-time
constants for a ``RoutingSpec`` (plain Python: the engine plan and the TensorRT plugin read it
without importing Triton)."""

from __future__ import annotations

from dataclasses import dataclass


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (Triton's tiles are powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes, warps and grid of one specialisation (same on every architecture)."""

    block_t: int
    block_g: int
    block_s: int
    block_k: int
    num_warps: int
    num_programs: int


# Each program holds BLOCK_T x BLOCK_G x BLOCK_S keys; about 8 per thread keeps registers low
# (ptxas: no spills at E=256) while keeping enough tokens per program.
ELEMENTS_PER_PROGRAM = 1024
NUM_WARPS = 4
# The grid is fixed (programs stride over the tokens): large enough to fill an H200/B200
# (132-148 SMs x a few resident programs), small enough that counts_partial stays tiny.
NUM_PROGRAMS = 512


def launch_config(spec) -> LaunchConfig:
    """The launch configuration of ``spec`` (a ``RoutingSpec``)."""
    block_g = next_power_of_2(spec.n_group)
    block_s = next_power_of_2(spec.group_size)
    block_t = max(1, min(64, ELEMENTS_PER_PROGRAM // (block_g * block_s)))
    return LaunchConfig(block_t, block_g, block_s, next_power_of_2(spec.top_k),
                        NUM_WARPS, NUM_PROGRAMS)


def constexprs(spec, config: LaunchConfig | None = None) -> dict:
    """The compile-time constants that specialise the kernel for ``spec``."""
    config = config or launch_config(spec)
    return {
        "E": spec.num_experts, "K": spec.top_k, "N_GROUP": spec.n_group,
        "GROUP_SIZE": spec.group_size, "TOPK_GROUP": spec.topk_group,
        "SIGMOID": spec.score == "sigmoid", "TOPK_FIRST": spec.topk_first,
        "RENORM": spec.renormalize, "GROUP_TOP2": spec.group_score == "top2_sum",
        "SCORED_KEY": spec.selects_on_scores, "SCALE": float(spec.routed_scaling_factor),
        "HAS_ROUTER_BIAS": spec.router_bias, "HAS_CORRECTION_BIAS": spec.correction_bias,
        "BLOCK_T": config.block_t, "BLOCK_G": config.block_g, "BLOCK_S": config.block_s,
        "BLOCK_K": config.block_k,
    }
