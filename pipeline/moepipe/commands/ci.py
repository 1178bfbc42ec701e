"""``moepipe ci STEP``: the steps of the CI pipelines moepipe ships (ci/github-actions.yml,
ci/gitlab-ci.yml), as one command of the installed package.

It replaces the shell script the templates called: a script outside the package had to be
copied beside every pipeline and drifted from the moepipe that ran it; this command comes with
the version the pipeline installs and fails like every command (one line, exit 2).

* ``build``: ``moepipe build`` (stages reused by their fingerprints when the workdir was
  restored from the CI cache);
* ``deploy-validate``: cpu target: deploy, validate (the config's jobs, then a short soak:
  ``--soak-seconds``, 60 by default), stop - the server is stopped and the reports copied
  whatever happens;
* ``gpu-validate``: a GPU target on a GPU runner: deploy (renders), ``launch.sh`` in the
  background, wait for ready, validate, stop it.

Every step copies the reports (JSON, JUnit, HTML) to the reports folder the pipeline
publishes, and where ``GITHUB_STEP_SUMMARY`` is set appends a Markdown summary of the JUnit
results to the job's summary page.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from moepipe.config import MoepipeConfig, SoakSection, load_config
from moepipe.errors import MoepipeError
from moepipe.targets import get_target, targets_where

STEPS = ("build", "deploy-validate", "gpu-validate")
SOAK_SECONDS = 60.0  # deploy-validate's soak: long enough for trends after a warm-up window
Echo = Callable[[str], None]


def run_ci(step: str, config: Path, reports: Path, echo: Echo,
           ready_timeout_s: float = 1800, soak_seconds: float = SOAK_SECONDS) -> bool:
    """Run one CI step; True when it passed (validation failures: False, exit 1).
    ``soak_seconds``: the soak deploy-validate runs after the config's jobs (0: none)."""
    from moepipe.commands.build import run_build

    if step not in STEPS:
        raise MoepipeError(f"unknown CI step '{step}'", f"choose one of {', '.join(STEPS)}")
    if step == "build":
        run_build(config, echo=echo)
        return True
    cfg = load_config(config)
    try:
        if step == "deploy-validate":
            return _deploy_validate(cfg, echo, ci_jobs(cfg, soak_seconds))
        return _gpu_validate(cfg, echo, ready_timeout_s)
    finally:
        publish(cfg.workdir / "reports", reports)


def ci_jobs(cfg: MoepipeConfig, soak_seconds: float) -> list[str]:
    """The jobs deploy-validate runs: the config's (``validate.jobs``), then a soak of
    ``soak_seconds`` (0: none). A config whose jobs hold ``soak`` gets its own soak as
    configured, not a second one. The CI soak keeps the config's gates (``validate.soak.*``)
    and rate; its latency window and sampling shrink with it (at most a third and a twelfth of
    the run) so that drift has two windows and each trend some samples after the warm-up."""
    jobs: list[str] = list(cfg.validation.jobs)
    if "soak" in jobs or soak_seconds == 0:
        return jobs
    s = cfg.validation.soak
    try:
        cfg.validation.soak = SoakSection.model_validate({
            **s.model_dump(), "seconds": soak_seconds,
            "window_s": min(s.window_s, soak_seconds / 3),
            "sample_s": min(s.sample_s, soak_seconds / 12)})
    except ValidationError as e:
        raise MoepipeError(f"soak seconds {soak_seconds:g}: {e.errors()[0]['msg']}",
                           "set --soak-seconds (MOEPIPE_SOAK_SECONDS) to a length of the "
                           "soak in seconds, or 0 for none") from None
    return [*jobs, "soak"]


def _deploy_validate(cfg: MoepipeConfig, echo: Echo, jobs: list[str]) -> bool:
    from moepipe.commands.deploy import run_deploy, state_dir
    from moepipe.commands.validate import run_validate
    from moepipe.deploy.local import lifecycle

    if get_target(cfg.target).gpu:  # only a CPU target's server starts on this runner
        local = " or ".join(targets_where(lambda t: not t.gpu))
        raise MoepipeError(f"deploy-validate starts the {local} target's server, not "
                           f"{cfg.target}'s", "use `moepipe ci gpu-validate` on a GPU runner")
    run_deploy(cfg, echo=echo)
    try:
        report, _ = run_validate(cfg, jobs=jobs, echo=echo)
    finally:
        lifecycle.stop(state_dir(cfg))
    return report.passed


def _gpu_validate(cfg: MoepipeConfig, echo: Echo, ready_timeout_s: float) -> bool:
    from moepipe.commands.deploy import run_deploy
    from moepipe.commands.validate import run_validate

    run_deploy(cfg, echo=echo)
    launch = cfg.deploy_dir / "launch.sh"
    if not launch.is_file():
        raise MoepipeError(f"no {launch}: gpu-validate is for the trtllm-engine target",
                           "set target: trtllm-engine in the GPU pipeline's config")
    url = f"{cfg.deploy.host}:{cfg.deploy.http_port}"
    proc = subprocess.Popen(["bash", str(launch)], start_new_session=True)
    try:
        _wait_ready(url, proc, ready_timeout_s, echo)
        report, _ = run_validate(cfg, url=url, echo=echo)
        return report.passed
    finally:
        _end(proc)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, echo: Echo) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=5):
                echo(f"ci: the server at {url} is ready")
                return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            raise MoepipeError(f"launch.sh exited (status {proc.returncode}) before the "
                               "server was ready", "its output above says why")
        if time.monotonic() > deadline:
            raise MoepipeError(f"the server at {url} was not ready after {timeout_s:.0f}s",
                               "raise MOEPIPE_READY_TIMEOUT_S or look at launch.sh's output")
        time.sleep(5)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to launch.sh's process group (mpirun and its servers), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def publish(source: Path, reports: Path) -> list[Path]:
    """Copy the run's reports to where the pipeline publishes them; add the JUnit summary to
    GitHub's job summary when there is one. Returns the copied files."""
    reports.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.glob("*")) if source.is_dir() else []:
        if path.is_file():
            copied.append(Path(shutil.copy2(path, reports / path.name)))
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    report = reports / "validate.json"
    if summary and report.is_file():
        with open(summary, "a", encoding="utf-8") as out:
            out.write(markdown_summary(json.loads(report.read_text())))
    return copied


def markdown_summary(report: dict) -> str:
    """The validation report as a GitHub job summary: a verdict, one row per job, and the
    message of every check that did not pass."""
    verdict = "passed" if report["passed"] else "FAILED"
    rows = ["| job | result | passed | failed | skipped |", "|---|---|---|---|---|"]
    problems = []
    for job in report["jobs"]:
        count = {s: sum(c["status"] == s for c in job["cases"])
                 for s in ("passed", "failed", "error", "skipped")}
        rows.append(f"| {job['job']} | {'passed' if job['passed'] else '**FAILED**'} | "
                    f"{count['passed']} | {count['failed'] + count['error']} | "
                    f"{count['skipped']} |")
        problems += [f"- `{job['job']}.{c['name']}`: {(c.get('message') or c['status'])}"
                     .replace("\n", " ") for c in job["cases"]
                     if c["status"] in ("failed", "error")]
    return "\n".join([f"### moepipe validate: {verdict} ({report['target']} target)", "",
                      *rows, "", *problems, ""]) + "\n"
