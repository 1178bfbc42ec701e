"""Kill tests: a build SIGKILLed in the middle of any stage leaves no output that looks complete,
and the next `moepipe build` resumes and gives exactly what an uninterrupted build gives."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

pytest.importorskip("modelopt")

CONFIG = {"model": {"example": "tiny-mixtral"}, "parallel": {"tp": 2, "moe_ep": 2},
          "quantize": {"format": "fp8", "kv_cache": "fp8",
                       "calibration": {"samples": 16, "seq_len": 32, "eval_samples": 4}},
          "workdir": "work"}
# Where the build is killed: "<stage>@<n>" at the n-th progress step of the stage (a
# calibration batch, a converted rank, a held-out sequence), "<stage>" when its output is
# complete but not yet renamed into place.
KILL_POINTS = ["source", "quantize@2", "convert@1", "quality@2", "quality"]


def _build(folder, fault=""):
    env = {**os.environ, "MOEPIPE_FAULT": fault}
    return subprocess.run([sys.executable, "-m", "moepipe", "build"], cwd=folder, env=env,
                          capture_output=True, text=True)


def _project(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "moepipe.yaml").write_text(yaml.safe_dump(CONFIG))
    return folder


def _result(folder):
    manifest = json.loads((folder / "work" / "build-manifest.json").read_text())
    assert manifest["finished"] is not None
    return {s["stage"]: (s["fingerprint"], s["blake3"]) for s in manifest["stages"]}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    folder = _project(tmp_path_factory.mktemp("clean"))
    proc = _build(folder)
    assert proc.returncode == 0, proc.stderr
    return _result(folder)


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_build_resumes_to_the_same_result(tmp_path, clean, point):
    folder = _project(tmp_path)
    killed = _build(folder, fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    work = folder / "work"
    stage = point.split("@")[0]
    # Nothing that looks complete is incomplete: every visible output has its stage record,
    # and the killed stage has none.
    for out in (work / "artifacts").iterdir():
        if not out.name.startswith("."):
            assert (out / "moepipe-stage.json").is_file(), f"{out} looks complete but is not"
    assert not list((work / "artifacts").glob(f"{stage}-*"))
    for link in ("model", "quantized", "checkpoint"):
        if (work / link).is_symlink():
            assert (work / link / "moepipe-stage.json").is_file()
    resumed = _build(folder)
    assert resumed.returncode == 0, resumed.stderr
    assert "built" in resumed.stdout and "reused" in resumed.stdout or stage == "source"
    assert _result(folder) == clean
    leftovers = [p.name for p in (work / "artifacts").iterdir() if p.name.startswith(".")]
    assert leftovers == [], "partial outputs of the killed build were not cleaned up"


def test_ctrl_c_is_one_line_exit_130(tmp_path):
    # quantization keeps the build busy for seconds: the interrupt lands inside the build
    path = tmp_path / "moepipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"example": "tiny-mixtral"}, "workdir": "work",
                                    "quantize": {"format": "fp8"}}))
    proc = subprocess.Popen([sys.executable, "-m", "moepipe", "build", "-c", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # Ctrl-C's default action, also when the suite runs in the
                            # background (a shell starts background jobs with SIGINT ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list((tmp_path / "work" / "artifacts").glob(".quantize-*")) \
            and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)  # until the quantize stage has started (not while Python starts)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
