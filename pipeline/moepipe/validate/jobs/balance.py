"""``balance``: expert load per MoE layer from the deployment's expert counters.

The load is the difference between two scrapes of ``moepipe_expert_tokens_total`` taken before
and after the job's own traffic (after the counters have settled: the model publishes them
periodically), so earlier traffic does not count. Per layer: each expert's share, std/mean,
max/mean, (max - mean)/mean; and the same per EP rank, with experts grouped as the mapping
places them (EP rank r holds experts [r*E/ep, (r+1)*E/ep)).
"""

from __future__ import annotations

import time

import numpy as np

from moepipe.deploy.metric_names import METRICS_LIMIT, expert_token_counts
from moepipe.utils.bounded import fetch_url
from moepipe.validate.base import JobContext
from moepipe.validate.load import run_load
from moepipe.validate.report import JobResult, Skip, check
from moepipe.validate.workload import plan, prompts_for

COUNTER = "moepipe_expert_tokens_total"
SETTLE_PERIOD_S = 0.6  # > the cpu model's metrics publication period (0.5 s)


def scrape(metrics_url: str, timeout: float = 10.0) -> dict[tuple[int, int], float]:
    """(layer, expert) -> tokens routed, from a Prometheus text endpoint (read within
    ``timeout`` overall, at most METRICS_LIMIT bytes)."""
    base = metrics_url if metrics_url.startswith("http") else f"http://{metrics_url}"
    url = base.rstrip("/") + "/metrics"
    body = fetch_url(url, METRICS_LIMIT, timeout, "metrics page")
    return expert_token_counts(body.decode("utf-8", "replace"), url)


def parse(text: str) -> dict[tuple[int, int], float]:
    """(layer, expert) -> tokens routed, from Prometheus text (summed over other labels)."""
    return expert_token_counts(text)


def settled(metrics_url: str, timeout: float = 15.0) -> dict[tuple[int, int], float]:
    """Counters once two scrapes a publication period apart agree and every layer has the
    same total (each token goes to top-k experts of every MoE layer; dense layers, DeepSeek's
    first ones, stay at zero)."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        counts = scrape(metrics_url)
        totals: dict[int, float] = {}
        for (layer, _), v in counts.items():
            totals[layer] = totals.get(layer, 0.0) + v
        if counts == last and len({t for t in totals.values() if t}) <= 1:
            return counts
        if time.monotonic() > deadline:
            raise TimeoutError(f"the expert counters at {metrics_url} did not settle within "
                               f"{timeout:g}s")
        last = counts
        time.sleep(SETTLE_PERIOD_S)


def load_matrix(before: dict, after: dict) -> np.ndarray:
    """[layer, expert] tokens routed between the two scrapes."""
    layers = 1 + max(k[0] for k in after)
    experts = 1 + max(k[1] for k in after)
    m = np.zeros((layers, experts))
    for (layer, expert), v in after.items():
        m[layer, expert] = v - before.get((layer, expert), 0.0)
    return m


def imbalance(row: np.ndarray) -> dict:
    """Shares and spread of one layer's (or one rank grouping's) load."""
    mean = float(row.mean())
    if mean <= 0:
        return {"tokens": 0.0}
    return {"tokens": float(row.sum()), "share": [round(float(v), 4) for v in row / row.sum()],
            "std_over_mean": round(float(row.std()) / mean, 4),
            "max_over_mean": round(float(row.max()) / mean, 4),
            "max_minus_mean_over_mean": round((float(row.max()) - mean) / mean, 4)}


def by_rank(m: np.ndarray, ep: int) -> np.ndarray:
    """[layer, EP rank] load: experts of rank r are the contiguous range r*E/ep .. (r+1)*E/ep."""
    layers, experts = m.shape
    if ep < 1 or experts % ep:
        raise ValueError(f"{experts} experts do not split over moe_ep={ep}")
    return m.reshape(layers, ep, experts // ep).sum(axis=2)


def balance(ctx: JobContext) -> JobResult:
    """Expert load per layer and per EP rank from the counters, over the job's own traffic."""
    ep, cfg = ctx.endpoint, ctx.cfg
    job = JobResult("balance")
    bal = cfg.validation.balance
    state: dict = {}

    def counters():
        if not ep.metrics:
            raise Skip("no metrics endpoint (set validate.metrics_url)")
        before = settled(ep.metrics)
        if not before:
            raise Skip(f"{ep.metrics} exports no {COUNTER} (the cpu target does; GPU targets "
                       "export TensorRT-LLM's own statistics)")
        state["before"] = before
        return {"series": len(before)}

    if job.run("expert_counters", counters).status != "passed":
        return job

    def traffic():
        res = run_load(plan(cfg, ep, prompts_for(cfg), concurrency=bal.concurrency,
                            max_requests=bal.requests, duration_s=bal.duration_s))
        bad = [s for s in res.samples if s.status != "ok"]
        check(not bad, f"{len(bad)} of {len(res.samples)} requests failed: "
                       f"{bad[0].error if bad else ''}")
        state["after"] = settled(ep.metrics)
        return {"requests": len(res.samples)}

    if job.run("traffic", traffic).status != "passed":
        return job
    m = load_matrix(state["before"], state["after"])
    ep_size = cfg.parallel.to_mapping().moe_ep
    ranks = by_rank(m, ep_size)
    layers = [imbalance(row) for row in m]
    rank_stats = [imbalance(row) for row in ranks]
    counted = [i for i, s in enumerate(layers) if s["tokens"] >= bal.min_tokens]
    job.data.update(
        layer_expert=[[round(float(v), 4) for v in row / max(row.sum(), 1)] for row in m],
        layer_rank=[[round(float(v), 4) for v in row / max(row.sum(), 1)] for row in ranks],
        moe_ep=ep_size, layers=layers, ranks=rank_stats, counted_layers=counted)

    def enough():
        check(counted, (f"no layer saw {bal.min_tokens} routed tokens (most: "
                         f"{max(s['tokens'] for s in layers):.0f}; hint: raise "
                         f"validate.balance.requests)"))
        return {"layers_counted": counted, "tokens_per_layer": layers[counted[0]]["tokens"]}

    if job.run("enough_tokens", enough).status != "passed":
        return job

    def gate():
        worst = max(counted, key=lambda i: layers[i]["std_over_mean"])
        details = {"worst_layer": worst,
                   "std_over_mean": {i: layers[i]["std_over_mean"] for i in counted},
                   "rank_std_over_mean": {i: rank_stats[i].get("std_over_mean")
                                          for i in counted}}
        limit = bal.max_std_over_mean
        if limit is not None:
            over = [f"layer {i}: {layers[i]['std_over_mean']:.3f}" for i in counted
                    if layers[i]["std_over_mean"] > limit]
            check(not over, (f"expert load std/mean above {limit:g} "
                              f"(validate.balance.max_std_over_mean): " + ", ".join(over)))
        return details

    job.run("expert_balance", gate)
    return job
