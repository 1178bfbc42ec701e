"""Converted files are hashed once, as their bytes are written: the build finds their sha256
in the hash cache, also after the output folder is renamed into place."""

import hashlib
import os

import pytest

from moepipe.checkpoints import hashcache
from moepipe.stages.convert import convert


def test_converter_outputs_need_no_second_read(examples, tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    convert(examples["tiny-mixtral"], out, tp=2, moe_ep=2)
    moved = tmp_path / "moved"
    os.rename(out, moved)  # as the build renames a finished stage output into place

    def no_read(path, *a, **k):
        raise AssertionError(f"{path} was read again to hash it")

    monkeypatch.setattr(hashcache, "sha256_file", no_read)
    for rank in range(2):
        path = moved / f"rank{rank}.safetensors"
        assert hashcache.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_changed_file_is_hashed_again(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    hashcache.remember(path, "0" * 64)
    assert hashcache.file_sha256(path) == "0" * 64
    path.write_bytes(b"abcd")  # size (and mtime) change: the record no longer applies
    assert hashcache.file_sha256(path) == hashlib.sha256(b"abcd").hexdigest()


@pytest.mark.parametrize("name", ["config.json", "moepipe-manifest.json"])
def test_small_files_are_still_hashed_on_demand(examples, tmp_path, name):
    out = tmp_path / "ckpt"
    convert(examples["tiny-mixtral"], out)
    data = (out / name).read_bytes()
    assert hashcache.file_sha256(out / name) == hashlib.sha256(data).hexdigest()
