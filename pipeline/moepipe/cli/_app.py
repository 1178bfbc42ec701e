"""The command line's frame: the typer app, its global options, the choices and options the
commands share, how a command prints (``_echo``, ``_say``, ``_emit``) and the entry point
(:func:`main`: one line per user error). The commands are in :mod:`.models` and
:mod:`.pipeline`."""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import sys
import typing
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import typer

from moepipe import __version__
from moepipe.config import JobName
from moepipe.errors import MoepipeError
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
