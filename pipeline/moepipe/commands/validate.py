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
    from moepipe.commands.deploy import state_dir
    from moepipe.deploy.local import lifecycle

    http = url or cfg.validation.url
    grpc = grpc_url or cfg.validation.grpc_url
    st = lifecycle.status(state_dir(cfg))
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
    from moepipe.commands.build import model_dir, outputs
    from moepipe.commands.deploy import state_dir
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
    ctx = JobContext(ep, cfg, source, checkpoint, state_dir(cfg))
    report = Report(target=cfg.target, endpoint={"http": ep.http, "grpc": ep.grpc})
    reachable = preflight(ep, cfg.validation.prompts[0])
    if not reachable.passed:  # fail fast: every job would wait its own timeouts
        report.jobs.append(reachable)
        paths = report.write(cfg.workdir / "reports")
        raise down(reachable, ep, str(paths[1]))
    names = jobs or cfg.validation.jobs
    for i, name in enumerate(names, 1):
        # the load jobs plan and count their requests in it (moepipe.validate.load)
        with task(f"validate {name} (job {i} of {len(names)})", unit="requests"):
            job = JOBS[name](ctx)
        report.jobs.append(job)
        for case in job.cases:
            mark = {"passed": "ok  ", "skipped": "skip", "failed": "FAIL", "error": "ERR "}
            echo(f"  {mark[case.status]} {name}.{case.name} ({case.seconds:.2f}s)"
                 + (f": {case.message}" if case.message else ""))
    paths = report.write(cfg.workdir / "reports")
    why = "" if report.checked else " (no check ran: every one was skipped)"
    echo(f"validate {'PASSED' if report.passed else 'FAILED'}{why} against http {ep.http}, "
         f"grpc {ep.grpc}; reports: {', '.join(str(p) for p in paths)}")
    return report, paths
