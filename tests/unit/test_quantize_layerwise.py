"""Layer-by-layer quantization without running modelopt: the memory model behind the pre-flight
check and `moepipe plan`, the refusal of a machine that is too small, the progress line, the
quantize.device setting, and the scratch folder that lets a killed run resume."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml

from moepipe.errors import ConfigError, EnvironmentMissing, MoepipeError
from moepipe.quant.memory import quantize_memory
from moepipe.quant.scratch import ACTIVATIONS, STATE, Scratch
from moepipe.stages.quantize import progress_line, quantize_device

GIB = 1 << 30


def test_mixtral_8x7b_quantizes_in_at_most_32_gib_whatever_its_depth():
    from moepipe.planner.plan import host_memory, load_model

    mixtral = load_model("Mixtral-8x7B")
    need = host_memory(mixtral)["quantize"]
    assert need <= 32 * GIB
    # depth does not enter: twice the layers, the same peak (the whole model in float32
    # needed 384 GiB here before)
    assert host_memory(replace(mixtral, num_layers=64))["quantize"] == need
    assert need > 4 * mixtral.parameters() / mixtral.num_layers  # one float32 layer, at least


def test_memory_grows_with_the_calibration_activations():
    small = quantize_memory(10**9, 10**8, 4096, 32 * 64)
    large = quantize_memory(10**9, 10**8, 4096, 512 * 2048)
    assert large - small == 2 * 4 * 4096 * (512 * 2048 - 32 * 64)


def test_cli_plan_prints_the_quantize_figure(capsys):
    from moepipe.cli import main

    main(["plan", "Mixtral-8x7B", "--cluster", "8xH100", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert 4 * GIB < data["host_memory"]["quantize"] <= 32 * GIB


def test_too_small_a_machine_is_refused_with_the_figure_and_what_to_change(tmp_path,
                                                                           monkeypatch):
    pytest.importorskip("modelopt")
    import moepipe.commands.build
    from moepipe.commands.build import run_build

    (tmp_path / "moepipe.yaml").write_text(yaml.safe_dump(
        {"model": {"example": "tiny-mixtral"}, "workdir": "work",
         "quantize": {"format": "fp8"}}))
    monkeypatch.setattr(moepipe.commands.build, "available_memory", lambda: 64 << 20)
    with pytest.raises(MoepipeError, match=r"quantize needs about \d+\.\d GiB of host memory; "
                                           r"only 0\.1 GiB is available") as e:
        run_build(tmp_path / "moepipe.yaml", echo=lambda text: None)
    assert "quantize.calibration.samples or seq_len" in e.value.hint
    assert "one decoder layer at a time needs" in e.value.hint
    assert not list((tmp_path / "work" / "artifacts").glob("quantize-*"))


@pytest.mark.parametrize("done, ran, elapsed, says", [
    (1, 1, 2.0, "embedding, 2s elapsed, about 10s left"),
    (3, 3, 90.0, "layer 2/4, 1m30s elapsed, about 1m30s left"),
    (5, 2, 4000.0, "layer 4/4, 1h06m elapsed, about 33m20s left"),
    (6, 6, 61.0, "layer 4/4, lm_head, 1m01s elapsed, about 0s left"),
])
def test_progress_line(done, ran, elapsed, says):
    assert progress_line(done, 6, elapsed, ran) == says


def test_quantize_device_is_validated_by_the_config_model(tmp_path):
    from moepipe.config import load_config

    path = tmp_path / "moepipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"example": "tiny-mixtral"},
                                    "quantize": {"format": "fp8", "device": "tpu"}}))
    with pytest.raises(ConfigError, match="quantize.device") as e:
        load_config(path)
    assert "cuda" in str(e.value)
    path.write_text(yaml.safe_dump({"model": {"example": "tiny-mixtral"},
                                    "quantize": {"format": "fp8"}}))
    assert load_config(path).quantize.device == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(EnvironmentMissing, match="no GPU is visible") as e:
        quantize_device("cuda")
    assert "auto or cpu" in e.value.hint
    assert quantize_device("auto") == "cpu"


# -- the scratch folder ---------------------------------------------------------------------
def _run(folder, key="k", segments=3):
    """A run that finishes ``segments`` of 5 (layer outputs after each but the first)."""
    scratch = Scratch.open(folder, key, 5)
    for seg in range(scratch.done, segments):
        outputs = None if seg == 0 else [[torch.full((2, 3), float(seg))]] * 2
        scratch.finish(seg, {"table": {}, "kv": None}, {f"t{seg}": torch.ones(seg + 1)},
                       outputs)
    return scratch


def test_scratch_resumes_after_the_last_finished_segment(tmp_path):
    _run(tmp_path, segments=3)
    again = Scratch.open(tmp_path, "k", 5)
    assert again.done == 3 and [r["names"] for r in again.records] == [["t0"], ["t1"], ["t2"]]
    passes = again.activations()
    assert len(passes) == 2 and passes[0] is passes[1]  # equal passes are held once
    assert torch.equal(passes[0][0], torch.full((2, 3), 2.0))


def test_scratch_drops_half_written_files_and_starts_again_when_it_must(tmp_path):
    _run(tmp_path, segments=3)
    (tmp_path / ".segment-00003.safetensors.tmp").write_bytes(b"\0" * 10)
    (tmp_path / "segment-00003.safetensors").write_bytes(b"\1" * 10)
    assert Scratch.open(tmp_path, "k", 5).done == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ACTIVATIONS, "segment-00000.safetensors", "segment-00001.safetensors",
        "segment-00002.safetensors", STATE]
    assert Scratch.open(tmp_path, "another calibration", 5).done == 0
    assert list(tmp_path.iterdir()) == []
    _run(tmp_path, segments=3)
    (tmp_path / "segment-00001.safetensors").write_bytes(b"short")  # damaged
    assert Scratch.open(tmp_path, "k", 5).done == 0


def test_scratch_moves_finished_shards_under_transformers_names(tmp_path):
    scratch = _run(tmp_path / "scratch", segments=5)
    (tmp_path / "out").mkdir()
    weight_map = scratch.move_shards(tmp_path / "out")
    assert weight_map == {f"t{i}": f"model-{i + 1:05d}-of-00005.safetensors" for i in range(5)}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(weight_map.values())
