"""The command line's options as users meet them: --version, shell completion, choices that
typer checks and completes (from the config model and the registries), one-line errors."""

import importlib.metadata
import os
import subprocess
import sys
import typing

import pytest

from moepipe import cli


def run_main(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        cli.main(list(argv))
        raise SystemExit(0)
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def test_version_is_the_installed_distributions(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out == f"moepipe {importlib.metadata.version('moepipe')}\n"


def _complete(words: str) -> list[str]:
    env = {**os.environ, "_MOEPIPE_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - 1)}
    done = subprocess.run([sys.executable, "-m", "moepipe"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_shell_completion_completes_commands_options_and_choices(capsys):
    assert _complete("moepipe init --target trtllm-") == ["trtllm-engine", "trtllm-pytorch"]
    # a repeatable option's choices too (typer takes them as an enum)
    assert _complete("moepipe validate --job long") == ["long-tail"]
    code, out, _ = run_main(capsys, "--show-completion", "bash")
    assert code == 0 and "_MOEPIPE_COMPLETE=complete_bash" in out


def test_choices_are_the_registries():
    from moepipe.config import JobName
    from moepipe.examples import EXAMPLES
    from moepipe.planner.plan import GOALS
    from moepipe.sizing.weights import FORMATS
    from moepipe.stages.registry import STAGES
    from moepipe.validate.registry import JOBS

    assert typing.get_args(cli.StageName) == tuple(s.name for s in STAGES)
    assert typing.get_args(JobName) == tuple(JOBS)
    assert typing.get_args(cli.Goal) == GOALS
    assert set(typing.get_args(cli.PlanFormat)) == {"auto", *FORMATS}
    assert typing.get_args(cli.ExampleName) == tuple(EXAMPLES)


@pytest.mark.parametrize("argv,needle", [
    (["init", "--example", "tiny-mixtral", "--target", "gpu"], "'gpu' is not one of 'cpu'"),
    (["init", "--example", "tiny-gpt"], "'tiny-gpt' is not one of 'tiny-mixtral'"),
    (["convert", "--model", "m", "--output", "o", "--dtype", "fp64"], "'fp64' is not one of"),
    (["build", "--until", "train"], "'train' is not one of 'source', 'inspect'"),
    (["build", "--force", "convert", "--force", "nope"], "'nope' is not one of 'source'"),
    (["validate", "--job", "smoke", "--job", "speed"], "'speed' is not one of 'smoke'"),
    (["plan", "Mixtral-8x7B", "--quantize", "int3"], "'int3' is not one of 'auto'"),
])
def test_a_bad_choice_is_one_line_naming_the_choices(capsys, tmp_path, monkeypatch, argv,
                                                     needle):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: Invalid value for ")
    assert needle in err and "(hint: see `moepipe " in err and "Value error" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_json_errors_are_still_one_line_on_stderr(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in (["build", "--json"], ["deploy", "--json"], ["validate", "--json"],
                 ["build", "--dry-run", "--json"]):
        code, out, err = run_main(capsys, *argv)
        assert (code, out) == (2, ""), argv
        assert err.startswith("error: moepipe.yaml: no such config file") and \
            len(err.splitlines()) == 1, argv
