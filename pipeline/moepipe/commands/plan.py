"""``moepipe plan`` and ``moepipe init --plan``: the requests, checked, and their answers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.errors import ConfigError
from moepipe.planner.balance import DumpMapping, Placement
from moepipe.planner.estimate import Workload
from moepipe.planner.hardware import parse_cluster
from moepipe.planner.plan import HF_IDS, PUBLISHED, Plan, load_model, make_plan

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig

KV_CACHE = ("none", "fp8", "int8")
# A metrics page is read whole within this (a Triton server answers in milliseconds).
METRICS_TIMEOUT_S = 30.0
GIB = 1 << 30


@dataclass
class PlanRequest:
    model: str
    cluster: str = "8xH100"
    isl: int = 2048
    osl: int = 512
    goal: str = "throughput"
    quantize: str = "auto"
    kv_cache: str = "none"
    kv_fraction: float = 0.9
    target: str = "trtllm-pytorch"
    max_num_tokens: int = 8192
    nvlink_gbps: float | None = None
    internode_gbps: float | None = None
    usd_per_gpu_hour: float | None = None


def run_plan(req: PlanRequest) -> Plan:
    """The plan a request asks for (every input checked, errors as MoepipeError)."""
    if req.kv_cache not in KV_CACHE:
        raise ConfigError(f"--kv-cache '{req.kv_cache}' is unknown",
                          f"choose one of {', '.join(KV_CACHE)}")
    model = load_model(req.model)
    cluster = parse_cluster(req.cluster, req.nvlink_gbps, req.internode_gbps)
    fmt = (model.published_quant or "none") if req.quantize == "auto" else req.quantize
    kv_bytes = 1 if req.kv_cache != "none" else {"float32": 4}.get(model.dtype, 2)
    workload = Workload(req.isl, req.osl, req.goal, fmt, kv_bytes, req.kv_fraction,
                        req.max_num_tokens, kv_format=req.kv_cache)
    return make_plan(model, cluster, workload, req.target, req.usd_per_gpu_hour)


def model_id(source: str) -> str:
    """What aiconfigurator is told the model is: the Hugging Face id of a published config,
    else the folder (aiconfigurator reads its config.json)."""
    if source in HF_IDS:
        return HF_IDS[source]
    path = Path(source)
    if path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise ConfigError(f"aiconfigurator needs a Hugging Face id or a checkpoint folder, not "
                          f"'{source}'", f"published models: {', '.join(PUBLISHED)}")
    return str(path.resolve())


def init_values(plan: Plan) -> dict[str, Any]:
    """``parallel`` and ``build`` values of moepipe.yaml from the best plan."""
    best = plan.best
    if best is None:
        raise ConfigError(f"no mapping of {plan.model.name} fits {plan.cluster.describe()}",
                          "`moepipe plan` shows why; use more or larger GPUs, or quantize")
    s, w = best.sharding, plan.workload
    return {
        "parallel": {"tp": s.tp, "pp": s.pp, "moe_tp": s.moe_tp, "moe_ep": s.moe_ep,
                     "attention_dp": s.attention_dp},
        "build": {"max_batch_size": max(1, min(best.batch, 4096)),
                  "max_input_len": w.isl, "max_seq_len": w.seq_len,
                  "max_num_tokens": max(w.max_num_tokens, w.isl),
                  "gpu_memory_gb": round(plan.cluster.gpu.memory / GIB, 1)},
        "note": (f"from `moepipe plan` on {plan.cluster.describe()} (goal {w.goal}, isl {w.isl}"
                 f" + osl {w.osl}): {best.max_sequences} sequences of KV cache per instance"),
    }


def to_json(plan: Plan) -> str:
    from moepipe.planner.report import plan_dict

    return json.dumps(plan_dict(plan), indent=2)



def fetch_metrics(url: str, timeout_s: float | None = None) -> str:
    """The text of a Prometheus metrics endpoint (a Triton server's, usually on loopback):
    at most :data:`~moepipe.deploy.metric_names.METRICS_LIMIT` bytes within ``timeout_s``
    (default :data:`METRICS_TIMEOUT_S`) overall."""
    from moepipe.deploy.metric_names import METRICS_LIMIT
    from moepipe.utils.bounded import decode_utf8, fetch_url

    body = fetch_url(url, METRICS_LIMIT, timeout_s or METRICS_TIMEOUT_S, "metrics page")
    return decode_utf8(body, url)


def run_balance(metrics: str | None, counts_file: Path | None, moe_ep: int,
                num_slots: int | None, out: Path, dump: DumpMapping | None = None
                ) -> Placement:
    """Read counts, place, write ``out``; returns the placement. A ``counts_file`` that is a
    folder is TensorRT-LLM's expert-statistic dump, read with ``dump``'s mapping."""
    from moepipe.planner.balance import (
        balance,
        counts_from_dump,
        counts_from_file,
        counts_from_metrics,
        write_placement,
    )

    if metrics is not None and counts_file is None:
        counts = counts_from_metrics(fetch_metrics(metrics), metrics)
    elif counts_file is not None and counts_file.is_dir() and metrics is None:
        if dump is None:
            raise ConfigError(f"{counts_file}: reading a TensorRT-LLM expert-statistic folder "
                              "needs the deployment's mapping", "pass -c moepipe.yaml")
        counts = counts_from_dump(counts_file, dump)
    elif counts_file is not None and metrics is None:
        counts = counts_from_file(counts_file)
    else:
        raise ConfigError("give exactly one of --metrics URL or --counts FILE",
                          "e.g. --metrics http://127.0.0.1:8002/metrics")
    placement = balance(counts, moe_ep, num_slots)
    write_placement(placement, out)
    return placement


def dump_mapping(cfg: MoepipeConfig) -> DumpMapping:
    """The mapping a deployment of ``cfg`` ran with, to read its expert-statistic dump: tp,
    pp, attention DP, and the slots of ``deploy.trtllm.expert_placement`` (counts are per
    slot while TensorRT-LLM's load balancer runs)."""
    from moepipe.trtllm.load_balancer import read_placement

    m, placement = cfg.parallel.to_mapping(), cfg.deploy.trtllm.expert_placement
    slots = None if placement is None else \
        read_placement(placement, m.moe_ep)["initial_global_assignments"]
    return DumpMapping(m.tp, m.pp, cfg.parallel.attention_dp, slots)


def format_balance(placement: Placement, out: Path) -> str:
    s = placement.summary()
    lines = [f"wrote {out}: {len(s['layers'])} MoE layer(s), {placement.num_slots} slots on "
             f"{placement.moe_ep} EP ranks",
             f"hottest rank / mean: before {s['max_over_mean_before']:.3f} (worst layer), "
             f"{s['mean_max_over_mean_before']:.3f} (mean over layers); after "
             f"{s['max_over_mean_after']:.3f}, {s['mean_max_over_mean_after']:.3f}"]
    return "\n".join(lines)
