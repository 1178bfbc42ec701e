"""``long-tail``: the p99 of short requests alone, and with a share of long prompts mixed in."""

from __future__ import annotations

from moepipe.validate.base import JobContext
from moepipe.validate.load import LoadResult, Prompt, run_load
from moepipe.validate.report import JobResult, check
from moepipe.validate.stats import summarize
from moepipe.validate.workload import (
    client_check,
    distribution_data,
    long_prompt,
    plan,
    prompts_for,
)


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
        client_check(job, list(out.values()))
        distribution_data(job, {k: LoadResult([s for s in r.samples if s.kind == "short"],
                                               r.wall_s) for k, r in out.items()})
    return job
