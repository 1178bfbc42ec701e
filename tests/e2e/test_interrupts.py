"""Issue 26 (items 1, 6, 16, 18), the parts that need no server: signals become one clean
exit, a deployment removes only the shared memory it names, serve's ports are checked, stale
partial outputs are removed."""

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from moepipe.utils import interrupt

# -- item 1: the signal handling every moepipe process uses -----------------------------------


def test_the_first_signal_raises_the_next_ones_ask_the_clean_up_to_hurry():
    before = signal.getsignal(signal.SIGTERM)
    with interrupt.handled():
        with pytest.raises(interrupt.Interrupted) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (the signal arrives before this ends)
        assert raised.value.exit_code == 143 and raised.value.line == "interrupted by SIGTERM"
        assert not interrupt.hurry()
        os.kill(os.getpid(), signal.SIGINT)  # during the clean-up: no exception, a hurry
        time.sleep(0.01)
        assert interrupt.hurry() and interrupt.received() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before and not interrupt.hurry()


def test_an_ignored_signal_stays_ignored():
    """`nohup moepipe serve` must survive its terminal: a SIGHUP ignored on entry stays so."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupt.handled():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)
            assert interrupt.received() is None
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code, line", [(signal.SIGTERM, 143, "interrupted by SIGTERM"),
                                              (signal.SIGHUP, 129, "interrupted by SIGHUP"),
                                              (signal.SIGINT, 130, "interrupted")])
def test_the_cli_exits_128_plus_the_signal_with_one_line(sig, code, line):
    """Any command (here `moepipe plan`, kept busy by a slow stand-in) ends on a signal with
    one line and 128 + its number."""
    script = ("import sys, time, moepipe.commands.plan as p\n"
              "def slow(*a, **k):\n"
              "    print('busy', flush=True); time.sleep(60)\n"
              "p.run_plan = slow\n"
              "from moepipe.cli import main\n"
              "main(['plan', 'tiny-mixtral'])\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                                for s in interrupt.SIGNALS])
    try:
        assert proc.stdout.readline() == "busy\n"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code
    assert err.splitlines() == [line]


# -- item 6: a record is not trusted with paths ------------------------------------------------
def test_only_triton_regions_named_by_the_deployment_are_removed(tmp_path, monkeypatch):
    from moepipe.deploy.local import shm

    monkeypatch.setattr(shm, "SHM", tmp_path)
    mine = "triton_python_backend_shm_region_1b2c-mine"
    other = "triton_python_backend_shm_region_other"
    for name in (mine, other, "unrelated"):
        (tmp_path / name).write_bytes(b"\0" * 16)
    (tmp_path / "sub").mkdir()
    removed = shm.remove([mine, "unrelated", "../unrelated", f"{mine}/../../unrelated",
                          "triton_python_backend_shm_region_/../unrelated"])
    assert removed == [mine]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other, "sub", "unrelated"])


# -- item 16: serve's ports --------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--http-port", "70000"], "Invalid value for '--http-port': Input should be less than or "
                               "equal to 65535"),
    (["--http-port", "-1"], "Invalid value for '--http-port': Input should be greater than or "
                            "equal to 1"),
    # 0 would bind a port nobody knows: the server was waited for until the timeout
    (["--metrics-port", "0"], "Invalid value for '--metrics-port': Input should be greater"),
    (["--http-port", "9100", "--grpc-port", "9100"], "--http-port 9100, --grpc-port 9100, "
                                                     "--metrics-port 8002: the three ports "
                                                     "must differ"),
    (["--timeout", "nan"], "--timeout nan: must be a positive number of seconds"),
])
def test_serve_refuses_ports_it_cannot_serve_on_in_one_line(tmp_path, capsys, args, message):
    from moepipe.cli import main

    (tmp_path / "ensemble").mkdir()
    (tmp_path / "ensemble" / "config.pbtxt").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


# -- item 18: partial outputs of killed runs ---------------------------------------------------
def test_atomic_dir_removes_what_killed_runs_left_and_keeps_running_ones(tmp_path):
    from moepipe.utils.fs import atomic_dir

    out = tmp_path / "ckpt"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    killed = tmp_path / f".ckpt.partial-{dead}-a1b2c3"
    older = tmp_path / ".ckpt.partial-x7y8z9"  # earlier moepipe versions named no owner
    running = tmp_path / f".ckpt.partial-{os.getpid()}-d4e5f6"
    locked = tmp_path / f".ckpt.partial-{dead}-locked"  # a writer on another host holds it
    for folder in (killed, older, running, locked):
        folder.mkdir()
        (folder / "rank0.safetensors").write_bytes(b"x")
    fd = os.open(locked, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with atomic_dir(out) as tmp:
            (tmp / "rank0.safetensors").write_bytes(b"y")
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", running.name,
                                                                  locked.name])
