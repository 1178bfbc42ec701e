"""Progress as a user sees it: the command line in a real pseudo-terminal (the stdlib's pty),
with stdout on the terminal or on a pipe (``--json``), under ``-q``, and with no terminal at
all (a CI log: no bar, no escape codes, and for short work no line either)."""

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import yaml

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CLOCK = r"(?:\d+:\d\d:\d\d|-:--:--)"


def in_pty(args, cwd, json_stdout=False) -> tuple[int, str, str | None]:
    """Run ``moepipe *args`` with stderr (and stdout, unless ``json_stdout``: then a pipe) on
    a pseudo-terminal of 160 columns; returns the exit code, what the terminal received (as
    frames: escape codes removed, one line per redraw) and stdout when piped."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES", "TTY_COMPATIBLE")}
    proc = subprocess.Popen([sys.executable, "-m", "moepipe", *map(str, args)], cwd=cwd,
                            stdin=slave, stdout=subprocess.PIPE if json_stdout else slave,
                            stderr=slave, env={**env, "TERM": "xterm-256color"})
    os.close(slave)
    seen = b""
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: every end of the terminal is closed
            break
        if not data:
            break
        seen += data
    os.close(master)
    out = proc.stdout.read().decode() if json_stdout else None
    code = proc.wait(timeout=600)
    frames = ANSI.sub("", seen.decode(errors="replace")).replace("\r\n", "\n").replace("\r", "\n")
    return code, frames, out


def data_bytes(folder) -> int:
    """Tensor bytes of the rank files (each file less its header)."""
    total = 0
    for f in sorted(folder.glob("rank*.safetensors")):
        with open(f, "rb") as fh:
            header = struct.unpack("<Q", fh.read(8))[0]
        total += f.stat().st_size - 8 - header
    return total


def test_conversion_shows_a_byte_bar_on_a_terminal_and_nothing_elsewhere(tmp_path, examples):
    model = examples["tiny-mixtral"]
    args = ["convert", "--model", model, "--tp", "2", "--dtype", "float32"]
    code, frames, _ = in_pty([*args, "--output", "a"], tmp_path)
    assert code == 0, frames
    mb = f"{data_bytes(tmp_path / 'a') / 1e6:.1f}"
    # done / total bytes of both ranks, and the time left, redrawn as it goes
    bars = re.findall(rf"convert: (\d) of 2 rank files written .*? ([\d.]+)/{mb} MB.*?"
                      rf" {CLOCK} left", frames)
    assert bars and bars[-1] == ("2", mb), frames
    assert bars[0][1] == "0.0"  # drawn before the first byte: the total is known up front
    assert re.search(r"wrote a: 2 rank\(s\).*float32", frames)

    code, frames, _ = in_pty(["-q", *args, "--output", "b"], tmp_path)
    assert code == 0 and frames == ""  # quiet: nothing at all

    code, frames, out = in_pty([*args, "--output", "c", "--json"], tmp_path, json_stdout=True)
    assert code == 0 and json.loads(out)["world_size"] == 2  # stdout: the JSON object alone
    assert f"/{mb} MB" in frames and "{" not in frames  # the bar: on the terminal (stderr)

    done = subprocess.run([sys.executable, "-m", "moepipe", *map(str, args), "--output", "d",
                           "--json"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and json.loads(done.stdout)["world_size"] == 2
    assert done.stderr == ""  # not a terminal: no bar, and no line for a short conversion


def test_validate_shows_which_job_runs_and_its_requests(deployment, tmp_path):
    cfg, ep = deployment
    data = yaml.safe_load((cfg.workdir / "moepipe.yaml").read_text())
    data["workdir"] = str(tmp_path / "work")
    data["validate"]["perf"] = {"concurrency": [2], "rates": [], "requests": 10,
                                "duration_s": 20}
    (tmp_path / "moepipe.yaml").write_text(yaml.safe_dump(data))
    code, frames, _ = in_pty(["validate", "--url", ep.http, "--grpc-url", ep.grpc,
                              "--job", "smoke", "--job", "perf"], tmp_path)
    assert code in (0, 1) and re.search("validate (PASSED|FAILED)", frames), frames
    assert re.search(r"validate smoke \(job 1 of 2\): \w+", frames)  # the job and its check
    # perf: a warm-up of 4 requests, then its point of 10: done / planned, the time left
    counts = re.findall(rf"validate perf \(job 2 of 2\)(?:: (\w+))? .*? (\d+)/(\d+) "
                        rf"requests.*? {CLOCK} left", frames)
    assert counts and counts[-1][1:] == ("14", "14"), frames
    assert all(int(done) <= int(planned) for _, done, planned in counts)
    assert "concurrency_2" in {check for check, _, _ in counts}
    assert "ok   perf.concurrency_2" in frames  # the job's lines, once it is done
