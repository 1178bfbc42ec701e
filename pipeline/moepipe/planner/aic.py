"""Inputs for aiconfigurator, which searches with measured kernel data instead of a roofline.

``moepipe plan --write DIR`` writes ``DIR/aiconfigurator.yaml``: one aggregated-serving
experiment in aiconfigurator's flat task schema (keys are fields of ``sdk.task_v2.Task`` of
aiconfigurator 0.12.0, ``aiconfigurator/cli/example.yaml``), its search space restricted to the
mappings moepipe can build, and ``DIR/README.txt`` with the command that runs it:
``aiconfigurator cli exp --yaml-path DIR/aiconfigurator.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from moepipe.errors import ConfigError
from moepipe.planner.plan import Plan
from moepipe.utils.fs import write_text_atomic

AICONFIGURATOR_VERSION = "0.12.0"
# Fields of aiconfigurator 0.12.0 sdk/task_v2.py ``Task`` this writer sets.
TASK_FIELDS = ("serving_mode", "model_path", "system_name", "backend_name", "total_gpus",
               "isl", "osl", "ttft", "tpot", "free_gpu_memory_fraction", "max_seq_len",
               "agg_tp_candidates", "agg_pp_candidates", "agg_dp_candidates",
               "agg_moe_tp_candidates", "agg_moe_ep_candidates")
# aiconfigurator's defaults (Task.ttft / Task.tpot), in ms; a latency goal halves TPOT.
TTFT_MS, TPOT_MS = 1000.0, 50.0


def aiconfigurator_task(plan: Plan, model_path: str) -> dict[str, Any]:
    """The experiment for ``plan``; ``model_path``: a Hugging Face id or a local folder."""
    system = plan.cluster.gpu.aiconfigurator_system
    if system is None:
        raise ConfigError(f"aiconfigurator has no performance data for {plan.cluster.gpu.name}",
                          "plan for another GPU kind, or run aiconfigurator with its --system")
    fits = [e for e in plan.candidates if e.fits] or plan.candidates
    # aiconfigurator counts attention DP apart: attention tp x dp GPUs, moe_tp x moe_ep of them
    tps = sorted({1 if e.sharding.attention_dp else e.sharding.tp for e in fits})
    return {
        "serving_mode": "agg",
        "model_path": model_path,
        "system_name": system,
        "backend_name": "trtllm",
        "total_gpus": plan.cluster.gpus,
        "isl": plan.workload.isl,
        "osl": plan.workload.osl,
        "ttft": TTFT_MS,
        "tpot": TPOT_MS / 2 if plan.workload.goal == "latency" else TPOT_MS,
        "free_gpu_memory_fraction": plan.workload.kv_fraction,
        "max_seq_len": plan.workload.seq_len,
        "agg_tp_candidates": tps,
        "agg_pp_candidates": sorted({e.sharding.pp for e in fits}),
        # attention DP ranks: 1, or the tp size when attention DP fits
        "agg_dp_candidates": sorted({e.sharding.tp if e.sharding.attention_dp else 1
                                     for e in fits}),
        "agg_moe_tp_candidates": sorted({e.sharding.moe_tp for e in fits}),
        "agg_moe_ep_candidates": sorted({e.sharding.moe_ep for e in fits}),
    }


def write_aiconfigurator(plan: Plan, model_path: str, folder: Path) -> Path:
    """Write the experiment file and a README naming the command; returns the YAML's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    task = aiconfigurator_task(plan, model_path)
    path = folder / "aiconfigurator.yaml"
    text = ("# aiconfigurator " + AICONFIGURATOR_VERSION + " experiment written by `moepipe "
            "plan --write`.\n# Run: aiconfigurator cli exp --yaml-path " + str(path) + "\n"
            + yaml.safe_dump({"exps": ["moepipe_agg"], "moepipe_agg": task}, sort_keys=False))
    write_text_atomic(path, text)  # whole or not at all (a full disk left an empty file)
    return path
