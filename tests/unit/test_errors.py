"""Bad input gets a clear error and leaves nothing behind."""

import json
import shutil
import struct

import pytest

from moepipe.conversion.write import convert
from moepipe.errors import CheckpointError, MappingError, MoepipeError, UnsupportedError


@pytest.fixture
def model(examples, tmp_path):
    """A private copy of tiny-mixtral that a test may damage."""
    dst = tmp_path / "model"
    shutil.copytree(examples["tiny-mixtral"], dst)
    return dst


def _assert_clean(tmp_path, out):
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "partial output left"


def _convert_fails(model, tmp_path, exc, match, **kw):
    out = tmp_path / "out"
    with pytest.raises(exc, match=match):
        convert(model, out, **kw)
    _assert_clean(tmp_path, out)


def test_missing_directory(tmp_path):
    _convert_fails(tmp_path / "nope", tmp_path, CheckpointError, "no such directory")


def test_no_safetensors_only_pickle(model, tmp_path):
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    _convert_fails(model, tmp_path, CheckpointError, "no \\*.safetensors")


def test_truncated_shard(model, tmp_path):
    f = model / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    _convert_fails(model, tmp_path, CheckpointError, "truncated")


def test_header_that_lies(model, tmp_path):
    f = model / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = "model.layers.0.self_attn.q_proj.weight"
    header[name]["shape"] = [64, 32]  # offsets still span 64x64 floats
    blob = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(blob) == n
    data[8:8 + n] = blob
    f.write_bytes(bytes(data))
    _convert_fails(model, tmp_path, CheckpointError, "header lies")


def test_garbage_header(model, tmp_path):
    f = model / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"not json at!"
    f.write_bytes(bytes(data))
    _convert_fails(model, tmp_path, CheckpointError, "not valid JSON")


def test_missing_shard_named_by_index(model, tmp_path):
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    _convert_fails(model, tmp_path, CheckpointError, "model-00002-of-00002.safetensors")


def test_missing_tensor(model, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, model / "model.safetensors")
    _convert_fails(model, tmp_path, CheckpointError, "experts.5.w3.weight")


def test_unmapped_tensor_is_not_dropped_silently(model, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, model / "model.safetensors")
    _convert_fails(model, tmp_path, CheckpointError, "no mapping.*mystery")


def test_config_disagrees_with_weights(model, tmp_path):
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (model / "config.json").write_text(json.dumps(cfg))
    _convert_fails(model, tmp_path, CheckpointError, "shape .* config.json implies")


def test_unsupported_architecture_lists_supported(model, tmp_path):
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["MixtralForSequenceClassification"]
    (model / "config.json").write_text(json.dumps(cfg))
    _convert_fails(model, tmp_path, UnsupportedError,
                   "MixtralForSequenceClassification.*Qwen3MoeForCausalLM")


@pytest.mark.parametrize("kw,match", [
    (dict(tp=2, moe_ep=3), "does not divide"),
    (dict(tp=8, moe_ep=8), "num_attention_heads 4 is not divisible by tp=8"),
    (dict(pp=8), "exceeds the number of layers"),
    (dict(tp=2, moe_tp=2, moe_ep=2), "!= tp=2"),
])
def test_impossible_mappings(model, tmp_path, kw, match):
    _convert_fails(model, tmp_path, MappingError, match, **kw)


def test_experts_not_divisible(model, tmp_path, examples):
    _convert_fails(examples["tiny-mixtral"], tmp_path, MappingError,
                   "num_experts 8 is not divisible by moe_ep=16", tp=16, moe_ep=16)


def test_existing_output_kept_without_overwrite(examples, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(MoepipeError, match="already exists"):
        convert(examples["tiny-mixtral"], out)
    assert (out / "keep.txt").read_text() == "mine"
    convert(examples["tiny-mixtral"], out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "rank0.safetensors").exists()


def test_bad_dtype(examples, tmp_path):
    _convert_fails(examples["tiny-mixtral"], tmp_path, MoepipeError, "dtype 'int8'",
                   dtype="int8")
