"""``perf``: a closed-loop concurrency sweep and open-loop request-rate steps, checked against
``validate.slo`` (moepipe's own load driver). On a rank group (cpu target, world size > 1) each
point also reports where a step's time went: the communication share and the wait for the
slowest rank, from the deployment's ``moepipe_rank_*`` metrics."""

from __future__ import annotations

from moepipe.validate import rank_figures
from moepipe.validate.base import JobContext
from moepipe.validate.load import LoadResult, run_load
from moepipe.validate.report import JobResult, check
from moepipe.validate.stats import goodput, slo_violations, summarize
from moepipe.validate.workload import client_check, distribution_data, plan, prompts_for


def perf(ctx: JobContext) -> JobResult:
    """Closed-loop concurrency sweep and open-loop request-rate steps, checked against SLOs."""
    ep, cfg = ctx.endpoint, ctx.cfg
    job = JobResult("perf")
    p, slo = cfg.validation.perf, cfg.validation.slo.model_dump()
    job.data.update(points=[], slo=slo)
    prompts = prompts_for(cfg)
    run_load(plan(cfg, ep, prompts[:2], concurrency=2, max_requests=4, duration_s=30))  # warm
    results: dict[str, LoadResult] = {}
    loads = [("concurrency", c, dict(concurrency=c)) for c in p.concurrency] + \
        [("rate", r, dict(schedule=[(p.duration_s, r)])) for r in p.rates]
    for mode, value, load in loads:
        label = f"{mode} {value:g}"

        def point(mode=mode, value=value, load=load, label=label):
            before = _ranks(ep.metrics)
            res = run_load(plan(cfg, ep, prompts, max_requests=p.requests,
                                duration_s=p.duration_s, **load))
            results[label] = res
            s = summarize(res)
            good = goodput(res.samples, slo, s["seconds"])
            ranks = None if before is None else rank_figures.share(before,
                                                                    _ranks(ep.metrics) or {})
            job.data["points"].append({"mode": mode, "load": value, "label": label,
                                       "summary": s, "goodput": good,
                                       **({"ranks": ranks} if ranks else {})})
            check(s["ok"] > 0, f"{label}: no request was answered ({s['requests']} sent)")
            missed = slo_violations(s, slo)
            check(not missed, f"{label}: " + "; ".join(missed))
            return {"summary": s, "goodput_requests_per_s": good,
                    **({"ranks": ranks} if ranks else {})}

        job.run(f"{mode}_{value:g}", point)
    if results:
        client_check(job, list(results.values()))
        distribution_data(job, results)
    return job


def _ranks(metrics: str | None) -> rank_figures.Series | None:
    """The rank group's series (None: no metrics endpoint, or no group)."""
    if not metrics:
        return None
    try:
        series = rank_figures.scrape(metrics)
    except OSError:
        return None
    return series or None
