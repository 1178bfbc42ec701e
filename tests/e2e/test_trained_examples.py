"""The trained examples: they talk, their answers still equal transformers' token for token
after conversion, and training is deterministic."""

import dataclasses
import hashlib
import json
import re
from pathlib import Path

PROMPT = "It is a truth universally acknowledged"


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).iterdir())}


def test_trained_mixtral_talks_and_its_conversion_matches_transformers(trained_mixtral, tmp_path):
    from moepipe.arch.hf import open_hf_checkpoint
    from moepipe.examples.trained import training_text
    from moepipe.stages.convert import convert_into
    from moepipe.trtllm.mapping import Mapping
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
    assert len(words) >= 5 and sum(w in vocabulary for w in words) >= 0.9 * len(words), answer
    record = json.loads((trained_mixtral / "moepipe-training.json").read_text())
    assert record["loss_last"] < record["loss_first"] - 2.0  # it learnt, not just ran


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
