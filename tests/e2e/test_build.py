"""The build runner: cached stages keyed by fingerprints, reruns of exactly what a change reaches,
--force / --until / --dry-run, the manifest, host-memory pre-flight, fail-fast GPU stages."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from moepipe.commands.build import MANIFEST, run_build
from moepipe.config import load_config
from moepipe.errors import MoepipeError


def write_config(folder, **sections):
    data = {"model": {"example": "tiny-mixtral"}, "parallel": {"tp": 2, "moe_ep": 2},
            "workdir": "work"}
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "moepipe.yaml").write_text(yaml.safe_dump(data))
    return folder / "moepipe.yaml"


def build(path, **kw):
    lines = []
    manifest = run_build(path, echo=lines.append, **kw)
    return {s["stage"]: s["status"] for s in manifest["stages"]}, manifest, lines


def test_rebuild_with_nothing_changed_does_no_work(tmp_path):
    path = write_config(tmp_path)
    status, first, _ = build(path)
    assert status == {"source": "built", "inspect": "built", "convert": "built"}
    ckpt = tmp_path / "work" / "checkpoint"
    assert (ckpt / "rank1.safetensors").is_file() and ckpt.is_symlink()
    mtimes = {p: p.stat().st_mtime_ns for p in ckpt.resolve().iterdir()}
    status, second, _ = build(path)
    assert set(status.values()) == {"reused"}
    assert {p: p.stat().st_mtime_ns for p in ckpt.resolve().iterdir()} == mtimes
    for a, b in zip(first["stages"], second["stages"], strict=True):
        assert a["fingerprint"] == b["fingerprint"] and a["blake3"] == b["blake3"]
    # The manifest: config, fingerprints, outputs with BLAKE3 digests, tool versions, timings.
    m = json.loads((load_config(path).workdir / MANIFEST).read_text())
    assert m["config"]["parallel"]["tp"] == 2 and m["finished"] is not None
    convert = next(s for s in m["stages"] if s["stage"] == "convert")
    assert len(convert["blake3"]["rank0.safetensors"]) == 64 and "seconds" in convert
    assert {"torch", "transformers", "nvidia-modelopt", "tensorrt-llm"} <= set(m["tools"])


def test_a_changed_section_reruns_only_the_stages_it_reaches(tmp_path):
    path = write_config(tmp_path)
    build(path)
    write_config(tmp_path, parallel={"tp": 2, "moe_ep": 1, "moe_tp": 2})
    status, _, _ = build(path)
    assert status == {"source": "reused", "inspect": "built", "convert": "built"}
    ckpt = json.loads((tmp_path / "work" / "checkpoint" / "config.json").read_text())
    assert ckpt["mapping"]["moe_tp_size"] == 2
    # Serving limits and deploy settings do not shape the cpu target's checkpoint.
    write_config(tmp_path, parallel={"tp": 2, "moe_ep": 1, "moe_tp": 2},
                 build={"max_batch_size": 4}, deploy={"http_port": 9100})
    status, _, _ = build(path)
    assert set(status.values()) == {"reused"}
    # Back to the first mapping: its outputs are still there.
    write_config(tmp_path)
    status, _, _ = build(path)
    assert set(status.values()) == {"reused"}


def test_force_reruns_one_stage_and_gives_the_same_bytes(tmp_path):
    path = write_config(tmp_path)
    _, first, _ = build(path)
    status, second, _ = build(path, force=("convert",))
    assert status == {"source": "reused", "inspect": "reused", "convert": "built"}
    assert first["stages"][-1]["blake3"] == second["stages"][-1]["blake3"]
    with pytest.raises(MoepipeError, match="unknown stage"):
        build(path, force=("link",))


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path):
    path = write_config(tmp_path)
    lines = []
    plan = run_build(path, echo=lines.append, dry_run=True)
    assert [s["action"] for s in plan["stages"]] == ["run"] * 3
    assert not (tmp_path / "work").exists()
    text = "\n".join(lines)
    assert "convert   run" in text and "host memory (peak)" in text
    build(path)
    plan = run_build(path, echo=lambda s: None, dry_run=True)
    assert [s["action"] for s in plan["stages"]] == ["reuse"] * 3


def test_engine_target_plan_shows_command_and_gpu_memory(tmp_path):
    path = write_config(tmp_path, target="trtllm-engine", parallel={"tp": 2, "moe_ep": 2},
                        quantize={"format": "fp8", "kv_cache": "fp8"})
    lines = []
    plan = run_build(path, echo=lines.append, dry_run=True)
    stages = [s["stage"] for s in plan["stages"]]
    assert stages == ["source", "inspect", "quantize", "convert", "quality", "engine"]
    engine = plan["stages"][-1]
    assert engine["command"][0] == "trtllm-build" and "--moe_plugin" in engine["command"]
    text = "\n".join(lines)
    assert "trtllm-build --checkpoint_dir" in text and "GPU memory per GPU" in text
    assert "kv cache" in text


def test_engine_stage_fails_fast_before_any_work(tmp_path):
    path = write_config(tmp_path, target="trtllm-engine")
    with pytest.raises(MoepipeError) as e:
        build(path)
    assert "trtllm-build" in e.value.message and "tritonserver" in e.value.hint
    assert "--until convert" in e.value.hint
    assert not (tmp_path / "work" / "artifacts").exists()
    # On a machine without TensorRT-LLM the checkpoint can still be prepared.
    status, _, _ = build(path, until="convert")
    assert status == {"source": "built", "inspect": "built", "convert": "built"}


def test_absurd_engine_limits_are_refused_before_any_work(tmp_path):
    path = write_config(tmp_path, target="trtllm-engine",
                        build={"max_batch_size": 4096, "max_input_len": 1024,
                               "max_seq_len": 2048, "gpu_memory_gb": 4})
    with pytest.raises(MoepipeError, match="GiB per GPU") as e:
        build(path)
    assert "max_batch_size" in e.value.hint
    assert not (tmp_path / "work" / "artifacts").exists()


def test_host_memory_preflight_stops_with_the_estimate(tmp_path, monkeypatch):
    import moepipe.commands.build

    path = write_config(tmp_path)
    monkeypatch.setattr(moepipe.commands.build, "available_memory", lambda: 64 << 20)
    with pytest.raises(MoepipeError, match=r"convert needs about 0\.\d GiB of host memory; "
                                           r"only 0\.1 GiB is available") as e:
        build(path)
    assert "tp" in e.value.hint
    assert not list((tmp_path / "work" / "artifacts").glob("convert-*"))


def test_gpu_only_format_is_refused_without_a_gpu(tmp_path):
    pytest.importorskip("modelopt")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = write_config(tmp_path, quantize={"format": "nvfp4"})
    with pytest.raises(MoepipeError, match="needs an NVIDIA GPU") as e:
        build(path)
    assert "fp8, int8_sq or int4_awq" in e.value.hint
    assert not (tmp_path / "work" / "artifacts").exists()


def test_int4_awq_on_a_model_with_odd_dimensions_is_refused_up_front(tmp_path):
    pytest.importorskip("modelopt")
    path = write_config(tmp_path, quantize={"format": "int4_awq"})
    with pytest.raises(MoepipeError, match="not a multiple of 128"):
        build(path)
    assert not (tmp_path / "work" / "artifacts").exists()


def test_build_lock_refuses_a_second_build(tmp_path):
    import fcntl

    write_config(tmp_path)
    (tmp_path / "work").mkdir()
    with open(tmp_path / "work" / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = subprocess.run([sys.executable, "-m", "moepipe", "build"], cwd=tmp_path,
                              capture_output=True, text=True)
    assert proc.returncode == 2
    assert "another `moepipe build` is running" in proc.stderr


def test_deploy_refuses_outputs_of_another_config(tmp_path):
    from moepipe.commands.build import outputs

    path = write_config(tmp_path)
    build(path)
    assert set(outputs(load_config(path))) == {"source", "inspect", "convert"}
    write_config(tmp_path, model={"dtype": "bfloat16"})
    with pytest.raises(MoepipeError, match="convert stage is not built for the config"):
        outputs(load_config(path))


def test_cli_build_quiet_prints_nothing(tmp_path):
    write_config(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "moepipe", "-q", "build"], cwd=tmp_path,
                          capture_output=True, text=True,
                          env={**os.environ, "MOEPIPE_FAULT": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_quantizing_a_checkpoint_without_tokenizer_is_refused_before_any_stage(tmp_path,
                                                                               examples):
    import shutil

    pytest.importorskip("modelopt")
    model = tmp_path / "model"
    shutil.copytree(examples["tiny-mixtral"], model)
    for f in model.glob("tokenizer*"):
        f.unlink()
    path = write_config(tmp_path, model={"path": str(model), "example": None},
                        quantize={"format": "fp8"})
    with pytest.raises(MoepipeError, match="no tokenizer files") as e:
        build(path)
    assert "save_pretrained" in e.value.hint
    assert not (tmp_path / "work" / "artifacts").exists()


def test_a_failed_link_leaves_no_temporary_link_behind(tmp_path):
    path = write_config(tmp_path)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "checkpoint").mkdir()  # a folder of the user's where the link goes
    with pytest.raises(MoepipeError, match="exists and is not a moepipe link"):
        build(path)
    assert not [p.name for p in (tmp_path / "work").iterdir() if ".link-" in p.name]
