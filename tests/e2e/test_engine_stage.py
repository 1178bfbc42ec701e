"""The trtllm-engine build stage on CPU: the exact trtllm-build command line, the per-GPU memory
the engine limits imply for full-size Mixtral-8x7B (against values computed by hand), the
refusal of limits that cannot work, the fail-fast without TensorRT-LLM or a GPU, and the
refusal to deploy an engine of another TensorRT-LLM version.

trtllm-build cannot run here. Where a test needs one to have run, a stand-in script on PATH
writes what trtllm-build writes (config.json with version / pretrained_config / build_config
and rank{r}.engine), the way tests/unit/test_render_targets.py stands in for the container's
tools to test launch.sh.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

from moepipe.arch import get_family
from moepipe.config import parse_config
from moepipe.conversion.write import convert
from moepipe.deploy.render.repository import render_deployment
from moepipe.deploy.render.targets import Artifacts
from moepipe.errors import (
    CheckpointError,
    ConfigError,
    EnvironmentMissing,
    MoepipeError,
    UnsupportedError,
)
from moepipe.mapping import Mapping
from moepipe.sizing.shapes import shape_of
from moepipe.sizing.weights import Sharding, stage_weight_bytes
from moepipe.stages.engine import build_engine_into
from moepipe.trtllm.engine import (
    check_engine_limits,
    engine_config_version,
    engine_memory,
    trtllm_build_command,
)
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER, TRTLLM_ENGINE_VERSION
from moepipe.utils.fs import atomic_dir, read_json

GIB = 1 << 30
MIB = 1 << 20

def build_engine(cfg, checkpoint, output, echo):
    """What the build runner does around the stage: a temporary folder renamed into place."""
    output.parent.mkdir(parents=True, exist_ok=True)
    log = output.parent / f"{output.name}.trtllm-build.log"
    with atomic_dir(output, overwrite=True) as tmp:
        return build_engine_into(cfg, checkpoint, tmp, log, echo)


def engine_version(engine_dir):
    return engine_config_version(read_json(engine_dir / "config.json", "an engine folder"))


# config.json of mistralai/Mixtral-8x7B-v0.1 (the values that matter here).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "sliding_window": None,
}


def config(build=None, trtllm=None, **extra):
    return parse_config({"model": {"example": "tiny-mixtral"}, "target": "trtllm-engine",
                         "build": build or {}, "deploy": {"trtllm": trtllm or {}}, **extra})


@pytest.fixture(scope="module")
def mixtral():
    return get_family("MixtralForCausalLM").spec(MIXTRAL_8X7B, "Mixtral-8x7B config.json")


# --- the command line -------------------------------------------------------------------------


def test_default_config_gives_this_trtllm_build_command(tmp_path):
    argv = trtllm_build_command(config(), tmp_path / "ckpt", tmp_path / "engine")
    assert argv == [
        "trtllm-build",
        "--checkpoint_dir", str(tmp_path / "ckpt"),
        "--output_dir", str(tmp_path / "engine"),
        "--max_batch_size", "8",
        "--max_input_len", "1024",
        "--max_seq_len", "2048",
        "--max_num_tokens", "8192",
        "--max_beam_width", "1",
        "--kv_cache_type", "paged",
        "--remove_input_padding", "enable",
        "--gpt_attention_plugin", "auto",
        "--moe_plugin", "auto",
        "--use_fused_mlp", "enable",
        "--use_paged_context_fmha", "enable",
        "--multiple_profiles", "disable",
        "--logits_dtype", "float32",
        "--workers", "1",
    ]


def test_every_build_option_reaches_the_command(tmp_path):
    cfg = config({"max_batch_size": 64, "max_input_len": 4096, "max_seq_len": 8192,
                  "max_num_tokens": 16384, "max_beam_width": 2, "opt_num_tokens": 2048,
                  "gemm_plugin": "auto", "use_fused_mlp": False,
                  "use_paged_context_fmha": False, "logits_dtype": "float16", "workers": 4})
    argv = trtllm_build_command(cfg, tmp_path / "ckpt", tmp_path / "engine")
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert flags == {
        "--checkpoint_dir": str(tmp_path / "ckpt"), "--output_dir": str(tmp_path / "engine"),
        "--max_batch_size": "64", "--max_input_len": "4096", "--max_seq_len": "8192",
        "--max_num_tokens": "16384", "--max_beam_width": "2", "--opt_num_tokens": "2048",
        "--kv_cache_type": "paged", "--remove_input_padding": "enable",
        "--gpt_attention_plugin": "auto", "--moe_plugin": "auto", "--gemm_plugin": "auto",
        "--use_fused_mlp": "disable", "--use_paged_context_fmha": "disable",
        "--multiple_profiles": "disable", "--logits_dtype": "float16", "--workers": "4"}
    # TensorRT-LLM forces reduce_fusion off for MoE models: never passed.
    assert "--reduce_fusion" not in argv


def test_multiple_profiles_with_opt_num_tokens_is_refused(tmp_path, mixtral):
    cfg = config({"multiple_profiles": True, "opt_num_tokens": 256})
    with pytest.raises(ConfigError, match=r"build.multiple_profiles is on and "
                                          r"build.opt_num_tokens is 256.*remove "
                                          r"build.opt_num_tokens"):
        trtllm_build_command(cfg, tmp_path / "ckpt", tmp_path / "engine")
    with pytest.raises(ConfigError, match="multiple_profiles"):
        check_engine_limits(cfg, mixtral, Mapping.create(tp=8))
    assert "--multiple_profiles" in trtllm_build_command(
        config({"multiple_profiles": True}), tmp_path / "ckpt", tmp_path / "engine")


# --- memory -----------------------------------------------------------------------------------


def test_parameter_count_of_mixtral_8x7b(mixtral):
    assert shape_of(mixtral).parameters() == 46_702_792_704  # = the HF checkpoint's bytes / 2


H, V, L, INTER, E = 4096, 32000, 32, 14336, 8
NORMS = 2 * H  # per layer, on every rank
# per layer, on every rank, in float32: TensorRT-LLM's MoE router is a float32 RowLinear
# ("Routing is sensitive", tensorrt_llm/layers/moe.py), as in its checkpoint
ROUTER = E * H


def mixtral_rank_bytes(tp, moe_tp, moe_ep):
    """Hand count of one rank's bytes at pp=1 (bf16, the routers float32; q/o split by tp; k/v:
    one 128-wide head of the 8 per tp rank at tp=8, two at tp=4; experts E/moe_ep of width
    INTER/moe_tp; embedding replicated; lm_head split by tp; final norm)."""
    attention = 2 * H * (H // tp) + 2 * H * (8 // tp) * 128
    experts = (E // moe_ep) * 3 * H * (INTER // moe_tp)
    return 2 * (L * (attention + NORMS + experts) + V * H + (V // tp) * H + H) + 4 * L * ROUTER


@pytest.mark.parametrize("mapping,expected", [
    (Mapping.create(tp=8), {
        "weights": mixtral_rank_bytes(tp=8, moe_tp=8, moe_ep=1),  # 11,909,472,256
        "kv_cache": 2 * 32 * 1 * 128 * (8 * 2048) * 2,  # K+V x layers x heads x dim x tokens
        "activations": 2 * 8192 * 4096 * 10,  # bf16 x max_num_tokens x heads*dim x c(8)
        "moe_workspace": 8192 * 4096 * 8 * 2 // 128 * 4,  # tokens x A x E x top-k / ep / 128
        "runtime": 392 * MIB + 3584 * MIB,  # NCCL at tp=8 + CUDA context etc.
    }),
    (Mapping.create(tp=4, moe_ep=2), {
        "weights": mixtral_rank_bytes(tp=4, moe_tp=2, moe_ep=2),  # 23,552,073,728
        "kv_cache": 2 * 32 * 2 * 128 * (8 * 2048) * 2,
        "activations": 2 * 8192 * 4096 * 10,
        "moe_workspace": 8192 * 4096 * 8 * 2 // 2 // 128 * 4,
        "runtime": 392 * MIB + 3584 * MIB,
    }),
])
def test_engine_memory_of_full_size_mixtral(mixtral, mapping, expected):
    usage = engine_memory(config(), mixtral, mapping)
    assert usage == {**expected, "total": sum(expected.values())}
    literal = {8: (11_909_472_256, 268_435_456, 8_388_608 * 2),
               4: (23_552_073_728, 536_870_912, 8_388_608)}[mapping.tp]
    assert (usage["weights"], usage["kv_cache"], usage["moe_workspace"]) == literal


def test_kv_heads_are_duplicated_not_split_beyond_their_number(mixtral):
    at = {tp: engine_memory(config(), mixtral, Mapping.create(tp=tp))
          for tp in (4, 8, 16)}
    assert at[4]["kv_cache"] == 2 * at[8]["kv_cache"]
    assert at[16]["kv_cache"] == at[8]["kv_cache"]  # 8 KV heads: one per rank, duplicated


def test_the_busiest_pipeline_stage_is_reported(mixtral):
    mapping = Mapping.create(tp=2, pp=2)
    usage = engine_memory(config(), mixtral, mapping)
    s = Sharding(2, 2, 2, 1)
    first, last = (stage_weight_bytes(shape_of(mixtral), s, st, "none") for st in (0, 1))
    assert first - last == 2 * (V * H - (V // 2) * H - H)  # embedding vs. half lm_head + norm
    assert usage["weights"] == first
    assert usage["kv_cache"] == 2 * 16 * 4 * 128 * (8 * 2048) * 2  # 16 layers per stage


def test_fp8_kv_cache_halves_the_kv_estimate(mixtral):
    bf16, fp8 = (engine_memory(config(quantize={"format": "fp8", "kv_cache": kv}), mixtral,
                               Mapping.create(tp=8)) for kv in ("none", "fp8"))
    assert fp8["kv_cache"] * 2 == bf16["kv_cache"]


# --- limits -----------------------------------------------------------------------------------


def test_limits_that_fit_pass_and_return_the_estimate(mixtral):
    usage = check_engine_limits(config(), mixtral, Mapping.create(tp=8))
    assert usage["total"] < 80 * GIB


def test_too_much_memory_is_refused_with_the_numbers(mixtral):
    with pytest.raises(ConfigError) as err:
        check_engine_limits(config(), mixtral, Mapping.create(tp=1))
    message = str(err.value)
    assert "need about 93.9 GiB per GPU (weights 87.0 + kv cache 2.0 + activations 1.4" in message
    assert "more than build.gpu_memory_gb (80 GiB)" in message and "parallel.tp" in message
    assert "\n" not in message
    # the same limits on a 141 GiB H200
    check_engine_limits(config({"gpu_memory_gb": 141}), mixtral, Mapping.create(tp=1))


@pytest.mark.parametrize("build,trtllm,message", [
    ({"max_num_tokens": 512}, {},
     r"build.max_num_tokens \(512\) is smaller than build.max_input_len \(1024\).*"
     r"enable_chunked_context"),
    ({"max_seq_len": 65536}, {},
     r"build.max_seq_len \(65536\) exceeds the model's max_position_embeddings \(32768\)"),
    ({"opt_num_tokens": 9000}, {},
     r"build.opt_num_tokens \(9000\) exceeds build.max_num_tokens \(8192\)"),
    ({}, {"max_beam_width": 4},
     r"deploy.trtllm.max_beam_width \(4\) exceeds build.max_beam_width \(1\)"),
    ({"use_paged_context_fmha": False}, {},
     r"deploy.trtllm.enable_kv_cache_reuse needs an engine built with paged context"),
    ({"use_paged_context_fmha": False}, {"enable_chunked_context": True,
                                         "enable_kv_cache_reuse": False},
     r"deploy.trtllm.enable_chunked_context needs"),
])
def test_absurd_limits_are_refused(mixtral, build, trtllm, message):
    with pytest.raises(ConfigError, match=message):
        check_engine_limits(config(build, trtllm), mixtral, Mapping.create(tp=8))


def test_chunked_context_lets_a_prompt_span_several_steps(mixtral):
    check_engine_limits(config({"max_num_tokens": 512}, {"enable_chunked_context": True}),
                        mixtral, Mapping.create(tp=8))


def test_prompt_limit_must_leave_room_to_generate(mixtral):
    with pytest.raises(ConfigError, match=r"max_input_len \(2048\) must be smaller than "
                                          r"max_seq_len \(2048\)"):
        config({"max_input_len": 2048})  # the one place this rule lives: the config model


def test_int8_sq_on_the_engine_path_needs_a_moe_without_shared_expert():
    """TensorRT-LLM 1.2 serves W8A8_SQ_PER_CHANNEL through its non-plugin path and re-creates
    the excluded MoE block unquantized (quantization/quantize.py): fine for Mixtral-style
    experts, not for Qwen2-MoE's shared expert."""
    from moepipe.examples import example_spec

    mixtral = config(quantize={"format": "int8_sq"})
    check_engine_limits(mixtral, example_spec("tiny-mixtral"), Mapping.create(tp=2))
    qwen2 = config(quantize={"format": "int8_sq"}, model={"example": "tiny-qwen2-moe"})
    with pytest.raises(UnsupportedError, match="drops this model's shared expert"):
        check_engine_limits(qwen2, example_spec("tiny-qwen2-moe"), Mapping.create(tp=2))


