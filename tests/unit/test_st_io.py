"""The streaming safetensors reader/writer against the reference library."""

import itertools
import os
import subprocess
import sys

import blake3
import pytest
import torch
from safetensors.torch import load_file, save_file

from moepipe.checkpoints.dtypes import BF16, F32
from moepipe.checkpoints.reader import CheckpointReader
from moepipe.checkpoints.writer import SafetensorsWriter


def test_slices_read_only_what_they_need(tmp_path):
    t = {"a": torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8),
         "b": torch.randn(10, 3).to(torch.bfloat16), "c": torch.randn(5)}
    save_file(t, tmp_path / "m.safetensors")
    with CheckpointReader(tmp_path) as r:
        for i in range(4):
            for j, k in itertools.product([slice(None), slice(1, 4)], repeat=2):
                assert torch.equal(r.read("a", (i, j, k)), t["a"][i, j, k])
                assert torch.equal(r.read("a", (slice(1, 3), j, k)), t["a"][1:3, j, k])
        assert torch.equal(r.read("b", (slice(None), slice(1, 2))), t["b"][:, 1:2])
        assert torch.equal(r.read("c"), t["c"])


def test_writer_streams_chunks_into_a_standard_file(tmp_path):
    x, y = torch.randn(4, 6, 8), torch.randn(2, 3).to(torch.bfloat16)
    w = SafetensorsWriter(tmp_path / "o.safetensors",
                          [("x", F32, (4, 6, 8)), ("y", BF16, (2, 3))])
    w.write(x[:1])
    w.write(x[1:])
    w.write(y.float())  # cast to the declared dtype
    digest = w.close()
    out = load_file(tmp_path / "o.safetensors")
    assert torch.equal(out["x"], x) and torch.equal(out["y"], y)
    import blake3

    assert digest == blake3.blake3((tmp_path / "o.safetensors").read_bytes()).hexdigest()


def test_dtype_conversion_matches_torch_bit_for_bit():
    import numpy as np

    from moepipe.checkpoints.casts import convert_bytes
    from moepipe.checkpoints.dtypes import F16

    x = torch.cat([torch.randn(20000) * 10, torch.tensor(
        [float("inf"), -float("inf"), 0.0, -0.0, 1.00390625, 1.01171875, 3.4e38, 1e-40, 7e4])])
    kinds = [(torch.float32, F32), (torch.float16, F16), (torch.bfloat16, BF16)]
    for s_t, s_d in kinds:
        src = x.to(s_t).contiguous()
        for d_t, d_d in kinds:
            got = bytes(convert_bytes(memoryview(src.view(torch.uint8).numpy()), s_d, d_d))
            assert got == src.to(d_t).view(torch.uint8).numpy().tobytes(), (s_d, d_d)
    nan = torch.tensor([float("nan")] * 4)
    out = np.frombuffer(bytes(convert_bytes(memoryview(nan.view(torch.uint8).numpy()), F32,
                                            BF16)), np.uint16)
    assert torch.isnan(torch.from_numpy(out.copy()).view(torch.bfloat16).float()).all()


def test_bf16_to_f32_is_exact_for_every_bit_pattern_with_and_without_numpy():
    """Every bfloat16 bit pattern (NaNs and infinities included) widens to the float32 torch
    gives, both on the small-cast path that needs no numpy and on the numpy path."""
    from moepipe.checkpoints import casts

    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).repeat(3)
    want = bits.view(torch.bfloat16).float().view(torch.uint8).numpy().tobytes()
    raw = memoryview(bits.view(torch.uint8).numpy())
    assert raw.nbytes > casts._SMALL_CAST  # the whole table at once: numpy
    assert bytes(casts.convert_bytes(raw, BF16, F32)) == want
    step = 4096
    small = b"".join(bytes(casts.convert_bytes(raw[i:i + step], BF16, F32))
                     for i in range(0, raw.nbytes, step))
    assert small == want


