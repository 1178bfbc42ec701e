"""A quantize stage SIGKILLed between two layers resumes at the first unfinished one on the next
`moepipe build`, leaves no shard a later stage could read, and ends with exactly what an
uninterrupted build writes; a progress line per layer on a terminal, none under -q."""

import json
import os
import pty
import signal
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("modelopt")

from moepipe.checkpoints.reader import parse_header  # noqa: E402

# tiny-mixtral: 4 decoder layers = 6 segments (embedding, 4 layers, norm + lm_head)
CONFIG = {"model": {"example": "tiny-mixtral"},
          "quantize": {"format": "fp8", "kv_cache": "fp8",
                       "calibration": {"samples": 16, "seq_len": 32, "eval_samples": 4}},
          "workdir": "work"}


def _build(folder, *args, fault=""):
    env = {**os.environ, "MOEPIPE_FAULT": fault}
    return subprocess.run([sys.executable, "-m", "moepipe", *args, "build", "--until",
                           "quantize"], cwd=folder, env=env, capture_output=True, text=True)


def _project(folder, **quantize):
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(CONFIG))
    config["quantize"]["calibration"].update(quantize)
    (folder / "moepipe.yaml").write_text(yaml.safe_dump(config))
    return folder


def _quantize_record(folder):
    manifest = json.loads((folder / "work" / "build-manifest.json").read_text())
    return next(s for s in manifest["stages"] if s["stage"] == "quantize")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    folder = _project(tmp_path_factory.mktemp("clean"))
    proc = _build(folder)
    assert proc.returncode == 0, proc.stderr
    return _quantize_record(folder)


def test_killed_quantize_resumes_at_the_first_unfinished_layer(tmp_path, clean):
    folder = _project(tmp_path)
    killed = _build(folder, fault="quantize@3")  # after the embedding and layers 0 and 1
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    artifacts = folder / "work" / "artifacts"
    # nothing a later stage reads: no quantize output, no link to one
    assert not [p for p in artifacts.iterdir() if p.name.startswith("quantize-")]
    assert not (folder / "work" / "quantized").exists()
    scratch = next(artifacts.glob(".quantize-*.resume"))
    state = json.loads((scratch / "state.json").read_text())
    assert [r["file"] for r in state["records"]] == [f"segment-{i:05d}.safetensors"
                                                     for i in range(3)]
    for record in state["records"]:  # every shard it names is whole
        infos = parse_header(scratch / record["file"])
        assert sorted(infos) == record["names"]
    # what a kill in the middle of writing leaves: a temporary file, and a shard that the
    # state does not name yet (written, then killed before the state)
    (scratch / ".segment-00003.safetensors.tmp").write_bytes(b"\0" * 100)
    (scratch / "segment-00003.safetensors").write_bytes(b"\1" * 64)
    resumed = _build(folder)
    assert resumed.returncode == 0, resumed.stderr
    record = _quantize_record(folder)
    assert record["status"] == "built"
    assert record["details"]["resumed_at_segment"] == 3  # layer 2 of 0..3
    assert clean["details"]["resumed_at_segment"] is None
    assert (record["fingerprint"], record["blake3"]) == (clean["fingerprint"], clean["blake3"])
    assert not list(artifacts.glob(".*")), "the scratch folder outlived the stage"


def test_a_changed_config_does_not_resume_a_killed_build(tmp_path):
    folder = _project(tmp_path)
    assert _build(folder, fault="quantize@2").returncode == -signal.SIGKILL
    old = next((folder / "work" / "artifacts").glob(".quantize-*.resume"))
    _project(tmp_path, samples=12)
    proc = _build(folder)
    assert proc.returncode == 0, proc.stderr
    assert _quantize_record(folder)["details"]["resumed_at_segment"] is None
    assert not old.exists()


def _on_terminal(folder, *args):
    """Run the build with a pseudo-terminal as stdout and stderr; returns what it showed."""
    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "moepipe", *args, "build", "--until",
                             "quantize"], cwd=folder, stdin=subprocess.DEVNULL, stdout=sub,
                            stderr=sub, env={**os.environ, "COLUMNS": "200"})
    os.close(sub)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal closed: the build ended
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert proc.wait() == 0, shown.decode(errors="replace")[-2000:]
    return shown.decode(errors="replace")


def test_progress_line_per_layer_on_a_terminal_and_quiet_under_q(tmp_path):
    shown = _on_terminal(_project(tmp_path / "loud"))
    assert "quantize: layer" in shown and "elapsed, about" in shown and "left" in shown
    quiet = _on_terminal(_project(tmp_path / "quiet"), "-q")
    assert "layer" not in quiet and "elapsed" not in quiet, quiet
