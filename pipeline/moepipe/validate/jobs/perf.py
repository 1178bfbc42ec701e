"""``perf``: a closed-loop concurrency sweep and open-loop request-rate steps, checked against
``validate.slo`` (moepipe's own load driver). On a rank group (cpu target, world size > 1) each
point also reports where a step's time went: the communication share and the wait for the
slowest rank, from the deployment's ``moepipe_rank_*`` metrics. With a price
(``validate.cost``), each point also says what a token costs at its measured throughput
(:mod:`moepipe.utils.cost`): US$ per million output tokens, and per million tokens with the
prompt's tokens (the server's own ``num_input_tokens``) and the generated ones counted alike."""

from __future__ import annotations

from moepipe.utils.cost import usd_per_million
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
    price = cfg.usd_per_hour()
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
            row = {"mode": mode, "load": value, "label": label, "summary": s, "goodput": good,
                   **({"ranks": ranks} if ranks else {})}
            if price is not None:
                row["cost"] = cost_of(s, price)
            job.data["points"].append(row)
            check(s["ok"] > 0, f"{label}: no request was answered ({s['requests']} sent)")
            missed = slo_violations(s, slo)
            check(not missed, f"{label}: " + "; ".join(missed))
            return {"summary": s, "goodput_requests_per_s": good,
                    **({"ranks": ranks} if ranks else {}), **row.get("cost", {})}

        job.run(f"{mode}_{value:g}", point)
    if results and price is not None:
        job.run("cost_per_token", lambda: cost_gate(job.data["points"], price,
                                                    cfg.validation.cost.max_usd_per_million_tokens))
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


def cost_of(summary: dict, usd_per_hour: float) -> dict:
    """US$ per million output tokens and per million tokens (input + output) at a point's
    throughput; None where the point produced none (or the server counted no prompt tokens)."""
    out, inp = summary["output_tokens_per_s"], summary.get("input_tokens_per_s", 0.0)

    def rounded(v):
        return None if v is None else round(v, 6)

    return {"usd_per_hour": usd_per_hour,
            "usd_per_million_output_tokens": rounded(usd_per_million(usd_per_hour, out)),
            "usd_per_million_tokens": rounded(usd_per_million(usd_per_hour, out + inp)
                                              if inp > 0 else None)}


def cost_gate(points: list[dict], usd_per_hour: float, limit: float | None) -> dict:
    """The cheapest point's cost per million tokens, against ``limit``."""
    priced = [p for p in points if p.get("cost", {}).get("usd_per_million_tokens") is not None]
    check(priced, "no point produced tokens whose cost could be computed (did every request "
                  "fail? does the server return num_input_tokens?)")
    best = min(priced, key=lambda p: p["cost"]["usd_per_million_tokens"])
    cheapest = best["cost"]["usd_per_million_tokens"]
    if limit is not None:
        check(cheapest <= limit, (
            f"{cheapest:.4g} US$ per million tokens at the cheapest point ({best['label']}, "
            f"{best['summary']['output_tokens_per_s']:g} output tokens/s at "
            f"{usd_per_hour:g} US$/h) > {limit:g} (validate.cost.max_usd_per_million_tokens)"))
    return {"usd_per_hour": usd_per_hour, "cheapest_point": best["label"], **best["cost"]}
