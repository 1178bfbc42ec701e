"""Live weight updates in the runtime: the converter's per-tensor digests say which tensors a
re-trained expert subset changed; only those are read, and the new version shares every other
tensor with the old one, which keeps answering as before."""

import json

import pytest
import torch
from retrained import retrain_experts

from moepipe.checkpoints.manifest import diff_checkpoints
from moepipe.conversion.write import convert
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.model import Batch, ReferenceModel
from moepipe.runtime.update import IncompatibleUpdate, load_update, storages

LAYER0 = {"transformer.layers.0.mlp.fc.weight", "transformer.layers.0.mlp.proj.weight"}


@pytest.fixture(scope="module")
def builds(examples, tmp_path_factory):
    """(old, new) converted checkpoints at tp=2, moe_ep=2: expert 1 of layer 0 re-trained."""
    root = tmp_path_factory.mktemp("live")
    src = examples["tiny-mixtral"]
    new_src = retrain_experts(src, root / "retrained", layer=0, experts=(1,))
    old, new = root / "old", root / "new"
    convert(src, old, tp=2, moe_ep=2)
    convert(new_src, new, tp=2, moe_ep=2)
    return old, new


def test_tensor_digests_name_exactly_the_retrained_experts(builds):
    old, new = builds
    manifest = json.loads((new / "moepipe-manifest.json").read_text())
    assert set(manifest["tensors"]["blake3"]) == {"rank0.safetensors", "rank1.safetensors"}
    diff = diff_checkpoints(old, new, world_size=2)
    # moe_ep=2: experts 0-3 live on rank 0, so expert 1's fc and proj changed there only
    assert set(diff.ranks[0].changed) == LAYER0
    assert diff.ranks[1].changed == [] and not diff.config_changed
    assert diff.changed_tensors == 2 and diff.total_tensors > 20
    same = diff_checkpoints(old, old, world_size=2)
    assert same.nothing


def test_a_manifest_without_tensor_digests_reads_whole_changed_files(builds, tmp_path):
    import shutil

    old, new = builds
    legacy = tmp_path / "legacy"
    shutil.copytree(new, legacy)
    manifest = json.loads((legacy / "moepipe-manifest.json").read_text())
    del manifest["tensors"]  # as an older moepipe wrote it
    (legacy / "moepipe-manifest.json").write_text(json.dumps(manifest))
    diff = diff_checkpoints(old, legacy, world_size=2)
    assert diff.ranks[0].by_file and len(diff.ranks[0].changed) > 2  # the whole rank file
    assert diff.ranks[1].changed == []  # its file digest did not change


def _logits(model, tokens):
    return model.forward(Batch.single(tokens))


def test_update_reads_and_holds_only_what_changed(builds):
    old_dir, new_dir = builds
    tokens = [1, 5, 9, 2, 7]
    current = ReferenceModel(load_checkpoint(old_dir))
    before = _logits(current, tokens)
    update = load_update(current, new_dir)
    fresh = ReferenceModel(load_checkpoint(new_dir))
    # the new version computes exactly what a fresh load of the new build computes
    assert torch.equal(_logits(update.model, tokens), _logits(fresh, tokens))
    assert not torch.equal(_logits(fresh, tokens), before)
    # and the old one still what it did
    assert torch.equal(_logits(current, tokens), before)
    ckpt = update.model.ckpt.ranks
    assert update.read_bytes == sum(ckpt[0][n].nbytes for n in LAYER0)
    # extra memory: the two changed tensors and the transposed copy made from one of them
    rank0 = update.model.layers[0].ranks[0]
    assert update.extra_bytes == update.read_bytes + rank0.proj_flat.nbytes
    assert update.extra_bytes < 0.1 * sum(storages(current).values())
    # everything else is the previous version's own tensor
    assert update.model.layers[1].ranks[0].fc is current.layers[1].ranks[0].fc
    assert update.model.embedding is current.embedding
    assert update.model.expert_tokens is current.expert_tokens


def test_another_mapping_is_not_an_update(builds, examples, tmp_path):
    old_dir, _ = builds
    other = tmp_path / "tp1"
    convert(examples["tiny-mixtral"], other)
    with pytest.raises(IncompatibleUpdate, match="mapping"):
        load_update(ReferenceModel(load_checkpoint(old_dir)), other)