# --- building ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(examples, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine-ckpt") / "checkpoint"
    convert(examples["tiny-mixtral"], out, tp=2, moe_ep=2)
    return out


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir())


def test_build_without_tensorrt_llm_fails_fast_naming_the_container(checkpoint, tmp_path):
    if shutil.which("trtllm-build"):
        pytest.skip("this machine has trtllm-build")
    with pytest.raises(EnvironmentMissing) as err:
        build_engine(config(), checkpoint, tmp_path / "engine", echo=lambda _: None)
    assert "trtllm-build not found" in str(err.value)
    assert TRITON_TRTLLM_CONTAINER in str(err.value)
    assert leftovers(tmp_path) == []  # no engine, no temporary folder, no log


def stub(folder, name, text):
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)


# Stands in for trtllm-build: writes an engine of the checkpoint's mapping the way Engine.save
# does; STUB_FAIL makes it fail, STUB_VERSION changes the version it records.
TRTLLM_BUILD_STUB = f"""#!{sys.executable}
import argparse, json, os, sys
from pathlib import Path
parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint_dir")
parser.add_argument("--output_dir")
args, _ = parser.parse_known_args()
print("[TensorRT-LLM] building engines")
if os.environ.get("STUB_FAIL"):
    print("RuntimeError: CUDA out of memory", file=sys.stderr)
    sys.exit(3)
ckpt = json.loads((Path(args.checkpoint_dir) / "config.json").read_text())
out = Path(args.output_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text(json.dumps({{
    "version": os.environ.get("STUB_VERSION", "{TRTLLM_ENGINE_VERSION}"),
    "pretrained_config": ckpt, "build_config": {{"argv": sys.argv[1:]}}}}))
for rank in range(ckpt["mapping"]["world_size"]):
    (out / f"rank{{rank}}.engine").write_bytes(b"engine")
"""


