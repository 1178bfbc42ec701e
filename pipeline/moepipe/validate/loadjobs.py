"""Validation under load: ``perf``, ``burst`` and ``long-tail`` (moepipe's own load driver).

Every job's load stops by itself (request budget and deadline, per-request timeouts) and its
figures go to the report twice: as checks (pass/fail against ``validate.slo`` and the job's
gates, messages naming the figure and its limit) and as ``data`` the HTML report draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moepipe.config import MoepipeConfig
from moepipe.validate.load import LoadPlan, LoadResult, Prompt, run_load
from moepipe.validate.report import JobResult, check
from moepipe.validate.stats import cdf, goodput, histogram, slo_violations, summarize, timeline

if TYPE_CHECKING:
    from moepipe.validate.jobs import Endpoint, JobContext

# Above this share of one core the client, not the server, may be what limits the figures.
CLIENT_CPU_LIMIT = 0.95


def short_prompts(cfg: MoepipeConfig, n: int = 24) -> list[str]:
    """The configured prompts, then sentences of moepipe's corpus, ``n`` in all."""
    from moepipe.examples import corpus_text

    lines = [s.strip() + "." for s in corpus_text().replace("\n", " ").split(".")
             if 20 < len(s.strip()) < 200]
    out = list(cfg.validation.prompts) + lines
    return out[:max(n, len(cfg.validation.prompts))]


def long_prompt(cfg: MoepipeConfig, tokens: int) -> str:
    """Corpus text of about ``tokens`` tokens (counted with the deployment's tokenizer when
    it is there, else ~0.75 words per token), never longer than the deployment accepts."""
    from moepipe.examples import corpus_text

    words = corpus_text().split()
    limit = min(tokens, cfg.build.max_input_len - 8)
    tok_dir = cfg.deploy_dir / "tokenizer"
    if tok_dir.is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        ids = tok(" ".join(words[: limit * 2]), add_special_tokens=False).input_ids[:limit - 4]
        return str(tok.decode(ids))
    return " ".join(words[: int(limit * 0.75)])


def plan(cfg: MoepipeConfig, ep: Endpoint, prompts: list[Prompt], **load) -> LoadPlan:
    """A load plan with the driver settings of ``validate.load``."""
    d = cfg.validation.load
    return LoadPlan(url=ep.grpc, prompts=prompts, processes=d.processes,
                    timeout_s=d.request_timeout_s, max_inflight=d.max_inflight, **load)


def prompts_for(cfg: MoepipeConfig) -> list[Prompt]:
    """The short prompts every load job sends."""
    return [Prompt("short", p, cfg.validation.load.max_tokens) for p in short_prompts(cfg)]


def _client_check(job: JobResult, results: list[LoadResult]) -> None:
    def cpu():
        busiest = max(r.client_cpu_max for r in results)
        check(busiest <= CLIENT_CPU_LIMIT, (
            f"the load client used {busiest:.0%} of a core: its figures may measure the client"
            f" (hint: raise validate.load.processes)"))
        return {"client_cpu_max": round(busiest, 3),
                "processes": max(len(r.client_cpu_s) for r in results)}
    job.run("client_not_saturated", cpu)


def _distribution_data(job: JobResult, series: dict[str, LoadResult]) -> None:
    lat = {k: [s.latency * 1000 for s in r.samples if s.latency is not None]
           for k, r in series.items()}
    every = [v for vs in lat.values() for v in vs]
    job.data["latency_hist"] = histogram(every)
    job.data["latency_cdf"] = {k: cdf(v) for k, v in lat.items() if v}


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
            res = run_load(plan(cfg, ep, prompts, max_requests=p.requests,
                                duration_s=p.duration_s, **load))
            results[label] = res
            s = summarize(res)
            good = goodput(res.samples, slo, s["seconds"])
            job.data["points"].append({"mode": mode, "load": value, "label": label,
                                       "summary": s, "goodput": good})
            missed = slo_violations(s, slo)
            check(not missed, f"{label}: " + "; ".join(missed))
            return {"summary": s, "goodput_requests_per_s": good}

        job.run(f"{mode}_{value:g}", point)
    if results:
        _client_check(job, list(results.values()))
        _distribution_data(job, results)
    return job


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
    _client_check(job, [res])
    _distribution_data(job, {k: LoadResult([s for s in res.samples if lo <= s.sent < hi],
                                           res.wall_s) for k, (lo, hi) in phases.items()})
    return job


def long_tail(ctx: JobContext) -> JobResult:
    """The p99 of short requests alone, and with a share of long prompts mixed in."""
    ep, cfg = ctx.endpoint, ctx.cfg
    job = JobResult("long-tail")
    lt = cfg.validation.long_tail
    short = prompts_for(cfg)
    n_long = max(1, round(len(short) * lt.long_share / max(1e-9, 1 - lt.long_share)))
    text = long_prompt(cfg, lt.long_prompt_tokens)
    mixed = short + [Prompt("long", text, cfg.validation.load.max_tokens)] * n_long
    out: dict[str, LoadResult] = {}
    budget = int(lt.rate * lt.duration_s) + 8

    for name, prompts in (("short_only", short), ("with_long", mixed)):
        def run(name=name, prompts=prompts):
            res = run_load(plan(cfg, ep, prompts, schedule=[(lt.duration_s, lt.rate)],
                                max_requests=budget, duration_s=lt.duration_s))
            out[name] = res
            s = summarize(res, [x for x in res.samples if x.kind == "short"])
            job.data.setdefault("short", {})[name] = s
            check(s["error_rate"] == 0, f"{s['error_rate']:.1%} of the short requests failed")
            return {"short": s, "long": summarize(res, [x for x in res.samples
                                                         if x.kind == "long"])}
        job.run(name, run)

    def ratio():
        a = job.data["short"]["short_only"]["latency_ms"].get("p99")
        b = job.data["short"]["with_long"]["latency_ms"].get("p99")
        check(a and b, "no successful short requests to compare")
        r = b / a
        job.data["short_p99_ratio"] = round(r, 3)
        if lt.max_short_p99_ratio is not None:
            check(r <= lt.max_short_p99_ratio, (
                f"short-request p99 {b:.1f} ms with long prompts is {r:.2f}x the {a:.1f} ms "
                f"without > {lt.max_short_p99_ratio:g} (validate.long_tail.max_short_p99_ratio)"))
        return {"short_p99_ms_alone": a, "short_p99_ms_with_long": b, "ratio": round(r, 3),
                "long_share": lt.long_share}

    if len(out) == 2:
        job.run("short_p99_ratio", ratio)
        _client_check(job, list(out.values()))
        _distribution_data(job, {k: LoadResult([s for s in r.samples if s.kind == "short"],
                                               r.wall_s) for k, r in out.items()})
    return job
