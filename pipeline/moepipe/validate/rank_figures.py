"""A rank group's figures as the validation jobs report them, from the deployment's metrics
(``moepipe_rank_*``, see :mod:`moepipe.serving.rank_metrics`): the communication share of a
step and the wait for the slowest rank over a load point (the difference of two scrapes), and
whether the group is up."""

from __future__ import annotations

import urllib.request

from moepipe.deploy.metric_names import rank_series

Series = dict[tuple[str, int, str], float]


def scrape(metrics: str, timeout: float = 10.0) -> Series:
    """The ``moepipe_rank_*`` series of ``metrics`` (host:port or URL); empty without a group."""
    base = metrics if metrics.startswith("http") else f"http://{metrics}"
    with urllib.request.urlopen(base.rstrip("/") + "/metrics", timeout=timeout) as r:
        return rank_series(r.read().decode())


def group_up(metrics: str | None) -> bool | None:
    """Whether the rank group can run steps (None: no group, or no metrics to ask)."""
    if not metrics:
        return None
    try:
        value = scrape(metrics, timeout=2.0).get(("up", -1, ""))
    except OSError:
        return None
    return None if value is None else value >= 1


def share(before: Series, after: Series) -> dict | None:
    """Between two scrapes: per rank its step time, collective time, communication share and
    wait for the slowest rank; over the group the communication share (collective time over
    step time, all ranks) and the mean wait per step of the most waiting rank. None without a
    group or without steps in between."""
    def delta(key: tuple[str, int, str]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    ranks = sorted({r for (kind, r, _) in after if kind == "step_sum"})
    per_rank: dict[str, dict] = {}
    for r in ranks:
        ops = {op: delta(("step_sum", r, op)) for (kind, rr, op) in after
               if kind == "step_sum" and rr == r}
        total = sum(ops.values())
        steps = delta(("step_count", r, "compute"))
        if total <= 0 or steps <= 0:
            continue
        comm = total - ops.get("compute", 0.0)
        wait = delta(("wait_sum", r, ""))
        per_rank[str(r)] = {"steps": int(steps), "step_ms": round(1e3 * total / steps, 3),
                            "communication_share": round(comm / total, 4),
                            "wait_ms": round(1e3 * wait / steps, 3),
                            "by_op_ms": {op: round(1e3 * v / steps, 3) for op, v in ops.items()
                                         if v > 0}}
    if not per_rank:
        return None
    totals = [float(v["step_ms"]) for v in per_rank.values()]
    comm = sum(float(v["step_ms"]) * float(v["communication_share"]) for v in per_rank.values())
    return {"world_size": len(ranks), "communication_share": round(comm / sum(totals), 4),
            "wait_for_slowest_ms": max(float(v["wait_ms"]) for v in per_rank.values()),
            "step_ms": max(totals), "ranks": per_rank}
