"""The command line as users drive it: real processes, exit codes, one-line errors."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from moepipe.config import load_config


def moepipe(*args, cwd=None, check=False):
    proc = subprocess.run([sys.executable, "-m", "moepipe", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if check and proc.returncode:
        raise AssertionError(proc.stderr)
    return proc


def test_help_works_and_imports_nothing_heavy():  # its speed: benchmarks/cli_bench.py
    proc = moepipe("--help")
    assert proc.returncode == 0 and "convert" in proc.stdout and "inspect" in proc.stdout
    code = ("import sys, moepipe.cli; "
            "print(sorted(m for m in ('torch','transformers','tritonclient') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_example_is_byte_identical_across_processes(tmp_path):
    moepipe("example", "tiny-qwen2-moe", "--out", tmp_path / "a", check=True)
    moepipe("example", "tiny-qwen2-moe", "--out", tmp_path / "b", check=True)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_example_loads_offline_with_transformers(examples):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for path in examples.values():
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok("Call me Ishmael.").input_ids
        assert tok.decode(ids) == "Call me Ishmael."
        model = AutoModelForCausalLM.from_pretrained(path)
        assert model.config.vocab_size >= len(tok)


def test_inspect_json(examples):
    proc = moepipe("inspect", examples["tiny-qwen2-moe"], "--json", check=True)
    data = json.loads(proc.stdout)
    assert data["architecture"] == "Qwen2MoeForCausalLM"
    assert data["experts"] == 8 and data["top_k"] == 2
    assert data["shared_expert_intermediate_size"] == 64
    total, active = data["parameters"]["total"], data["parameters"]["active_per_token"]
    assert total - active == 4 * (8 - 2) * 3 * 32 * 64
    assert data["bytes_total"] == total * 4
    maps = {(m["tp"], m["pp"], m["moe_tp"], m["moe_ep"]) for m in data["legal_mappings"]}
    assert (4, 1, 2, 2) in maps and (4, 2, 1, 4) in maps
    assert not any(m["tp"] == 8 for m in data["legal_mappings"])  # 4 heads


def test_inspect_human_output(examples):
    out = moepipe("inspect", examples["tiny-mixtral"], check=True).stdout
    assert "MixtralForCausalLM" in out and "legal mappings" in out and "active per token" in out


def test_convert_then_parity(examples, tmp_path):
    out = tmp_path / "ckpt"
    proc = moepipe("convert", "--model", examples["tiny-mixtral"], "--output", out, "--tp", 2,
                   "--moe-ep", 2, check=True)
    assert "2 rank(s)" in proc.stdout
    proc = moepipe("parity", "--hf", examples["tiny-mixtral"], "--checkpoint", out, check=True)
    assert "parity PASS" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["convert", "--model", "/nonexistent", "--output", "x"], "no such directory"),
    (["convert", "--model", "{model}", "--output", "x", "--tp", "3"], "cannot shard"),
    (["inspect", "/nonexistent"], "no such directory"),
    (["example", "tiny-gpt", "--out", "x"], "'tiny-gpt' is not one of"),
    (["build", "-c", "missing.yaml"], "no such config file"),
])
def test_user_errors_are_one_line_with_hint(args, needle, examples, tmp_path):
    args = [a.replace("{model}", str(examples["tiny-mixtral"])) for a in args]
    proc = moepipe(*args, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "hint:" in lines[0] or "unknown example" in lines[0]
    assert "Traceback" not in proc.stderr


def test_init_writes_valid_commented_config_and_refuses_overwrite(tmp_path, examples):
    proc = moepipe("init", "--example", "tiny-mixtral", "--tp", 2, "--moe-ep", 2, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "moepipe.yaml").read_text()
    assert text.count("#") > 10
    cfg = load_config(tmp_path / "moepipe.yaml")
    assert cfg.model.example == "tiny-mixtral" and cfg.parallel.tp == 2
    assert cfg.parallel.moe_ep == 2 and cfg.parallel.moe_tp is None and cfg.target == "cpu"
    assert cfg.workdir == tmp_path / "moepipe-work"
    again = moepipe("init", "--example", "tiny-mixtral", cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr
    forced = moepipe("init", "--model", examples["tiny-qwen3-moe"], "--target", "trtllm-pytorch",
                     "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    cfg = load_config(tmp_path / "moepipe.yaml")
    assert cfg.model.path == examples["tiny-qwen3-moe"].resolve()
    assert yaml.safe_load((tmp_path / "moepipe.yaml").read_text())["target"] == "trtllm-pytorch"


def test_build_converts_per_config(tmp_path):
    moepipe("init", "--example", "tiny-qwen3-moe", "--tp", 2, cwd=tmp_path, check=True)
    proc = moepipe("build", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ckpt = tmp_path / "moepipe-work" / "checkpoint"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["mapping"]["tp_size"] == 2 and (ckpt / "rank1.safetensors").exists()
