"""What the jobs under load share: their prompts, load plans with the driver settings of
``validate.load``, and the checks and data every such job reports.

Every job's load stops by itself (request budget and deadline, per-request timeouts) and its
figures go to the report twice: as checks (pass/fail against ``validate.slo`` and the job's
gates, messages naming the figure and its limit) and as ``data`` the HTML report draws.
"""

from __future__ import annotations

from moepipe.config import MoepipeConfig
from moepipe.validate.base import Endpoint
from moepipe.validate.load import LoadPlan, LoadResult, Prompt
from moepipe.validate.report import JobResult, check
from moepipe.validate.stats import cdf, histogram

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


def client_check(job: JobResult, results: list[LoadResult]) -> None:
    """A check that the load client itself was not the bottleneck of the figures."""
    def cpu():
        busiest = max(r.client_cpu_max for r in results)
        check(busiest <= CLIENT_CPU_LIMIT, (
            f"the load client used {busiest:.0%} of a core: its figures may measure the client"
            f" (hint: raise validate.load.processes)"))
        return {"client_cpu_max": round(busiest, 3),
                "processes": max(len(r.client_cpu_s) for r in results)}
    job.run("client_not_saturated", cpu)


def distribution_data(job: JobResult, series: dict[str, LoadResult]) -> None:
    """The latency histogram and CDFs the HTML report draws."""
    lat = {k: [s.latency * 1000 for s in r.samples if s.latency is not None]
           for k, r in series.items()}
    every = [v for vs in lat.values() for v in vs]
    job.data["latency_hist"] = histogram(every)
    job.data["latency_cdf"] = {k: cdf(v) for k, v in lat.items() if v}
