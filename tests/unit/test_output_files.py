"""Files moepipe writes are whole or not there (issue 26, item 13): `plan --write` on a full
disk left a 0-byte aiconfigurator.yaml, `balance --out` left its temporary file after a
failure and replaced whatever stood at the path (a symbolic link, a named pipe, as root a
device node). Now every such write goes through utils.fs.write_text_atomic: a synced temporary
file renamed into place, removed on failure, non-regular targets refused, errors naming the
path. The full disk is simulated with RLIMIT_FSIZE (the write fails part-way, as on a full
disk) in a child process, so the real disk is never filled."""

import json
import os
import resource
import stat
import subprocess
import sys

import pytest

from moepipe.cli import main
from moepipe.utils.fs import write_text_atomic

COUNTS = {"layers": {"0": [5, 1, 1, 1], "1": [1, 1, 1, 9]}}


def run_limited(argv, tmp_path, max_file_bytes):
    """``moepipe ARGV`` in a child whose files may not grow past ``max_file_bytes`` (writes
    beyond fail with EFBIG, as writes on a full disk fail with ENOSPC)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "moepipe", *map(str, argv)], cwd=tmp_path,
                          env=env, preexec_fn=limit, capture_output=True, text=True,
                          timeout=120)


def one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_plan_write_on_a_full_disk_leaves_no_file(tmp_path):
    out = tmp_path / "aic"
    r = run_limited(["plan", "Mixtral-8x7B", "--write", out], tmp_path, 100)
    assert r.returncode == 2
    assert f"{out / 'aiconfigurator.yaml'}: File too large" in one_line(r.stderr)
    assert list(out.iterdir()) == []  # neither a 0-byte file nor a temporary one


def test_balance_out_on_a_full_disk_keeps_the_old_file(tmp_path):
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps(COUNTS))
    out = tmp_path / "placement.yaml"
    out.write_text("the previous placement\n")
    r = run_limited(["balance", "--counts", counts, "--moe-ep", "2", "--out", out], tmp_path,
                    100)
    assert r.returncode == 2 and f"{out}: File too large" in one_line(r.stderr)
    assert out.read_text() == "the previous placement\n"
    assert leftovers(tmp_path) == []
    # with room, the same command replaces it
    r = run_limited(["balance", "--counts", counts, "--moe-ep", "2", "--out", out], tmp_path,
                    1 << 20)
    assert r.returncode == 0, r.stderr
    assert "load_balancer" in out.read_text() and leftovers(tmp_path) == []


def balance_to(capsys, tmp_path, out):
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps(COUNTS))
    with pytest.raises(SystemExit) as exc:
        main(["balance", "--counts", str(counts), "--moe-ep", "2", "--out", str(out)])
    assert exc.value.code == 2
    return one_line(capsys.readouterr().err)


def test_balance_refuses_to_replace_a_symlink(tmp_path, capsys):
    target = tmp_path / "real.yaml"
    target.write_text("kept\n")
    link = tmp_path / "placement.yaml"
    link.symlink_to(target)
    msg = balance_to(capsys, tmp_path, link)
    assert f"{link}: is a symbolic link; moepipe writes regular files" in msg
    assert link.is_symlink() and target.read_text() == "kept\n"
    assert leftovers(tmp_path) == []


def test_balance_refuses_a_fifo_without_waiting(tmp_path, capsys):
    fifo = tmp_path / "placement.yaml"
    os.mkfifo(fifo)
    assert f"{fifo}: is a named pipe" in balance_to(capsys, tmp_path, fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_balance_refuses_a_device_node(tmp_path, capsys):
    dev = tmp_path / "placement.yaml"
    try:  # a copy of /dev/null's node: only root may make one
        os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    assert f"{dev}: is a character device" in balance_to(capsys, tmp_path, dev)
    assert stat.S_ISCHR(os.lstat(dev).st_mode)


def test_balance_refuses_a_folder(tmp_path, capsys):
    folder = tmp_path / "placement.yaml"
    folder.mkdir()
    assert f"{folder}: is a directory" in balance_to(capsys, tmp_path, folder)


def test_a_missing_folder_is_named(tmp_path, capsys):
    out = tmp_path / "missing" / "placement.yaml"
    assert f"{out}: No such file or directory" in balance_to(capsys, tmp_path, out)


def test_interrupted_write_removes_its_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "file.txt"
    path.write_text("old")

    def interrupted(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new")
    assert path.read_text() == "old" and leftovers(tmp_path) == []


def test_permissions_are_kept_or_follow_the_umask(tmp_path):
    path = tmp_path / "file.txt"
    path.write_text("old")
    path.chmod(0o640)
    write_text_atomic(path, "new")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_text() == "new"
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "fresh.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "fresh.txt").stat().st_mode) == 0o640
