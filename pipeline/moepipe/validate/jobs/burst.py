"""``burst``: a base rate, a step to ``factor`` x base, back to base: does the server survive,
shed the excess with busy errors, and come back to its baseline p99."""

from __future__ import annotations

from moepipe.validate.base import JobContext
from moepipe.validate.load import LoadResult, run_load
from moepipe.validate.report import JobResult, check
from moepipe.validate.stats import summarize, timeline
from moepipe.validate.workload import client_check, distribution_data, plan, prompts_for


def burst(ctx: JobContext) -> JobResult:
    """Base rate, a step to ``factor`` x base, back to base: survival, shedding, recovery."""
    ep, cfg = ctx.endpoint, ctx.cfg
    job = JobResult("burst")
    b = cfg.validation.burst
    t1, t2 = b.before_s, b.before_s + b.burst_s
    end = t2 + b.after_s
    schedule = [(b.before_s, b.base_rate), (b.burst_s, b.base_rate * b.factor),
                (b.after_s, b.base_rate)]
    state: dict = {}

    def run():
        res = run_load(plan(cfg, ep, prompts_for(cfg), schedule=schedule,
                            max_requests=int(b.base_rate * end * b.factor) + 16,
                            duration_s=end))
        state["res"] = res
        return {"requests": len(res.samples), "wall_s": round(res.wall_s, 2)}

    if job.run("load", run).status != "passed":
        return job
    res: LoadResult = state["res"]
    phases = {"before": (0.0, t1), "during": (t1, t2), "after": (t2, end)}
    sums = {k: summarize(res, [s for s in res.samples if lo <= s.sent < hi], (lo, hi))
            for k, (lo, hi) in phases.items()}
    rows = timeline(res.samples, b.bin_s, end)
    job.data.update(timeline=rows, burst=[t1, t2], factor=b.factor, phases=sums)
    base = sums["before"]["latency_ms"].get("p99")

    def phase(name):
        return lambda: {"summary": sums[name]}

    for name in phases:
        job.run(f"{name}_burst", phase(name))

    def survived():
        ep.get("/v2/health/ready")
        failed = sum(s["failed"] for s in sums.values())
        check(failed == 0, (
            f"{failed} requests failed (not rejected as busy, not timed out): overload must be "
            f"shed with a busy error (hint: deploy.max_queue_size)"))
        return {k: {o: sums[k][o] for o in ("ok", "rejected", "failed", "timeout", "not_sent")}
                for k in sums}

    job.run("server_survived", survived)

    def recovered():
        check(base is not None, "no successful request before the burst")
        limit = base * b.tolerance
        after = [r for r in rows if r["t"] >= t2 and r["p99_ms"] is not None]
        back = None
        for i, r in enumerate(after):
            if all(x["p99_ms"] <= limit for x in after[i:]):
                back = r["t"] - t2
                break
        job.data["recovered_after_s"] = back
        check(back is not None, (f"p99 never came back within {b.tolerance:g}x the baseline "
                                  f"({limit:.1f} ms) in the {b.after_s:g}s after the burst"))
        if b.max_recovery_s is not None:
            check(back <= b.max_recovery_s, (
                f"p99 back within {b.tolerance:g}x baseline after {back:g}s > "
                f"{b.max_recovery_s:g}s (validate.burst.max_recovery_s)"))
        return {"baseline_p99_ms": base, "limit_ms": round(limit, 3), "recovered_after_s": back}

    job.run("p99_recovered", recovered)
    client_check(job, [res])
    distribution_data(job, {k: LoadResult([s for s in res.samples if lo <= s.sent < hi],
                                           res.wall_s) for k, (lo, hi) in phases.items()})
    return job
