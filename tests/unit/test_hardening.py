"""Every user mistake is one line and exit 2 (issue 9, cases 9-13): CLI usage errors, disks that
are full, read-only or in the way, configs that are not UTF-8 or repeat a key, lax ints and
bools, headers that relabel a dtype, pickle checkpoints handed to parity, index files that point
outside the checkpoint, Ctrl-C; and reused build outputs that changed since they were built."""

import errno
import json
import os
import shutil
import struct

import pytest
import yaml

from moepipe.cli import main
from moepipe.errors import CheckpointError, ConfigError, MoepipeError


def run_cli(capsys, *argv):
    """(exit code, stderr) of ``moepipe argv`` run in this process."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    return exc.value.code, capsys.readouterr().err


def one_line_error(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, says", [
    (["build", "--bogus"], "No such option: --bogus"),
    (["biuld"], "No such command 'biuld'"),
    (["init", "--example", "tiny-mixtral", "--tp", "abc"], "Invalid value for '--tp'"),
    (["convert", "--model"], "Option '--model' requires an argument"),
])
def test_cli_usage_errors_are_one_line_exit_2(capsys, argv, says):
    code, err = run_cli(capsys, *argv)
    assert code == 2
    assert says in one_line_error(err) and "--help" in err


def write_config(folder, **sections):
    data = {"model": {"example": "tiny-mixtral"}, "workdir": "work"}
    data.update(sections)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "moepipe.yaml").write_text(yaml.safe_dump(data))
    return folder / "moepipe.yaml"


def test_workdir_that_is_a_file(tmp_path, capsys):
    path = write_config(tmp_path, workdir="taken")
    (tmp_path / "taken").write_text("not a folder")
    code, err = run_cli(capsys, "build", "-c", path)
    assert code == 2 and "exists and is not a directory" in one_line_error(err)


def test_read_only_workdir(tmp_path, capsys, monkeypatch):
    path = write_config(tmp_path)

    def read_only(*a, **k):  # what mkdir on a read-only mount raises (root ignores chmod)
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "work"))

    monkeypatch.setattr(os, "mkdir", read_only)
    code, err = run_cli(capsys, "build", "-c", path)
    line = one_line_error(err)
    assert code == 2 and "read-only file system" in line and "workdir" in line


def test_full_disk_is_refused_before_converting_with_what_is_needed(tmp_path, capsys,
                                                                     monkeypatch):
    import moepipe.utils.oserrors as oserrors

    path = write_config(tmp_path)
    run_cli_ok = main(["-q", "build", "-c", str(path), "--until", "inspect"])
    assert run_cli_ok is None
    monkeypatch.setattr(oserrors, "free_bytes", lambda p: 1000)
    code, err = run_cli(capsys, "build", "-c", path)
    line = one_line_error(err)
    assert code == 2 and "the convert stage needs about" in line
    assert str(tmp_path / "work" / "artifacts") in line and "1000" not in line
    assert not (tmp_path / "work" / "checkpoint").exists()


def test_disk_that_fills_up_while_converting(tmp_path, capsys, monkeypatch):
    import moepipe.stages.convert as convert

    path = write_config(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(convert, "convert_into", full)
    code, err = run_cli(capsys, "build", "-c", path)
    line = one_line_error(err)
    assert code == 2 and "no space left on device" in line and "needs about" in line
    assert not [p for p in (tmp_path / "work" / "artifacts").iterdir()
                if p.name.startswith("convert") or ".partial-" in p.name]


def test_config_that_is_not_utf8(tmp_path, capsys):
    path = write_config(tmp_path)
    path.write_bytes(path.read_bytes() + b"# caf\xe9\n")
    code, err = run_cli(capsys, "build", "--dry-run", "-c", path)
    lines = path.read_bytes().count(b"\n")
    assert code == 2 and f"moepipe.yaml:{lines}: not UTF-8" in one_line_error(err)


def test_duplicated_key_names_both_lines(tmp_path):
    from moepipe.config import load_config

    path = tmp_path / "moepipe.yaml"
    path.write_text("model:\n  example: tiny-mixtral\nparallel:\n  tp: 2\n  tp: 1\n")
    with pytest.raises(ConfigError, match=r"moepipe.yaml:5: key 'tp' is given twice "
                                          r"\(first on line 4, again on line 5\)"):
        load_config(path)


@pytest.mark.parametrize("section, key, value, says", [
    ("parallel", "tp", True, "expected an integer"),
    ("parallel", "tp", "2", "expected an integer"),
    ("parallel", "tp", 2.0, "expected an integer"),
    ("deploy", "decoupled", 1, "expected true or false"),
    ("deploy", "decoupled", "yes", "expected true or false"),
])
def test_ints_and_bools_are_strict(tmp_path, section, key, value, says):
    from moepipe.config import load_config

    path = write_config(tmp_path, **{section: {key: value}})
    with pytest.raises(ConfigError, match=f"{section}.{key}: {says}"):
        load_config(path)


def test_integers_still_fill_float_fields(tmp_path):
    from moepipe.config import load_config

    cfg = load_config(write_config(tmp_path, build={"gpu_memory_gb": 80}))
    assert cfg.build.gpu_memory_gb == 80.0


@pytest.fixture
def model(examples, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(examples["tiny-mixtral"], dst)
    return dst


def test_dtype_relabelled_at_the_same_size_is_caught_while_planning(model, tmp_path,
                                                                    monkeypatch):
    from moepipe.checkpoints.writer import SafetensorsWriter
    from moepipe.conversion.write import convert

    f = model / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = "model.layers.0.self_attn.q_proj.weight"
    header[name]["dtype"] = "I32"  # same 4 bytes per element: sizes still agree
    data[8:8 + n] = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    f.write_bytes(bytes(data))
    opened = []
    monkeypatch.setattr(SafetensorsWriter, "__init__",
                        lambda *a, **k: opened.append(1) or pytest.fail("wrote output"))
    with pytest.raises(CheckpointError, match=f"'{name}' is stored as I32"):
        convert(model, tmp_path / "out")
    assert not opened and not (tmp_path / "out").exists()


def test_index_shard_outside_the_folder_says_so(model, tmp_path):
    from moepipe.checkpoints.reader import CheckpointReader

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(model / "model.safetensors", outside / "model.safetensors")
    with CheckpointReader(outside) as r:
        names = list(r.tensors)
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "../elsewhere/model.safetensors" for n in names}}))
    with pytest.raises(CheckpointError, match="'../elsewhere/model.safetensors' points "
                                              "outside the checkpoint folder"):
        CheckpointReader(model)


def test_parity_refuses_pickle_checkpoints_before_loading(model, tmp_path, monkeypatch):
    import torch

    from moepipe.validate.parity import check_parity

    (model / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, model / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("unpickled the checkpoint"))
    with pytest.raises(CheckpointError, match="no pickle"):
        check_parity(model, tmp_path / "ckpt")


# -- case 9: reused outputs are what the build recorded ---------------------------------------
def test_deleted_rank_file_is_rebuilt_not_reused(tmp_path):
    from moepipe.commands.build import run_build

    path = write_config(tmp_path, parallel={"tp": 2, "moe_ep": 2})
    run_build(path, echo=lambda s: None)
    ckpt = tmp_path / "work" / "checkpoint"
    rank1 = (ckpt / "rank1.safetensors").read_bytes()
    (ckpt / "rank1.safetensors").unlink()
    lines = []
    manifest = run_build(path, echo=lines.append)
    status = {s["stage"]: s["status"] for s in manifest["stages"]}
    assert status["convert"] == "built"
    assert any("rank1.safetensors is missing" in line for line in lines)
    assert (ckpt / "rank1.safetensors").read_bytes() == rank1


def test_flipped_byte_is_refused_by_deploy_and_rebuilt_by_build(tmp_path):
    from moepipe.commands.build import outputs, run_build
    from moepipe.config import load_config

    path = write_config(tmp_path)
    run_build(path, echo=lambda s: None)
    cfg = load_config(path)
    rank0 = tmp_path / "work" / "checkpoint" / "rank0.safetensors"
    good = rank0.read_bytes()
    with open(rank0, "r+b") as f:  # same size, one byte flipped
        f.seek(len(good) // 2)
        f.write(bytes([good[len(good) // 2] ^ 1]))
    with pytest.raises(MoepipeError, match="rank0.safetensors was modified"):
        outputs(cfg)  # what deploy reads before serving
    manifest = run_build(path, echo=lambda s: None)
    assert {s["stage"]: s["status"] for s in manifest["stages"]}["convert"] == "built"
    assert rank0.read_bytes() == good


def test_untouched_outputs_are_not_hashed_again(tmp_path, monkeypatch):
    import moepipe.checkpoints.digest as digest
    import moepipe.checkpoints.hashcache as hashcache
    from moepipe.commands.build import run_build

    path = write_config(tmp_path)
    run_build(path, echo=lambda s: None)
    monkeypatch.setattr(digest, "file_digest", lambda p, a=None: pytest.fail(f"hashed {p}"))
    monkeypatch.setattr(hashcache, "_hash_file", lambda p: pytest.fail(f"hashed {p}"))
    manifest = run_build(path, echo=lambda s: None)
    assert {s["status"] for s in manifest["stages"]} == {"reused"}


def test_the_convert_disk_estimate_reads_the_checkpoint_once(tmp_path, examples, monkeypatch):
    """The pre-flight disk estimate of the convert stage (the source's weights, scaled to the
    output dtype) opens the source checkpoint once, however many facts it needs of it."""
    from moepipe.arch.hf import open_hf_checkpoint
    from moepipe.config import parse_config
    from moepipe.stages import convert
    from moepipe.stages.base import BuildContext
    from moepipe.stages.source import STAGE as SOURCE

    opened = []
    monkeypatch.setattr(convert, "open_hf_checkpoint",
                        lambda path: opened.append(path) or open_hf_checkpoint(path))
    model = examples["tiny-mixtral"]
    cfg = parse_config({"model": {"path": str(model), "dtype": "float16"},
                        "workdir": str(tmp_path / "work")})
    ctx = BuildContext(cfg, echo=lambda text: None)
    ctx.add(SOURCE, model)
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    source_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}[
        open_hf_checkpoint(model).spec.torch_dtype]
    assert convert.STAGE.disk(ctx) == int(weights * 2 / source_bytes * 1.05) + (1 << 20)
    assert opened == [model]
