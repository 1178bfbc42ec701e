"""The trained examples: they talk, their answers still equal transformers' token for token
after conversion, training is deterministic, and a quantization that breaks the model fails
the quality gate set from the trained model's real figures."""

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moepipe.examples import trained_examples

CONFIGS = Path(__file__).parents[2] / "configs"

PROMPT = "It is a truth universally acknowledged"


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).iterdir())}


def test_trained_mixtral_talks_and_its_conversion_matches_transformers(trained_mixtral, tmp_path):
    from moepipe.arch.hf import open_hf_checkpoint
    from moepipe.conversion.write import convert_into
    from moepipe.examples.trained import training_text
    from moepipe.mapping import Mapping
    from moepipe.validate.parity import check_parity

    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    convert_into(open_hf_checkpoint(trained_mixtral), ckpt, Mapping.create(tp=2, moe_ep=2),
                 dtype="auto")
    report = check_parity(trained_mixtral, ckpt, prompts=[PROMPT], max_new_tokens=16)
    assert report.passed, report.to_dict()
    # Readable: the answer is made of words the novel uses, not byte soup.
    from transformers import AutoTokenizer

    answer = AutoTokenizer.from_pretrained(trained_mixtral).decode(report.prompts[0].hf_tokens)
    words = re.findall(r"[A-Za-z]+", answer)
    vocabulary = set(re.findall(r"[A-Za-z]+", training_text()))
    assert len(words) >= 5 and sum(w in vocabulary for w in words) >= 0.8 * len(words), answer
    record = json.loads((trained_mixtral / "moepipe-training.json").read_text())
    assert record["loss_last"] < record["loss_first"] - 2.0  # it learnt, not just ran


@pytest.mark.parametrize("name", trained_examples())
def test_every_trained_example_converts_to_transformers_logits(name, tmp_path):
    """Each trained example's exact config (sizes, MLA widths, sliding window, ...) converts and
    matches transformers at tp2/moe_ep2 - with seeded random weights: the suite trains only the
    Mixtral above (the trained weights of every example: benchmarks/train_bench.py's parity)."""
    from moepipe.conversion.write import convert
    from moepipe.examples import write_example
    from moepipe.validate.parity import check_parity

    folder = write_example(name, tmp_path / name, untrained=True)
    convert(folder, tmp_path / "ckpt", tp=2, moe_ep=2)
    report = check_parity(folder, tmp_path / "ckpt", prompts=[PROMPT], max_new_tokens=8)
    assert report.passed, report.to_dict()


def test_training_is_deterministic(tmp_path):
    """Same example, same recipe: byte-identical files (a short recipe keeps the test fast)."""
    from moepipe.examples import EXAMPLES, train_example_into

    ex = EXAMPLES["tiny-qwen2-moe-trained"]
    recipe = dataclasses.replace(ex.recipe, steps=3)
    digests = []
    for n in range(2):
        (tmp_path / str(n)).mkdir()
        train_example_into(ex, recipe, tmp_path / str(n), lambda text: None)
        digests.append(_digests(tmp_path / str(n)))
    assert digests[0] == digests[1]
    assert "model.safetensors" in digests[0]


def _measure_and_gate(config, source, quantized):
    from moepipe.config import load_config
    from moepipe.stages.quality import check_quality, measure_quality

    cfg = load_config(config)
    measured = measure_quality(source, quantized, None)
    check_quality(cfg, measured)
    return measured


@pytest.mark.parametrize("config", ["tiny-mixtral-trained-fp8-cpu.yaml"])
def test_broken_scale_fails_the_quality_gate(trained_mixtral, tmp_path, config):
    pytest.importorskip("modelopt")
    from moepipe.stages.quality import QualityError

    data = yaml.safe_load((CONFIGS / config).read_text())
    data["workdir"] = "work"
    (tmp_path / "moepipe.yaml").write_text(yaml.safe_dump(data))
    built = subprocess.run([sys.executable, "-m", "moepipe", "build", "--until", "quantize"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    work = tmp_path / "work"
    quantized = (work / "quantized").resolve()
    # The real quantization passes the gates set from the trained model's figures ...
    good = _measure_and_gate(tmp_path / "moepipe.yaml", work / "model", quantized)
    assert good["top1_agreement"] > 0.9
    # ... one weight scale off by 4x (a broken calibration or export) does not.
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    shard = next(broken.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(k for k in sorted(tensors) if k.endswith("self_attn.o_proj.weight_scale"))
    tensors[name] = tensors[name] * 4
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(QualityError, match="misses the quality gate"):
        _measure_and_gate(tmp_path / "moepipe.yaml", work / "model", broken)
