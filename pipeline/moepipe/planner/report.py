"""A plan as JSON (for tools) and as a table (for people)."""

from __future__ import annotations

from typing import Any

from moepipe.planner.estimate import Estimate
from moepipe.planner.plan import Plan, model_summary

GIB = 1 << 30


def mapping_dict(e: Estimate) -> dict[str, Any]:
    s = e.sharding
    return {"tp": s.tp, "pp": s.pp, "moe_tp": s.moe_tp, "moe_ep": s.moe_ep,
            "attention_dp": s.attention_dp, "world_size": s.world_size}


def estimate_dict(e: Estimate, rank: int | None, plan: Plan | None = None) -> dict[str, Any]:
    cost = plan.usd_per_million_output_tokens(e) if plan is not None else None
    return {
        "rank": rank,
        "fits": e.fits,
        "mapping": mapping_dict(e),
        "replicas": e.replicas,
        "memory_per_gpu": {"weights": e.weights, "activations": e.activations,
                           "moe_workspace": e.moe_workspace, "runtime": e.runtime,
                           "kv_cache": e.kv_budget},
        "kv_bytes_per_token_per_gpu": e.kv_bytes_per_token,
        "kv_capacity_tokens": e.kv_tokens,
        "max_sequences": e.max_sequences,
        "comm_bytes_per_token_per_gpu": e.comm,
        "roofline": {"tpot_ms_batch1": round(e.tpot_s * 1e3, 4),
                     "batch": e.batch,
                     "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 1),
                     **({} if cost is None else
                        {"usd_per_million_output_tokens": round(cost, 6)})},
        "problems": e.problems,
        "notes": e.notes,
    }


def plan_dict(plan: Plan) -> dict[str, Any]:
    w, c = plan.workload, plan.cluster
    return {
        "model": model_summary(plan.model, w.fmt),
        "cluster": {"gpu": c.gpu.name, "gpus": c.gpus, "gpus_per_node": c.gpus_per_node,
                    "gpu_memory": c.gpu.memory, "nvlink_bytes_per_s": c.gpu.nvlink_bw,
                    "internode_bytes_per_s": c.gpu.internode_bw},
        "workload": {"isl": w.isl, "osl": w.osl, "goal": w.goal, "quantization": w.fmt,
                     "kv_cache_bytes": w.kv_bytes, "kv_fraction": w.kv_fraction,
                     "max_num_tokens": w.max_num_tokens},
        "target": plan.target,
        "host_memory": plan.host_memory,
        "notes": plan.notes,
        "plans": [estimate_dict(e, i + 1 if e.fits else None, plan)
                  for i, e in enumerate(plan.candidates)],
        **({"cost": cost_dict(plan)} if plan.usd_per_gpu_hour is not None else {}),
    }


