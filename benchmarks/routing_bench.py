"""Routing kernel vs the torch reference on a GPU (DeepSeek-V3 shape by default).

    python benchmarks/routing_bench.py [--tokens 8192 --experts 256 --top-k 8 --groups 8]
        [--json out.json]

Times ``plugins.kernel.route_triton`` (ids, weights and counts in one launch) against
``moepipe.runtime.routing.route`` + ``expert_counts`` on the same GPU, same inputs, CUDA
events, median of repeats; prints the ratio. Needs an NVIDIA GPU and Triton.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "pipeline")]


def _time(fn, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench(tokens=8192, experts=256, top_k=8, groups=8, topk_group=4, repeats=50) -> dict:
    """Median microseconds of kernel and reference, and their ratio."""
    import torch

    from moepipe.arch.routing import RoutingSpec
    from moepipe.plugins.kernel import launch_config, route_triton
    from moepipe.runtime.routing import expert_counts, route

    spec = RoutingSpec(experts, top_k, score="sigmoid", renormalize=True, n_group=groups,
                       topk_group=topk_group, group_score="top2_sum",
                       routed_scaling_factor=2.5, correction_bias=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    bias = torch.randn(experts, device="cuda", generator=gen) * 0.1

    def reference():
        ids, w = route(logits, spec, correction_bias=bias)
        return ids, w, expert_counts(ids, experts)

    kernel_us = _time(lambda: route_triton(logits, spec, None, bias), repeats)
    torch_us = _time(reference, repeats)
    ids_k, w_k, c_k = route_triton(logits, spec, None, bias)
    ids_r, w_r, c_r = reference()
    return {"tokens": tokens, "experts": experts, "top_k": top_k, "n_group": groups,
            "topk_group": topk_group, "kernel_us": kernel_us, "torch_us": torch_us,
            "speedup": torch_us / kernel_us, "launch": vars(launch_config(spec)),
            "ids_equal_fraction": float((ids_k.long() == ids_r).float().mean()),
            "max_weight_error": float((w_k - w_r).abs().max()),
            "counts_equal": bool(torch.equal(c_k, c_r)),
            "gpu": torch.cuda.get_device_name()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = bench(args.tokens, args.experts, args.top_k, args.groups)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
