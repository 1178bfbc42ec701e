"""GPU check of the routing kernel: every family's mode and edge cases against the reference,
then the timing of ``benchmarks/routing_bench.py``; writes one JSON. Run by
``plugins/device_check.sh`` on a machine with an NVIDIA GPU."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "pipeline"), str(ROOT / "benchmarks")]

# every family's router at its real size (HF config fields)
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "MixtralForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {"num_experts": 60, "num_experts_per_tok": 4,
                            "norm_topk_prob": False},
    "Qwen3MoeForCausalLM": {"num_experts": 128, "num_experts_per_tok": 8,
                            "norm_topk_prob": True},
    "OlmoeForCausalLM": {"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False},
    "GptOssForCausalLM": {"num_local_experts": 128, "num_experts_per_tok": 4},
    "DeepseekV2ForCausalLM": {"n_routed_experts": 160, "num_experts_per_tok": 6, "n_group": 8,
                              "topk_group": 3, "topk_method": "group_limited_greedy",
                              "routed_scaling_factor": 16.0},
    "DeepseekV3ForCausalLM": {"n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
                              "topk_group": 4, "routed_scaling_factor": 2.5,
                              "norm_topk_prob": True},
}


def check_modes(tokens: int = 4096) -> list[dict]:
    """Kernel vs reference on the GPU for each family (ids exactly, weights, counts)."""
    import torch

    from moepipe.arch.routing import HF_ROUTING, spec_from_hf
    from moepipe.plugins.kernel import route_triton
    from moepipe.runtime.routing import expert_counts, route

    results = []
    for arch in HF_ROUTING:
        spec = spec_from_hf(arch, FAMILY_CONFIGS[arch])
        gen = torch.Generator(device="cuda").manual_seed(0)
        # a grid of values: many exact ties, no near-ties
        logits = torch.randint(-16, 17, (tokens, spec.num_experts), device="cuda",
                               generator=gen).float() / 4
        kw = {}
        if spec.router_bias:
            kw["router_bias"] = torch.randint(-4, 5, (spec.num_experts,), device="cuda",
                                              generator=gen).float() / 4
        if spec.correction_bias:
            kw["correction_bias"] = torch.randint(-8, 9, (spec.num_experts,), device="cuda",
                                                  generator=gen).float() / 16
        ids_r, w_r = route(logits, spec, **kw)
        start = time.perf_counter()
        ids_k, w_k, c_k = route_triton(logits, spec, kw.get("router_bias"),
                                       kw.get("correction_bias"))
        torch.cuda.synchronize()
        results.append({
            "family": arch, "spec": spec.to_dict(),
            "ids_equal": bool(torch.equal(ids_k.long(), ids_r)),
            "max_weight_error": float((w_k - w_r).abs().max()),
            "counts_equal": bool(torch.equal(c_k, expert_counts(ids_r, spec.num_experts))),
            "first_call_s": time.perf_counter() - start})
    return results


def main() -> int:
    import torch

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("device_check.json")
    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible (hint: run on the GPU machine)", file=sys.stderr)
        return 2
    from routing_bench import bench

    modes = check_modes()
    result = {"modes": modes, "bench": bench(),
              "ok": all(m["ids_equal"] and m["counts_equal"] and m["max_weight_error"] < 1e-5
                        for m in modes)}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