def cost_dict(plan: Plan) -> dict[str, Any]:
    """The price, the best mapping's cost, the dense model's best and the MoE's advantage."""
    best, dense = plan.best, plan.dense.best if plan.dense is not None else None
    mine = plan.usd_per_million_output_tokens(best) if best is not None else None
    theirs = plan.dense.usd_per_million_output_tokens(dense) \
        if plan.dense is not None and dense is not None else None
    return {
        "usd_per_gpu_hour": plan.usd_per_gpu_hour,
        "usd_per_million_output_tokens": mine,
        "dense": None if plan.dense is None else {
            "parameters": plan.dense.model.parameters(),
            "mapping": None if dense is None else mapping_dict(dense),
            "tokens_per_s_per_gpu": None if dense is None else round(
                dense.tokens_per_s_per_gpu, 1),
            "usd_per_million_output_tokens": theirs},
        # how many times more a dense model's output token costs (the MoE's advantage)
        "dense_over_moe": None if mine is None or theirs is None else round(theirs / mine, 3),
    }


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def format_plan(plan: Plan, limit: int = 12) -> str:
    """The ranked table: best first, then (briefly) what does not fit and why."""
    m, w, c = plan.model, plan.workload, plan.cluster
    summary = model_summary(m, w.fmt)
    lines = [
        f"{m.name}: {m.architecture}, {summary['parameters'] / 1e9:.2f}B parameters "
        f"({summary['active_parameters'] / 1e9:.2f}B active), {summary['attention']}, "
        f"{m.num_experts} experts top-{m.top_k}; weights {_gib(summary['weight_bytes'])} GiB "
        f"({w.fmt})",
        f"cluster {c.describe()} ({_gib(c.gpu.memory)} GiB each); isl {w.isl} + osl {w.osl}; "
        f"goal {w.goal}; target {plan.target}; KV {w.kv_bytes} B/elem at "
        f"{w.kv_fraction:g} of free memory",
        f"host RAM: convert {_gib(plan.host_memory['convert'])} GiB, quantize "
        f"{_gib(plan.host_memory['quantize'])} GiB",
        *(f"note: {n}" for n in plan.notes),
        "",
        f"{'#':>3} {'tp':>3} {'pp':>3} {'etp':>3} {'ep':>3} {'adp':>3} {'weights':>8} "
        f"{'reserve':>8} {'KV/tok':>8} {'KV tokens':>10} {'seqs':>6} {'comm/tok':>9} "
        f"{'TPOT ms':>8} {'tok/s/GPU':>10}"
        + (f" {'$/M out':>8}" if plan.usd_per_gpu_hour is not None else ""),
    ]
    fitting = [e for e in plan.candidates if e.fits]
    for i, e in enumerate(fitting[:limit]):
        s = e.sharding
        reserve = e.activations + e.moe_workspace + e.runtime
        comm = sum(e.comm.values())
        lines.append(
            f"{i + 1:>3} {s.tp:>3} {s.pp:>3} {s.moe_tp:>3} {s.moe_ep:>3} "
            f"{'yes' if s.attention_dp else '-':>3} {_gib(e.weights):>8} {_gib(reserve):>8} "
            f"{e.kv_bytes_per_token:>8} {e.kv_tokens:>10} {e.max_sequences:>6} "
            f"{comm:>9} {e.tpot_s * 1e3:>8.2f} {e.tokens_per_s_per_gpu:>10.0f}"
            + (f" {plan.usd_per_million_output_tokens(e):>8.4f}"
               if plan.usd_per_gpu_hour is not None else "")
            + (f"  ({'; '.join(e.notes)})" if e.notes else ""))
    if len(fitting) > limit:
        lines.append(f"    ... {len(fitting) - limit} more that fit (--json lists all)")
    if not fitting:
        lines.append("    no mapping fits this cluster")
    misfits = [e for e in plan.candidates if not e.fits]
    if misfits:
        lines += ["", f"{len(misfits)} mapping(s) do not fit, e.g.:"]
        for e in misfits[:3]:
            s = e.sharding
            lines.append(f"    tp={s.tp} pp={s.pp} moe_tp={s.moe_tp} moe_ep={s.moe_ep}"
                         f"{' attention_dp' if s.attention_dp else ''}: {e.problems[0]}")
    if plan.usd_per_gpu_hour is not None:
        lines += ["", *_cost_lines(plan)]
    lines += ["", "weights exact (shapes x format); reserve = activations + MoE workspace + "
              "runtime; KV/tok and comm/tok in bytes per GPU; TPOT and tok/s are a roofline "
              "for ranking, not a measurement (`--write DIR` emits aiconfigurator inputs)"]
    return "\n".join(lines)


def _cost_lines(plan: Plan) -> list[str]:
    c = cost_dict(plan)
    lines = [f"cost at {plan.usd_per_gpu_hour:g} US$ per GPU-hour: $/M out = US$ per million "
             "output tokens at the roofline's tok/s/GPU ($/h / (tok/s x 3600) x 1e6)"]
    dense = c["dense"]
    if dense is None:
        return lines
    if dense["mapping"] is None:
        lines.append(f"dense model of the same {dense['parameters'] / 1e9:.1f}B parameters: no "
                     "mapping fits this cluster")
    elif c["usd_per_million_output_tokens"] is not None:
        m = dense["mapping"]
        lines.append(
            f"dense model of the same {dense['parameters'] / 1e9:.1f}B parameters, best "
            f"mapping tp={m['tp']} pp={m['pp']}{' attention_dp' if m['attention_dp'] else ''}:"
            f" {dense['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
            f"{dense['usd_per_million_output_tokens']:.4f} $/M out = "
            f"{c['dense_over_moe']:.2f}x the MoE's {c['usd_per_million_output_tokens']:.4f}")
    return lines
