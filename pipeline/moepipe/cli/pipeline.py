"""The pipeline's commands: build, deploy, stop, status, serve, validate, ci."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import typer

from moepipe.cli._app import (
    CiStep,
    ConfigOpt,
    JobChoice,
    JsonOpt,
    StageChoice,
    StageName,
    _echo,
    _emit,
    _say,
    _values,
    app,
)
from moepipe.commands.ci import SOAK_SECONDS
from moepipe.errors import ConfigError, MoepipeError


@app.command()
def build(config: Path | None = ConfigOpt,
          dry_run: bool = typer.Option(False, "--dry-run",
                                       help="Print the plan (stages to run or reuse, commands, "
                                            "memory estimates); change nothing."),
          force: list[StageChoice] | None = typer.Option(None, "--force",
                                                         help="Rerun this stage "
                                                              "(repeatable)."),
          until: StageName | None = typer.Option(None, "--until",
                                                 help="Stop after this stage (e.g. convert: "
                                                      "prepare the checkpoint on a machine "
                                                      "without a GPU)."),
          as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout: the "
                                       "build manifest, or with --dry-run the plan (messages "
                                       "go to stderr).")) -> None:
    """Run the stages the config's target needs: inspect -> quantize -> convert -> engine.
    Unchanged stages are reused; interrupted builds resume."""
    from moepipe.commands.build import run_build

    # the dry-run plan is the command's output: printed even with -q (unless it is --json)
    say = _say(True) if as_json else typer.echo if dry_run else _echo
    result = run_build(config, echo=say, force=_values(force), dry_run=dry_run, until=until)
    if as_json:
        _emit({"dry_run": dry_run, **result})


@app.command()
def deploy(config: Path | None = ConfigOpt, as_json: bool = JsonOpt,
           rollback: bool = typer.Option(False, "--rollback", help="Return to the version "
                                         "the last update replaced (validated first, as an "
                                         "update)."),
           to_cluster: bool = typer.Option(False, "--rollout", help="Roll the build out "
                                           "blue/green to Kubernetes (the current kubectl "
                                           "context) with the rendered k8s/rollout.sh: "
                                           "validated beside the serving release before "
                                           "traffic moves.")) -> None:
    """Render the Triton model repository; for the cpu target start a local Triton server, or
    update a running one in place when only the weights changed (validated before traffic
    moves)."""
    from moepipe.commands.deploy import run_deploy
    from moepipe.config import load_config

    result = run_deploy(load_config(config), echo=_say(as_json), rollback=rollback,
                        to_cluster=to_cluster)
    if as_json:
        _emit(result)


def _deployment(config: Path | None) -> Path:
    """The state folder of the config's deployment. A config that became invalid after the
    deploy still names its workdir: stop and status work from that."""
    from moepipe.commands.deploy import state_dir
    from moepipe.config import load_config, workdir_of

    try:
        cfg = load_config(config)
    except ConfigError as e:
        workdir = workdir_of(config)
        if workdir is None or not (workdir / "server").is_dir():
            raise
        logging.getLogger("moepipe").warning("%s; using the deployment recorded in %s",
                                             e.message, workdir / "server")
        return workdir / "server"
    return state_dir(cfg)


@app.command()
def stop(config: Path | None = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Stop the workdir's Triton server and every process of its deployment."""
    from moepipe.deploy.local import lifecycle

    res = lifecycle.stop(_deployment(config))
    if as_json:
        _emit(res)
        return
    how = "" if res["graceful"] else f" (forced: {res['forced']})"
    left = f"; killed {res['leftovers']} leftover process(es)" if res["leftovers"] else ""
    if res["was_running"]:
        _echo(f"stopped tritonserver pid {res['pid']}{how}{left}")
    elif res["pid"] is not None:
        _echo(f"tritonserver pid {res['pid']} was not running; cleared its record{left}")
    else:
        _echo(f"no tritonserver was running{left}")


