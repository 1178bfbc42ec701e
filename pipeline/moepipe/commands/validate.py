"""``moepipe validate``: run the configured jobs against the endpoint and write the reports."""

from __future__ import annotations

from collections.abc import Callable

from moepipe.config import MoepipeConfig
from moepipe.utils.progress import task
from moepipe.validate.base import Endpoint, JobContext
from moepipe.validate.preflight import down, preflight
from moepipe.validate.registry import JOBS
from moepipe.validate.report import Report


def endpoint_for(cfg: MoepipeConfig, url: str | None, grpc_url: str | None) -> Endpoint:
    from moepipe.deploy.local import lifecycle
    from moepipe.deploy.local.state import state_dir

    http = url or cfg.validation.url
    grpc = grpc_url or cfg.validation.grpc_url
    st = lifecycle.status(state_dir(cfg.workdir))
    if http is None:
        http = st["http"] if st.get("running") else f"{cfg.deploy.host}:{cfg.deploy.http_port}"
    if grpc is None:
        grpc = st["grpc"] if st.get("running") else f"{cfg.deploy.host}:{cfg.deploy.grpc_port}"
    metrics = cfg.validation.metrics_url or (
        st["metrics"] if st.get("running") else f"{cfg.deploy.host}:{cfg.deploy.metrics_port}")
    http = http.removeprefix("http://").removeprefix("https://").rstrip("/")
    return Endpoint(http=http, grpc=grpc, timeout=cfg.validation.timeout_s,
                    metrics=metrics.removeprefix("http://").rstrip("/"))


def run_validate(cfg: MoepipeConfig, url: str | None = None, grpc_url: str | None = None,
                 jobs: list[str] | None = None,
                 echo: Callable[[str], None] = print) -> tuple[Report, tuple]:
    from moepipe.commands.build import MANIFEST, model_dir, outputs, served_version
    from moepipe.deploy.local.state import state_dir
    from moepipe.errors import MoepipeError

    ep = endpoint_for(cfg, url, grpc_url)
    try:
        source = model_dir(cfg)
    except MoepipeError:
        source = None
    try:
        checkpoint = outputs(cfg).get("convert")
    except MoepipeError:
        checkpoint = None
    version = serving_version(ep)
    # else the version this workdir built, where it built one (fingerprinting a model folder
    # hashes its files: not for a workdir that only validates, such as a rollout's Job)
    if version is None and (cfg.workdir / MANIFEST).is_file():
        try:
            version = served_version(cfg)
        except MoepipeError:
            version = None
    ctx = JobContext(ep, cfg, source, checkpoint, state_dir(cfg.workdir))
    report = run_jobs(ctx, list(jobs or cfg.validation.jobs), echo, version=version)
    paths = report.write(cfg.workdir / "reports")
    if not report.reachable:
        raise down(report.jobs[0], ep, str(paths[1]))
    why = "" if report.checked else " (no check ran: every one was skipped)"
    echo(f"validate {'PASSED' if report.passed else 'FAILED'}{why} against http {ep.http}, "
         f"grpc {ep.grpc}; reports: {', '.join(str(p) for p in paths)}")
    return report, paths


def run_jobs(ctx: JobContext, jobs: list[str], echo: Callable[[str], None],
             version: str | None = None) -> Report:
    """Run ``jobs`` against ``ctx``'s endpoint, one line per case; an endpoint that does not
    answer ends the report at its pre-flight (``report.reachable`` is False)."""
    ep = ctx.endpoint
    report = Report(target=ctx.cfg.target, endpoint={"http": ep.http, "grpc": ep.grpc},
                    version=version)
    reachable = preflight(ep, ctx.cfg.validation.prompts[0])
    if not reachable.passed:  # fail fast: every job would wait its own timeouts
        report.jobs.append(reachable)
        report.reachable = False
        return report
    for i, name in enumerate(jobs, 1):
        # the load jobs plan and count their requests in it (moepipe.validate.load)
        with task(f"validate {name} (job {i} of {len(jobs)})", unit="requests"):
            job = JOBS[name](ctx)
        report.jobs.append(job)
        for case in job.cases:
            mark = {"passed": "ok  ", "skipped": "skip", "failed": "FAIL", "error": "ERR "}
            echo(f"  {mark[case.status]} {name}.{case.name} ({case.seconds:.2f}s)"
                 + (f": {case.message}" if case.message else ""))
    return report


def serving_version(ep: Endpoint) -> str | None:
    """The weights version the endpoint says it serves (``moepipe_model_info``; the cpu
    target), None where its metrics do not say."""
    from moepipe.deploy.metric_names import METRICS_LIMIT
    from moepipe.deploy.metric_names import serving_version as from_metrics
    from moepipe.utils.bounded import ReadError, fetch_url

    if not ep.metrics:
        return None
    try:
        body = fetch_url(f"http://{ep.metrics}/metrics", METRICS_LIMIT, 5.0, "metrics page")
    except (ReadError, OSError):  # no metrics endpoint (yet): the build says which version it is
        return None
    return from_metrics(body.decode("utf-8", "replace"))
