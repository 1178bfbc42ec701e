"""Live weight updates in the runtime: the converter's per-tensor digests say which tensors a
re-trained expert subset changed; only those are read, and the new version shares every other
tensor with the old one, which keeps answering as before; in the engine each request runs on
one version from its admission to its end."""

import json
import threading
import time

import pytest
import torch

from moepipe.checkpoints.manifest import diff_checkpoints
from moepipe.conversion.write import convert
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.generate import generate
from moepipe.runtime.model import Batch, ReferenceModel
from moepipe.runtime.update import IncompatibleUpdate, load_update, storages
from moepipe.serving.batcher import Batcher
from moepipe.serving.request import GenerationRequest, RequestError

LAYER0 = {"transformer.layers.0.mlp.fc.weight", "transformer.layers.0.mlp.proj.weight"}


@pytest.fixture(scope="module")
def builds(live_builds):
    """(old, new) converted checkpoints at tp=2, moe_ep=2: expert 1 of layer 0 re-trained."""
    return live_builds["old-ep"], live_builds["new-ep"]


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


class Sink:
    def __init__(self):
        self.tokens, self.error = [], None
        self.done = threading.Event()

    def on_tokens(self, tokens, log_probs, final):
        self.tokens += tokens
        if final:
            self.done.set()

    def on_error(self, message):
        self.error = message
        self.done.set()


def _submit(engine, prompt, n, version=None):
    sink = Sink()
    engine.submit(GenerationRequest(prompt=prompt, max_new_tokens=n, streaming=True,
                                    weights_version=version, on_tokens=sink.on_tokens,
                                    on_error=sink.on_error))
    return sink


PROMPTS = [[1, 5, 9, 2, 7], [30, 31, 2, 8], [11, 3, 250, 4, 4, 9]]


def test_each_request_runs_on_one_version_from_admission_to_end(builds):
    old_dir, new_dir = builds
    current = ReferenceModel(load_checkpoint(old_dir))
    update = load_update(current, new_dir)
    n = 40
    want_old = generate(current, PROMPTS, n)
    want_new = generate(update.model, PROMPTS, n)
    assert want_old != want_new  # the re-trained expert changes what is generated
    engine = Batcher(current, max_batch_size=6, max_seq_len=64, version="old")
    engine.start()
    try:
        before = [_submit(engine, p, n) for p in PROMPTS]  # admitted on the old version
        while not all(s.tokens for s in before):
            time.sleep(0.005)
        engine.versions.stage("new", update.model)
        checking = [_submit(engine, p, n, version="new") for p in PROMPTS]  # validation
        switch = engine.versions.switch("new")
        engine.wake()
        assert switch.done.wait(10)
        # the old version is held by the requests admitted before the switch
        assert engine.versions.describe() == {"version": "new", "staged": [], "held": ["old"]}
        after = [_submit(engine, p, n) for p in PROMPTS]
        for s in before + checking + after:
            assert s.done.wait(30) and s.error is None
        assert [s.tokens for s in before] == want_old
        assert [s.tokens for s in checking] == want_new
        assert [s.tokens for s in after] == want_new
        assert engine.versions.wait_released("old", 10)
        assert engine.versions.describe()["held"] == []
        with pytest.raises(RequestError, match="'old' is not loaded"):
            _submit(engine, PROMPTS[0], 2, version="old")
    finally:
        engine.stop()
