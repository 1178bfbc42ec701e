"""The ``moepipe`` command line: a thin shell over the stages.

Heavy imports (torch, transformers, tritonclient) happen inside the commands, so ``--help`` is
instant and needs no GPU. User mistakes (:class:`MoepipeError`) print one line with a hint and
exit non-zero; anything else is a bug and shows a traceback with ``--debug``.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import sys
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import typer

from moepipe import __version__
from moepipe.commands.ci import SOAK_SECONDS
from moepipe.config import Dtype, JobName, KvCacheFormat, QuantFormat, Target, field_help
from moepipe.errors import ConfigError, MoepipeError
from moepipe.examples import EXAMPLES

# Choices typer checks, lists in --help and completes in the shell. The config's own come from
# the config model; these are the registries' (tests/unit/test_cli_options.py holds them equal).
StageName = Literal["source", "inspect", "quantize", "convert", "quality", "engine"]
Goal = Literal["throughput", "latency"]
CiStep = Literal["build", "deploy-validate", "gpu-validate"]
PlanFormat = Literal["auto", "none", "fp8", "fp8_block", "int8_sq", "int4_awq", "w4a8_awq",
                     "nvfp4"]


def _choices(name: str, values: Iterable[str]) -> type[enum.Enum]:
    """String choices of a repeatable option (typer takes lists of enums, not of literals)."""
    return enum.Enum(name, {v: v for v in values}, type=str)  # type: ignore[return-value]


def _values(items: Iterable[Any] | None) -> tuple[str, ...]:
    return tuple(getattr(i, "value", i) for i in items or ())


if TYPE_CHECKING:  # what the command functions receive
    ExampleName: TypeAlias = str
    StageChoice: TypeAlias = str
    JobChoice: TypeAlias = str
else:
    ExampleName = Literal[tuple(EXAMPLES)]
    StageChoice = _choices("Stage", typing.get_args(StageName))
    JobChoice = _choices("Job", typing.get_args(JobName))

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Mixture-of-Experts LLMs: Hugging Face checkpoint -> TensorRT-LLM -> "
                       "validated Triton deployment.")
_state = {"debug": False}

ConfigOpt = typer.Option(None, "-c", "--config", help="Pipeline config (default ./moepipe.yaml).")
JsonOpt = typer.Option(False, "--json", help="One JSON object on stdout (messages go to "
                                             "stderr).")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moepipe {__version__}")
        raise typer.Exit()


class _Stderr:
    """sys.stderr as it is at each write: while a progress bar redirects it, log lines print
    above the bar instead of through it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@app.callback()