@app.command()
def status(config: Path | None = ConfigOpt,
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Is the workdir's Triton server serving, and where."""
    from moepipe.deploy.local import lifecycle

    info = lifecycle.status(_deployment(config))
    if as_json:
        typer.echo(json.dumps(info))
    elif info["running"]:
        sup = f"  supervised (restarts {info['restarts']}/{info['max_restarts']})" \
            if info.get("supervised") else ""
        ranks = f"  ranks {len(info['ranks']) + 1}" if info.get("ranks") else ""
        version = f"  version {info['version']}" if info.get("version") else ""
        typer.echo(f"running  pid {info['pid']}  http {info['http']}  grpc {info['grpc']}  "
                   f"metrics {info['metrics']}{version}{ranks}{sup}")
    elif info.get("dead_ranks"):
        typer.echo(f"not serving: worker {info['dead_ranks'][0]} of the rank group is gone "
                   f"(tritonserver pid {info['pid']} is up; the supervisor starts the group "
                   "again)")
    elif info.get("dead_models"):
        typer.echo(f"not serving: the backend process of {info['dead_models'][0]} died "
                   f"(tritonserver pid {info['pid']} is still up)")
    else:
        typer.echo("not running" + (f": {info['failure']}" if info.get("failure") else ""))


@app.command()
def serve(repository: Path = typer.Argument(..., help="A rendered model repository."),
          host: str = typer.Option("127.0.0.1", "--host"),
          http_port: int = typer.Option(8000, "--http-port", min=1, max=65535),
          grpc_port: int = typer.Option(8001, "--grpc-port", min=1, max=65535),
          metrics_port: int = typer.Option(8002, "--metrics-port", min=1, max=65535),
          timeout: float = typer.Option(180.0, "--timeout", help="Seconds to wait for ready."),
          max_restarts: int = typer.Option(3, "--max-restarts", min=0,
                                           help="Times a dead server or model process is "
                                                "restarted before giving up (exit 1)."),
          as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout when "
                                       "the server is ready (messages go to stderr).")
          ) -> None:
    """Run a rendered repository in the foreground (Ctrl-C, SIGTERM or SIGHUP stop it
    cleanly); a dead server or model process is restarted, up to --max-restarts times."""
    from moepipe.deploy.local import lifecycle, supervisor
    from moepipe.deploy.local.state import SERVE_DIR, STATE_FILE

    if not (repository / "ensemble" / "config.pbtxt").is_file():
        raise MoepipeError(f"{repository}: not a rendered model repository (no ensemble)",
                           "pass <deploy>/model_repo as written by `moepipe deploy`")
    ports = {"--http-port": http_port, "--grpc-port": grpc_port,
             "--metrics-port": metrics_port}
    if len(set(ports.values())) < len(ports):
        raise MoepipeError(f"{', '.join(f'{k} {v}' for k, v in ports.items())}: the three "
                           "ports must differ", "choose three free ports")
    if not timeout > 0 or timeout == float("inf"):
        raise MoepipeError(f"--timeout {timeout}: must be a positive number of seconds")
    repo = repository.resolve()
    where = repo.parent / SERVE_DIR
    say = _say(as_json)
    with lifecycle.guard(where):  # whatever ends the command stops what it started
        state = lifecycle.start(repo, where, host=host, http_port=http_port,
                                grpc_port=grpc_port, metrics_port=metrics_port, timeout=timeout)
        say(f"serving {repository} (pid {state.pid}): http {state.http}, grpc {state.grpc}, "
            f"metrics {state.metrics}; log {state.log}. Ctrl-C to stop.")
        if as_json:  # on its own line at once: a caller reads it while the server runs
            typer.echo(json.dumps(state.to_status(True)))
            sys.stdout.flush()
        code = supervisor.foreground(where, state, max_restarts, say)
    (where / STATE_FILE).unlink(missing_ok=True)
    raise typer.Exit(code)


@app.command()
def validate(config: Path | None = ConfigOpt,
             url: str | None = typer.Option(None, "--url", help="HTTP endpoint host:port."),
             grpc_url: str | None = typer.Option(None, "--grpc-url",
                                                 help="gRPC endpoint host:port."),
             job: list[JobChoice] | None = typer.Option(None, "--job", help="Run only these "
                                                        "jobs (repeatable)."),
             as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout: "
                                          "the report and where its files are (messages go "
                                          "to stderr).")
             ) -> None:
    """Run the validation jobs against the live endpoint; JSON + JUnit XML reports."""
    from moepipe.commands.validate import run_validate
    from moepipe.config import load_config

    report, paths = run_validate(load_config(config), url, grpc_url, list(_values(job)) or None,
                                 echo=_say(as_json))
    if as_json:
        _emit({**report.to_dict(), "files": {"json": str(paths[0]), "junit": str(paths[1]),
                                             "html": str(paths[2])}})
    if not report.passed:
        raise typer.Exit(1)


@app.command()
def ci(step: CiStep = typer.Argument(..., help="build | deploy-validate (cpu: deploy, "
                                      "validate, soak, stop) | gpu-validate (launch.sh on a GPU "
                                      "runner, validate, stop)."),
       config: Path | None = typer.Option(None, "-c", "--config", envvar="MOEPIPE_CONFIG",
                                          help="Pipeline config (default ./moepipe.yaml)."),
       reports: Path = typer.Option(Path("ci-reports"), "--reports", envvar="MOEPIPE_REPORTS",
                                    help="Where the JSON, JUnit and HTML reports are copied "
                                         "for the pipeline to publish."),
       ready_timeout: float = typer.Option(1800, "--ready-timeout",
                                           envvar="MOEPIPE_READY_TIMEOUT_S",
                                           help="gpu-validate: seconds to wait for ready."),
       soak_seconds: float = typer.Option(SOAK_SECONDS, "--soak-seconds", min=0,
                                          envvar="MOEPIPE_SOAK_SECONDS",
                                          help="deploy-validate: the soak run after the "
                                               "config's jobs, in seconds (0: none).")
       ) -> None:
    """One step of moepipe's CI pipelines (ci/github-actions.yml, ci/gitlab-ci.yml); with
    GITHUB_STEP_SUMMARY set, the validation results go to the job summary."""
    from moepipe.commands.ci import run_ci

    if not run_ci(step, config or Path("moepipe.yaml"), reports, _echo, ready_timeout,
                  soak_seconds):
        raise typer.Exit(1)
