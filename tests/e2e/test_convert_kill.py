"""Issue 26 item 18: a `moepipe convert` ended by SIGTERM removes its partial output; one
ended by SIGKILL leaves it, and the next convert removes it (as the next build does)."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

KILL_AFTER_WRITING = """
import os, signal, sys, time
import moepipe.conversion.write as w
write = w.convert_into
def convert_into(*args, **kwargs):
    result = write(*args, **kwargs)  # every rank file written, not yet renamed into place
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(30)
    return result
w.convert_into = convert_into
from moepipe.cli import main
main(sys.argv[2:])
"""


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from moepipe.examples import write_example

    return write_example("tiny-mixtral", tmp_path_factory.mktemp("hf") / "tiny-mixtral")


def _default_signals():
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _convert(hf_model, out, kill=None):
    args = ["convert", "--model", str(hf_model), "--output", str(out), "--tp", "2"]
    cmd = [sys.executable, "-c", KILL_AFTER_WRITING, kill, *args] if kill else \
        [sys.executable, "-m", "moepipe", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          preexec_fn=_default_signals)


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_convert_ended_by_a_signal_leaves_no_partial_output(tmp_path, hf_model):
    out = tmp_path / "ckpt"
    termed = _convert(hf_model, out, "SIGTERM")
    assert termed.returncode == 143 and termed.stderr.splitlines() == ["interrupted by SIGTERM"]
    assert _hidden(tmp_path) == [] and not out.exists()

    killed = _convert(hf_model, out, "SIGKILL")  # nothing can clean up after this one
    assert killed.returncode == -signal.SIGKILL
    assert [p.split("-")[0] for p in _hidden(tmp_path)] == [".ckpt.partial"]
    done = _convert(hf_model, out)
    assert done.returncode == 0, done.stderr
    assert _hidden(tmp_path) == [], "the killed convert's partial output was not removed"
    assert sorted(p.name for p in out.glob("rank*")) == ["rank0.safetensors",
                                                         "rank1.safetensors"]