def _main(ctx: typer.Context,
          debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
          verbose: bool = typer.Option(False, "-v", "--verbose", help="Log progress."),
          quiet: bool = typer.Option(False, "-q", "--quiet", help="Only errors (no progress "
                                     "bars)."),
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    _state["debug"] = debug
    level = logging.DEBUG if debug else logging.INFO if verbose else \
        logging.ERROR if quiet else logging.WARNING
    logging.basicConfig(level=level, format="moepipe: %(message)s", stream=_Stderr())
    _state["quiet"] = quiet
    _show_progress(ctx, quiet)


def _show_progress(ctx: typer.Context, quiet: bool) -> None:
    """Progress of long work on stderr while the command runs (moepipe.terminal)."""
    from moepipe.terminal import progress_view
    from moepipe.utils import progress

    view = progress_view(quiet)
    progress.install(view)

    def done() -> None:
        progress.install(None)
        if view is not None:
            view.close()

    ctx.call_on_close(done)


def _echo(text: str = "") -> None:
    if not _state.get("quiet"):
        typer.echo(text)


def _say(as_json: bool) -> Callable[[str], None]:
    """Where a command's messages go: stdout, or stderr when stdout carries its JSON."""
    def to_stderr(text: str = "") -> None:
        if not _state.get("quiet"):
            typer.echo(text, err=True)

    return to_stderr if as_json else _echo


def _emit(obj: Any) -> None:
    """The one JSON object of a ``--json`` command, on stdout."""
    typer.echo(json.dumps(obj, indent=2, default=str))


@app.command()
def example(name: ExampleName = typer.Argument(..., help="A built-in example."),
            out: Path = typer.Option(..., "--out", help="Folder to create."),
            overwrite: bool = typer.Option(False, "--overwrite")) -> None:
    """Write a built-in tiny checkpoint (HF format, with a real tokenizer): seeded random
    weights, or (*-trained) trained once per machine on the shipped corpus."""
    from moepipe.examples import write_example

    write_example(name, out, overwrite=overwrite, progress=logging.getLogger("moepipe").info)
    _echo(f"wrote {name} to {out}")


@app.command("inspect")
def inspect_cmd(model: Path = typer.Argument(..., help="Hugging Face checkpoint folder."),
                as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
                max_gpus: int = typer.Option(8, "--max-gpus",
                                             help="Largest world size to list.")) -> None:
    """Architecture, sizes, parameter counts and the legal parallel mappings of a checkpoint."""
    from moepipe.stages.inspect import format_inspection, inspect_checkpoint

    result = inspect_checkpoint(model, max_gpus)
    typer.echo(json.dumps(result.data, indent=2) if as_json else format_inspection(result.data))


@app.command()
def convert(model: Path = typer.Option(..., "--model", help="Hugging Face checkpoint folder."),
            output: Path = typer.Option(..., "--output", help="TensorRT-LLM checkpoint folder."),
            dtype: Dtype = typer.Option("auto", "--dtype", help=field_help("model.dtype")),
            tp: int = typer.Option(1, "--tp", help=field_help("parallel.tp")),
            pp: int = typer.Option(1, "--pp", help=field_help("parallel.pp")),
            moe_tp: int | None = typer.Option(None, "--moe-tp",
                                              help=field_help("parallel.moe_tp")),
            moe_ep: int | None = typer.Option(None, "--moe-ep",
                                              help=field_help("parallel.moe_ep")),
            workers: int = typer.Option(1, "--workers", help=field_help("convert.workers")),
            overwrite: bool = typer.Option(False, "--overwrite"),
            as_json: bool = JsonOpt) -> None:
    """Convert a Hugging Face MoE checkpoint into a sharded TensorRT-LLM checkpoint."""
    from moepipe.conversion.write import convert as run_convert

    res = run_convert(model, output, dtype=dtype, tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep,
                      workers=workers, overwrite=overwrite)
    m = res.plan.mapping
    if as_json:
        _emit({"output": str(output.resolve()), "world_size": m.world_size, "tp": m.tp,
               "pp": m.pp, "moe_tp": m.moe_tp, "moe_ep": m.moe_ep, "dtype": res.plan.dtype,
               "bytes_written": res.bytes_written, "seconds": round(res.seconds, 3)})
        return
    _echo(f"wrote {output}: {m.world_size} rank(s) ({m.describe()}), {res.plan.dtype}, "
          f"{res.bytes_written / 2**20:.1f} MiB in {res.seconds:.2f}s")


@app.command()
def parity(hf: Path = typer.Option(..., "--hf", help="Source Hugging Face checkpoint."),
           checkpoint: Path = typer.Option(..., "--checkpoint",
                                           help="Converted TensorRT-LLM checkpoint."),
           prompt: list[str] | None = typer.Option(None, "--prompt",
                                                      help="Prompt (repeatable)."),
           max_new_tokens: int = typer.Option(16, "--max-new-tokens"),
           tolerance: float = typer.Option(1e-4, "--tolerance",
                                           help="Max abs logit difference allowed."),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Compare a converted checkpoint with Hugging Face transformers: logits and greedy tokens."""
    from moepipe.validate.parity import check_parity

    report = check_parity(hf, checkpoint, prompt, max_new_tokens, tolerance)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for p in report.prompts:
            typer.echo(f"  {p.prompt[:48]!r:52} max|dlogit| {p.max_abs_diff:.2e}  greedy "
                       f"{len(p.moepipe_tokens)} tokens "
                       f"{'match' if p.tokens_match else 'DIFFER'}")
        verdict = "PASS" if report.passed else "FAIL"
        typer.echo(f"parity {verdict}: max |logit diff| {report.max_abs_diff:.2e} "
                   f"(tolerance {tolerance:g}) vs transformers")
    if not report.passed:
        raise typer.Exit(1)


@app.command()
def init(model: Path | None = typer.Option(None, "--model", help=field_help("model.path")),
         example_name: ExampleName | None = typer.Option(
             None, "--example", metavar="NAME",
             help=f"{field_help('model.example')} (`moepipe example --help` lists them)"),
         target: Target = typer.Option("cpu", "--target", help=field_help("target")),
         tp: int = typer.Option(1, "--tp", help=field_help("parallel.tp")),
         pp: int = typer.Option(1, "--pp", help=field_help("parallel.pp")),
         moe_tp: int | None = typer.Option(None, "--moe-tp", help=field_help("parallel.moe_tp")),
         moe_ep: int | None = typer.Option(None, "--moe-ep", help=field_help("parallel.moe_ep")),
         quantize: QuantFormat = typer.Option("none", "--quantize",
                                              help=field_help("quantize.format")),
         kv_cache: KvCacheFormat = typer.Option("none", "--kv-cache",
                                                help=field_help("quantize.kv_cache")),
         use_plan: bool = typer.Option(False, "--plan", help="Fill parallel and build limits "
                                       "from the best `moepipe plan` for --cluster."),
         cluster: str = typer.Option("8xH100", "--cluster", help="With --plan: GPUSxKIND or "
                                     "NODESxGPUSxKIND (A100-40, A100-80, H100, H200, B200, "
                                     "L40S)."),
         isl: int = typer.Option(2048, "--isl", help="With --plan: input tokens per request."),
         osl: int = typer.Option(512, "--osl", help="With --plan: output tokens per request."),
         goal: Goal = typer.Option("throughput", "--goal", help="With --plan: what to rank "
                                   "by."),
         force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
         config: Path = typer.Option(Path("moepipe.yaml"), "-c", "--config",
                                     help="File to write."),
         as_json: bool = JsonOpt) -> None:
    """Write a commented moepipe.yaml here, and its JSON Schema beside it for editors."""
    from moepipe.commands.init import run_init

    made = run_init(config, model=model, example=example_name, target=target, tp=tp, pp=pp,
                    moe_tp=moe_tp, moe_ep=moe_ep, quantize=quantize, kv_cache=kv_cache,
                    force=force, plan={"cluster": cluster, "isl": isl, "osl": osl,
                                       "goal": goal} if use_plan else None)
    say, par = _say(as_json), made["parallel"]
    if made["note"]:
        say(f"parallel: tp={par['tp']} pp={par['pp']} moe_tp={par['moe_tp']} moe_ep="
            f"{par['moe_ep']} attention_dp={str(par['attention_dp']).lower()} ({made['note']})")
    say(f"wrote {config} (and its schema {Path(made['schema']).name}); next: moepipe build")
    if as_json:
        _emit(made)


@app.command()
def schema(out: Path | None = typer.Option(None, "--out", help="Write it to this file "
                                           "(default: stdout).")) -> None:
    """The JSON Schema of moepipe.yaml, from the config model (editors, CI checks)."""
    from moepipe.commands.init import config_schema
    from moepipe.utils.fs import write_text_atomic

    text = json.dumps(config_schema(), indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    write_text_atomic(out, text)
    _echo(f"wrote {out}")


@app.command("plan")
def plan_cmd(model: str = typer.Argument(..., help="Checkpoint folder, config.json, a built-in "
                                         "example or a published model: Mixtral-8x7B, "
                                         "Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3."),
             cluster: str = typer.Option("8xH100", "--cluster", help="GPUSxKIND or "
                                         "NODESxGPUSxKIND; KIND: A100-40, A100-80, H100, H200, "
                                         "B200, L40S."),
             isl: int = typer.Option(2048, "--isl", help="Input tokens per request."),
             osl: int = typer.Option(512, "--osl", help="Output tokens per request."),
             goal: Goal = typer.Option("throughput", "--goal", help="What to rank by."),
             quantize: PlanFormat = typer.Option("auto", "--quantize", help="Weight format "
                                                 "(auto: as published)."),
             kv_cache: KvCacheFormat = typer.Option("none", "--kv-cache",
                                                    help="KV-cache format."),
             kv_fraction: float = typer.Option(0.9, "--kv-fraction", help="Share of the free "
                                               "GPU memory the KV cache takes."),
             target: Target = typer.Option("trtllm-pytorch", "--target",
                                           help="The target to plan for."),
             max_num_tokens: int = typer.Option(8192, "--max-num-tokens",
                                                help="Tokens per engine step."),
             nvlink_gbps: float | None = typer.Option(None, "--nvlink-gbps",
                                                      help="NVLink GB/s per direction."),
             internode_gbps: float | None = typer.Option(None, "--internode-gbps",
                                                         help="Network GB/s per GPU."),
             usd_per_gpu_hour: float | None = typer.Option(
                 None, "--usd-per-gpu-hour", help="Price of one GPU per hour: adds US$ per "
                 "million output tokens per mapping (roofline) and for the dense model of the "
                 "same parameters."),
             as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
             write: Path | None = typer.Option(None, "--write", help="Also write "
                                               "aiconfigurator's inputs into this folder."),
             top: int = typer.Option(12, "--top", min=1, help="Rows of the table.")) -> None:
    """Which parallel mapping fits a cluster: weights, KV cache, traffic, ranked for a goal."""
    from moepipe.commands.plan import PlanRequest, model_id, run_plan, to_json
    from moepipe.planner.aic import write_aiconfigurator
    from moepipe.planner.report import format_plan

    result = run_plan(PlanRequest(model, cluster, isl, osl, goal, quantize, kv_cache,
                                  kv_fraction, target, max_num_tokens, nvlink_gbps,
                                  internode_gbps, usd_per_gpu_hour))
    written = None
    if write is not None:
        written = write_aiconfigurator(result, model_id(model), write)
    typer.echo(to_json(result) if as_json else format_plan(result, top))
    if written is not None:
        _echo(f"wrote {written}; run: aiconfigurator cli exp --yaml-path {written}")


@app.command("balance")
def balance_cmd(metrics: str | None = typer.Option(None, "--metrics", help="A deployment's "
                                                   "metrics URL (default, with a config: its "
                                                   "own, http://HOST:METRICS_PORT/metrics)."),
                counts: Path | None = typer.Option(None, "--counts", help="Expert token "
                                                   "counts: JSON {\"layers\": {\"0\": [...]}},"
                                                   " saved metrics text, or the folder "
                                                   "TensorRT-LLM's expert statistics wrote "
                                                   "(read with the config's mapping)."),
                moe_ep: int | None = typer.Option(None, "--moe-ep", help="EP ranks (default: "
                                                  "the config's parallel.moe_ep)."),
                slots: int | None = typer.Option(None, "--slots", help="Expert slots per "
                                                 "layer (default: experts + moe_ep)."),
                out: Path = typer.Option(Path("expert-placement.yaml"), "--out",
                                         help="Placement file to write."),
                config: Path | None = ConfigOpt,
                as_json: bool = typer.Option(False, "--json", help="Print the prediction as "
                                             "JSON.")) -> None:
    """Expert placement from measured load for TensorRT-LLM's MoE load balancer."""
    from moepipe.commands.plan import dump_mapping, format_balance, run_balance

    dump = None
    folder = counts is not None and counts.is_dir()
    if moe_ep is None or (metrics is None and counts is None) or folder:
        from moepipe.config import DEFAULT_CONFIG, load_config

        if folder and not (config or Path(DEFAULT_CONFIG)).is_file():
            raise ConfigError(f"--counts {counts}: a folder is read as TensorRT-LLM's expert "
                              "statistics, with the mapping of the deployment that wrote it",
                              "pass -c with that deployment's moepipe.yaml")
        cfg = load_config(config)
        moe_ep = moe_ep or cfg.parallel.to_mapping().moe_ep
        if metrics is None and counts is None:
            metrics = f"http://{cfg.deploy.host}:{cfg.deploy.metrics_port}/metrics"
        dump = dump_mapping(cfg) if folder else None
    placement = run_balance(metrics, counts, moe_ep, slots, out, dump)
    typer.echo(json.dumps(placement.summary(), indent=2) if as_json
               else format_balance(placement, out))


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


def main(argv: list[str] | None = None) -> None:
    """The console entry point: every user mistake is one line and exit 2; Ctrl-C, SIGTERM and
    SIGHUP are one ``interrupted`` line and exit 130, 143, 129 once the command has stopped
    what it started (:mod:`moepipe.utils.interrupt`); anything else is a bug (traceback;
    ``--debug``)."""
    from moepipe.utils import interrupt

    code: object = 0
    with interrupt.handled():
        try:
            # Without standalone mode click returns typer.Exit's code instead of exiting.
            code = app(args=argv, prog_name="moepipe", standalone_mode=False)
        except interrupt.Interrupted as e:
            code = e.exit_code
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
                typer.echo(e.line, err=True)
        except MoepipeError as e:
            _fail(e)
        except OSError as e:  # a full, read-only or missing disk: the user's to fix
            from moepipe.utils.oserrors import describe_os_error

            if _state["debug"]:
                raise
            _fail(describe_os_error(e))
        except (KeyboardInterrupt, typer.Abort):  # SIGINT while a handler was not ours
            typer.echo("interrupted", err=True)
            code = 130
        except typer.Exit as e:
            code = e.exit_code
        except typer.TyperException as e:  # usage errors: typer raises its vendored click ones
            cmd = getattr(getattr(e, "ctx", None), "command_path", None) or "moepipe"
            # (typer checks choices with pydantic, whose prefix says nothing here)
            message = e.format_message().replace("Value error, ", "")
            _fail(MoepipeError(message, f"see `{cmd} --help`"),
                  exit_code=getattr(e, "exit_code", 2) or 2)
    if isinstance(code, int) and code:
        sys.exit(code)


def _fail(e: MoepipeError, exit_code: int | None = None) -> None:
    """Print a user error as one line (and its details) and exit."""
    if _state["debug"]:
        raise e
    typer.echo(f"error: {e.message}" + (f" (hint: {e.hint})" if e.hint else ""), err=True)
    if e.details:
        typer.echo(e.details, err=True)
    sys.exit(exit_code or e.exit_code)