def test_a_small_bf16_cast_does_not_import_numpy():
    """A conversion that only copies bytes and widens a bf16 router starts without numpy."""
    code = ("import sys; from moepipe.checkpoints.dtypes import BF16, F32; from moepipe.checkpoints.casts import convert_bytes; "
            "out = convert_bytes(memoryview(bytes(range(256)) * 64), BF16, F32); "
            "assert len(out) == 32768; print('numpy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("kernel_copies", [True, False])
def test_copied_ranges_give_the_same_file_and_digest(tmp_path, monkeypatch, kernel_copies):
    """Bytes copied from a source file by the kernel (copy_file_range), or written from the
    buffer where the kernel cannot copy (another filesystem, an old kernel), give the same
    file and digest as writing them."""
    src = tmp_path / "src.bin"
    payload = os.urandom(3 * 4096 + 12)
    src.write_bytes(b"junk" + payload)
    if not kernel_copies:
        def refuse(*a, **k):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    entries = [("a", F32, (1024,)), ("b", F32, (2051,))]
    copied, written = tmp_path / "c.safetensors", tmp_path / "w.safetensors"
    w = SafetensorsWriter(copied, entries)
    fd = os.open(src, os.O_RDONLY)
    try:
        w.copy_range(fd, 4, 4096)
        w.copy_range(fd, 4 + 4096, len(payload) - 4096)
    finally:
        os.close(fd)
    digest = w.close()
    w = SafetensorsWriter(written, entries)
    w.write_bytes(memoryview(payload)[:4096])
    w.write_bytes(memoryview(payload)[4096:])
    assert w.close() == digest == blake3.blake3(copied.read_bytes()).hexdigest()
    assert copied.read_bytes() == written.read_bytes()


def test_writer_hashes_what_it_wrote_even_far_behind(tmp_path, monkeypatch):
    """The digest is of the file as written (hashed from the file, behind the writer); a
    writer far ahead of its hasher waits for it, and the digest is still right."""
    from moepipe.checkpoints import writer

    monkeypatch.setattr(writer, "_HASH_LAG", 1000)
    payload = os.urandom(64 * 1000 + 4)
    src = tmp_path / "src.bin"
    src.write_bytes(payload)
    w = SafetensorsWriter(tmp_path / "o.safetensors", [("a", F32, (len(payload) // 4,))])
    fd = os.open(src, os.O_RDONLY)
    try:
        for i in range(0, len(payload) - 4, 4000):
            (w.copy_range(fd, i, 4000) if i % 8000 else
             w.write_bytes(memoryview(payload)[i:i + 4000]))
        w.write_bytes(memoryview(payload)[-4:])
    finally:
        os.close(fd)
    digest = w.close()
    assert digest == blake3.blake3((tmp_path / "o.safetensors").read_bytes()).hexdigest()
    assert load_file(tmp_path / "o.safetensors")["a"].numpy().tobytes() == payload


def test_a_failing_digest_fails_the_write(tmp_path, monkeypatch):
    """An error while hashing (a file gone bad under the writer) is raised by the writer, not
    lost on its thread: no digest is returned for a file that was not hashed."""
    from moepipe.checkpoints import digest

    def broken(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(digest, "update_from_fd", broken)
    w = SafetensorsWriter(tmp_path / "o.safetensors", [("a", F32, (4,))])
    with pytest.raises(OSError, match="Input/output error"):
        w.write_bytes(memoryview(bytes(16)))
        w.close()


@pytest.mark.parametrize("outcome", ["reserved", "unsupported", "disk full"])
def test_output_space_is_reserved_up_front(tmp_path, monkeypatch, outcome):
    """The writer reserves the file's final size before writing (a full disk fails at once);
    where the filesystem cannot, the file simply grows; the bytes are the same either way."""
    import ctypes
    import errno

    from moepipe.checkpoints import writer

    x = torch.randn(64, 33)
    if outcome != "reserved":
        def refuse(fd, mode, offset, nbytes):
            ctypes.set_errno(errno.EOPNOTSUPP if outcome == "unsupported" else errno.ENOSPC)
            return -1
        monkeypatch.setattr(writer, "_fallocate", refuse)
    path = tmp_path / "o.safetensors"
    if outcome == "disk full":
        with pytest.raises(OSError) as e:
            SafetensorsWriter(path, [("x", F32, (64, 33))])
        assert e.value.errno == errno.ENOSPC
        return
    w = SafetensorsWriter(path, [("x", F32, (64, 33))])
    size = path.stat().st_size
    w.write(x)
    digest = w.close()
    final = path.stat().st_size
    assert size == final if outcome == "reserved" else size < final
    assert torch.equal(load_file(path)["x"], x)
    assert digest == blake3.blake3(path.read_bytes()).hexdigest()
