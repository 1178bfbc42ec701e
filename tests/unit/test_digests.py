"""Converted files are hashed once, as their bytes are written: the build finds their BLAKE3
in the hash cache, also after the output folder is renamed into place."""

import os

import blake3
import pytest

from moepipe.checkpoints import hashcache
from moepipe.checkpoints.digest import file_digest
from moepipe.conversion.write import convert


def _b3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def test_converter_outputs_need_no_second_read(examples, tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    convert(examples["tiny-mixtral"], out, tp=2, moe_ep=2)
    moved = tmp_path / "moved"
    os.rename(out, moved)  # as the build renames a finished stage output into place

    def no_read(path, *a, **k):
        raise AssertionError(f"{path} was read again to hash it")

    monkeypatch.setattr(hashcache, "_hash_file", no_read)
    for rank in range(2):
        path = moved / f"rank{rank}.safetensors"
        assert hashcache.cached_digest(path) == _b3(path.read_bytes())


def test_a_changed_file_is_hashed_again(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    hashcache.remember(path, "0" * 64)
    assert hashcache.cached_digest(path) == "0" * 64
    path.write_bytes(b"abcd")  # size (and mtime) change: the record no longer applies
    assert hashcache.cached_digest(path) == _b3(b"abcd")


def test_file_digests_are_blake3_or_named_sha256(tmp_path):
    import hashlib

    path = tmp_path / "f.bin"
    data = os.urandom(3 << 20 | 5)  # several read blocks and a partial one
    path.write_bytes(data)
    assert file_digest(path) == _b3(data)
    assert file_digest(path, "sha256") == hashlib.sha256(data).hexdigest()
    with pytest.raises(ValueError, match="md5"):
        file_digest(path, "md5")


@pytest.mark.parametrize("name", ["config.json", "moepipe-manifest.json"])
def test_small_files_are_still_hashed_on_demand(examples, tmp_path, name):
    out = tmp_path / "ckpt"
    convert(examples["tiny-mixtral"], out)
    data = (out / name).read_bytes()
    assert hashcache.cached_digest(out / name) == _b3(data)


def test_stage_records_of_older_versions_are_checked_with_sha256(tmp_path):
    """A record written before BLAKE3 names sha256: reuse still verifies a moved file by it."""
    import hashlib

    from moepipe.stages.integrity import changed_output, recorded_digests, write_stage_record

    out = tmp_path / "out"
    out.mkdir()
    (out / "w.bin").write_bytes(b"weights")
    write_stage_record(out, "convert", "f" * 64, {})
    assert recorded_digests(out) == {"w.bin": _b3(b"weights")}
    old = {"files": {"w.bin": {"size": 7, "mtime_ns": 1,  # mtime moved: the digest decides
                               "sha256": hashlib.sha256(b"weights").hexdigest()}}}
    assert changed_output(out, old) is None
    (out / "w.bin").write_bytes(b"weightz")
    assert "its sha256 digest differs" in changed_output(out, old)
    new = {"files": {"w.bin": {"size": 7, "mtime_ns": 1, "blake3": _b3(b"weights")}}}
    assert "its blake3 digest differs" in changed_output(out, new)


def test_digests_of_any_range_and_block_size(tmp_path, monkeypatch):
    """Files are hashed in reused blocks; any block size and any start give the digest of
    exactly those bytes, and an empty file has the digest of nothing."""
    from moepipe.checkpoints import digest

    path = tmp_path / "f.bin"
    data = os.urandom(5 * 4096 + 77)
    path.write_bytes(data)
    monkeypatch.setattr(digest, "BLOCK", 3 * 4096)
    assert file_digest(path) == _b3(data)
    for start in (0, 1, 4096 + 5, len(data) - 3, len(data)):
        h = blake3.blake3()
        fd = os.open(path, os.O_RDONLY)
        try:
            digest.update_from_fd(h, fd, start, len(data), bytearray(1000))
        finally:
            os.close(fd)
        assert h.hexdigest() == _b3(data[start:])
    (tmp_path / "empty").write_bytes(b"")
    assert file_digest(tmp_path / "empty") == _b3(b"")
    with pytest.raises(OSError, match="ended"):  # a file shorter than promised is an error
        fd = os.open(path, os.O_RDONLY)
        try:
            digest.update_from_fd(blake3.blake3(), fd, 0, len(data) + 1)
        finally:
            os.close(fd)