@pytest.fixture
def container(tmp_path, monkeypatch):
    """PATH with stand-ins for trtllm-build and nvidia-smi (two GPUs); returns the bin folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "trtllm-build", TRTLLM_BUILD_STUB)
    stub(bin_dir, "nvidia-smi", "#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n"
                                "echo 'GPU 1: NVIDIA H100 (UUID: GPU-1)'\n")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for var in ("STUB_FAIL", "STUB_VERSION"):
        monkeypatch.delenv(var, raising=False)
    return bin_dir


def test_a_successful_build_is_renamed_into_place_and_checked(checkpoint, tmp_path, container):
    out = tmp_path / "work" / "engine"
    out.parent.mkdir()
    lines = []
    result = build_engine(config(), checkpoint, out, echo=lines.append)
    assert result["trtllm_version"] == TRTLLM_ENGINE_VERSION == engine_version(out)
    assert result["command"][:4] == trtllm_build_command(config(), checkpoint, out)[:4]
    assert result["config"] == json.loads((out / "config.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.engine",
                                                    "rank1.engine"]
    # trtllm-build ran the same command, writing into a temporary sibling
    ran = result["config"]["build_config"]["argv"]
    assert ran[:2] == result["command"][1:3] and ran[4:] == result["command"][5:]
    assert ran[3] != str(out) and not Path(ran[3]).exists()
    assert leftovers(out.parent) == ["engine", "engine.trtllm-build.log"]
    assert "tp=2 pp=1 moe_tp=1 moe_ep=2" in lines[0]


def test_a_failed_build_shows_the_log_tail_and_leaves_nothing(checkpoint, tmp_path, container,
                                                               monkeypatch):
    monkeypatch.setenv("STUB_FAIL", "1")
    with pytest.raises(MoepipeError, match="trtllm-build failed with exit status 3") as err:
        build_engine(config(), checkpoint, tmp_path / "engine", echo=lambda _: None)
    assert "CUDA out of memory" in err.value.details
    assert leftovers(tmp_path) == ["bin", "engine.trtllm-build.log"]


def test_a_failed_rebuild_keeps_the_previous_engine(checkpoint, tmp_path, container,
                                                    monkeypatch):
    out = tmp_path / "engine"
    build_engine(config(), checkpoint, out, echo=lambda _: None)
    before = (out / "config.json").read_text()
    monkeypatch.setenv("STUB_FAIL", "1")
    with pytest.raises(MoepipeError):
        build_engine(config(), checkpoint, out, echo=lambda _: None)
    assert (out / "config.json").read_text() == before


def test_an_engine_of_another_tensorrt_llm_is_not_installed(checkpoint, tmp_path, container,
                                                            monkeypatch):
    monkeypatch.setenv("STUB_VERSION", "1.1.0")
    with pytest.raises(EnvironmentMissing, match=f"TensorRT-LLM 1.1.0.*"
                                                 f"{TRTLLM_ENGINE_VERSION}"):
        build_engine(config(), checkpoint, tmp_path / "engine", echo=lambda _: None)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("visible", ["", "-1", "-1,0", "7"])
def test_no_visible_gpu_fails_fast(checkpoint, tmp_path, container, monkeypatch, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)  # none of the two GPUs
    with pytest.raises(EnvironmentMissing, match="no NVIDIA GPU visible") as err:
        build_engine(config(), checkpoint, tmp_path / "engine", echo=lambda _: None)
    assert TRITON_TRTLLM_CONTAINER in str(err.value)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("visible", ["1", "0,1", "GPU-1"])
def test_one_visible_gpu_is_enough_to_build(checkpoint, tmp_path, container, monkeypatch,
                                            visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)  # trtllm-build builds rank by rank
    build_engine(config(), checkpoint, tmp_path / "engine", echo=lambda _: None)
    assert engine_version(tmp_path / "engine") == TRTLLM_ENGINE_VERSION


def test_no_nvidia_smi_fails_fast(checkpoint, tmp_path, container):
    (container / "nvidia-smi").unlink()
    with pytest.raises(EnvironmentMissing, match="nvidia-smi not found"):
        build_engine(config(), checkpoint, tmp_path / "engine", echo=lambda _: None)


def test_an_engine_is_not_a_checkpoint(tmp_path, container):
    engine = fake_engine(tmp_path / "engine")
    with pytest.raises(CheckpointError, match="not a TensorRT-LLM checkpoint config"):
        build_engine(config(), engine, tmp_path / "engine2", echo=lambda _: None)


# --- engine version and the deploy guard ------------------------------------------------------


def fake_engine(path, version=TRTLLM_ENGINE_VERSION):
    """An engine folder as trtllm-build leaves it, for tp=2 (rank files empty)."""
    path.mkdir(parents=True)
    body = {"pretrained_config": {"architecture": "MixtralForCausalLM",
                                  "logits_dtype": "float32",
                                  "mapping": Mapping.create(tp=2, moe_ep=2).to_trtllm()},
            "build_config": {"max_beam_width": 1}}
    if version is not None:
        body["version"] = version
    (path / "config.json").write_text(json.dumps(body))
    for rank in range(2):
        (path / f"rank{rank}.engine").write_bytes(b"")
    return path


def test_engine_version_reads_the_engine_config(tmp_path):
    assert engine_version(fake_engine(tmp_path / "a", version="1.2.0")) == "1.2.0"
    with pytest.raises(CheckpointError, match="records no TensorRT-LLM version"):
        engine_version(fake_engine(tmp_path / "b", version=None))
    with pytest.raises(CheckpointError, match="config.json: not found"):
        engine_version(tmp_path)


def render_with_engine(examples, engine, root):
    model = examples["tiny-mixtral"]
    cfg = parse_config({"model": {"path": str(model)}, "target": "trtllm-engine",
                        "parallel": {"tp": 2, "moe_ep": 2}, "workdir": str(root / "work")})
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    art = Artifacts(version="0123456789ab", model_dir=model, engine_dir=engine, vocab_size=vocab)
    return cfg, render_deployment(cfg, art)


def test_deploy_refuses_an_engine_of_another_tensorrt_llm_version(examples, tmp_path):
    engine = fake_engine(tmp_path / "engine", version="1.1.0")
    with pytest.raises(MoepipeError) as err:
        render_with_engine(examples, engine, tmp_path)
    message = str(err.value)
    assert f"built with TensorRT-LLM 1.1.0, but moepipe builds and deploys with TensorRT-LLM " \
           f"{TRTLLM_ENGINE_VERSION}" in message
    assert TRITON_TRTLLM_CONTAINER in message and "docker/versions.env" in message
    assert not (tmp_path / "work" / "deploy").exists()


def test_deploy_refuses_an_engine_without_a_version(examples, tmp_path):
    with pytest.raises(CheckpointError, match="records no TensorRT-LLM version"):
        render_with_engine(examples, fake_engine(tmp_path / "engine", version=None), tmp_path)


def test_deploy_accepts_an_engine_of_the_pinned_version(examples, tmp_path):
    engine = fake_engine(tmp_path / "engine")
    cfg, repo = render_with_engine(examples, engine, tmp_path)
    params = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'string_value: "{engine.resolve()}"' in params


# --- the engine stage inside `moepipe build`, and deploy reading it ---------------------------


def test_build_runs_the_engine_stage_and_deploy_renders_it(tmp_path, container):
    import yaml

    from moepipe.commands.build import run_build
    from moepipe.commands.deploy import run_deploy
    from moepipe.config import load_config

    project = tmp_path / "project"
    project.mkdir()
    (project / "moepipe.yaml").write_text(yaml.safe_dump({
        "model": {"example": "tiny-mixtral"}, "target": "trtllm-engine",
        "parallel": {"tp": 2, "moe_ep": 2}, "build": {"max_batch_size": 4},
        "workdir": "work"}))
    path = project / "moepipe.yaml"
    manifest = run_build(path, echo=lambda s: None)
    engine = next(s for s in manifest["stages"] if s["stage"] == "engine")
    assert engine["status"] == "built"
    assert engine["details"]["trtllm_version"] == TRTLLM_ENGINE_VERSION
    assert engine["details"]["command"][:3] == ["trtllm-build", "--checkpoint_dir",
                                                str((project / "work" / "checkpoint").resolve())]
    built = project / "work" / "engine"
    assert sorted(p.name for p in built.iterdir() if p.suffix == ".engine") == [
        "rank0.engine", "rank1.engine"]
    argv = json.loads((built / "config.json").read_text())["build_config"]["argv"]
    assert argv[argv.index("--max_batch_size") + 1] == "4"
    # Nothing changed: nothing rebuilt. A changed limit rebuilds the engine only.
    again = run_build(path, echo=lambda s: None)
    assert {s["status"] for s in again["stages"]} == {"reused"}
    text = path.read_text().replace("max_batch_size: 4", "max_batch_size: 8")
    path.write_text(text)
    changed = run_build(path, echo=lambda s: None)
    assert {s["stage"]: s["status"] for s in changed["stages"]} == {
        "source": "reused", "inspect": "reused", "convert": "reused", "engine": "built"}
    # deploy renders the repository around the engine (no server: GPU target) ...
    cfg = load_config(path)
    result = run_deploy(cfg, echo=lambda s: None)
    rendered = (Path(result["repository"]) / "tensorrt_llm" / "config.pbtxt").read_text()
    assert str(built.resolve()) in rendered
    # ... and refuses an engine changed since the build (an engine of another TensorRT-LLM
    # version as such is refused by test_deploy_refuses_an_engine_of_another_tensorrt_llm_version).
    engine_cfg = built / "config.json"
    data = json.loads(engine_cfg.read_text())
    data["version"] = "1.1.0"
    engine_cfg.write_text(json.dumps(data))
    with pytest.raises(MoepipeError, match="no longer matches what the build recorded"):
        run_deploy(cfg, echo=lambda s: None)
