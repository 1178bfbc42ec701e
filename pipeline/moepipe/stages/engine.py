"""Stage ``engine``: TensorRT engines from a TensorRT-LLM checkpoint with ``trtllm-build``.

TensorRT-LLM runs only inside NVIDIA's container on a GPU machine, so this stage is a thin
adapter whose every input is produced and checked by code that runs anywhere:

* :func:`trtllm_build_command` - the exact ``trtllm-build`` argv (TensorRT-LLM 1.2.x flags) from
  the ``build`` section;
* :func:`engine_memory` / :func:`check_engine_limits` - the per-GPU memory the limits imply and
  the refusal of limits that cannot work, before any GPU is touched;
* :func:`build_engine` - fails fast where ``trtllm-build`` or a GPU is missing, runs the command
  in a subprocess (so the GPU memory is freed when it ends) writing into a temporary folder that
  is renamed into place only when the engine is complete, and checks the engine's config.json.

Sources of the flags and rules: ``tensorrt_llm/commands/build.py``, ``builder.py``
(``BuildConfig``) and ``plugin/plugin.py`` (``PluginConfig``) of TensorRT-LLM, summarised in
the project's reference facts (trtllm-facts.md section 3).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.deploy.gpu_targets import engine_config_version, engine_world_size
from moepipe.errors import CheckpointError, ConfigError, EnvironmentMissing, MoepipeError
from moepipe.trtllm.mapping import Mapping, check_mapping, stage_layers
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER, TRTLLM_ENGINE_VERSION
from moepipe.utils.fs import atomic_dir

if TYPE_CHECKING:
    from moepipe.arch.spec import ModelSpec
    from moepipe.config import BuildSection, MoepipeConfig

log = logging.getLogger("moepipe")

TRTLLM_BUILD = "trtllm-build"
GIB = 1 << 30
MIB = 1 << 20
# Activation bytes per element: the dtype the engine computes in.
ACTIVATION_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# aiconfigurator's TensorRT-LLM coefficients for MoE families, keyed by tp (planner facts A1).
ACTIVATION_COEFF = {1: 22, 2: 13, 4: 10, 8: 10}
ACTIVATION_MIN = 70 * MIB
# aiconfigurator's NCCL buffers by tp and fixed "other" memory (CUDA context, cuBLAS, runtime).
NCCL_BYTES = {1: 0, 2: 342 * MIB, 4: 392 * MIB, 8: 392 * MIB}
OTHER_BYTES = 3584 * MIB
LOG_TAIL_LINES = 30


def _flag(on: bool) -> str:
    return "enable" if on else "disable"


def _check_flags(b: BuildSection) -> None:
    # TensorRT-LLM's build.py raises RuntimeError for this pair; say it in moepipe's terms.
    if b.multiple_profiles and b.opt_num_tokens is not None:
        raise ConfigError(f"build.multiple_profiles is on and build.opt_num_tokens is "
                          f"{b.opt_num_tokens}: trtllm-build accepts one or the other",
                          "remove build.opt_num_tokens, or set build.multiple_profiles: false")


def trtllm_build_command(cfg: MoepipeConfig, checkpoint_dir: Path, output_dir: Path) -> list[str]:
    """The ``trtllm-build`` argv that builds ``checkpoint_dir`` into ``output_dir``.

    Fixed, because the ``tensorrtllm`` backend's in-flight batching needs them: a paged KV
    cache, packed inputs (``remove_input_padding``) and the attention plugin; the MoE plugin
    (``disable`` would fall back to the slow ``MoeOOTB`` layers). Not passed: ``reduce_fusion``
    (TensorRT-LLM forces it off for MoE models) and ``gemm_plugin`` when unset (TensorRT-LLM's
    default: off, but on for NVFP4). TensorRT-LLM itself turns ``use_fused_mlp`` off for
    quantized checkpoints other than FP8.
    """
    b = cfg.build
    _check_flags(b)
    argv = [TRTLLM_BUILD,
            "--checkpoint_dir", str(Path(checkpoint_dir).resolve()),
            "--output_dir", str(Path(output_dir).resolve()),
            "--max_batch_size", str(b.max_batch_size),
            "--max_input_len", str(b.max_input_len),
            "--max_seq_len", str(b.max_seq_len),
            "--max_num_tokens", str(b.max_num_tokens),
            "--max_beam_width", str(b.max_beam_width)]
    if b.opt_num_tokens is not None:
        argv += ["--opt_num_tokens", str(b.opt_num_tokens)]
    argv += ["--kv_cache_type", "paged",
             "--remove_input_padding", "enable",
             "--gpt_attention_plugin", "auto",
             "--moe_plugin", "auto"]
    if b.gemm_plugin is not None:
        argv += ["--gemm_plugin", b.gemm_plugin]
    argv += ["--use_fused_mlp", _flag(b.use_fused_mlp),
             "--use_paged_context_fmha", _flag(b.use_paged_context_fmha),
             "--multiple_profiles", _flag(b.multiple_profiles),
             "--logits_dtype", b.logits_dtype,
             "--workers", str(b.workers)]
    return argv


# --- memory -----------------------------------------------------------------------------------


def _by_tp(table: dict[int, int], tp: int) -> int:
    """``table`` at the largest key <= tp (aiconfigurator indexes by min(tp, 8))."""
    return table[max(k for k in table if k <= tp)]


def _layer_params(spec: ModelSpec, tp: int, kv_heads: int, experts: int, expert_inter: int
                  ) -> int:
    """Parameters of one decoder layer held by one rank: attention split ``tp`` ways with
    ``kv_heads`` KV heads, ``experts`` experts of width ``expert_inter``; norms and the router
    (all E rows) replicated; the shared expert split by the full tp."""
    h, hd = spec.hidden_size, spec.head_dim
    q = spec.attn_width // tp
    params = 2 * h * q + 2 * h * kv_heads * hd  # q and o; k and v
    if spec.attention_bias:
        params += q + 2 * kv_heads * hd
    params += 2 * h + spec.num_experts * h  # input/post layernorms, router
    params += experts * 3 * h * expert_inter
    if spec.shared_expert_intermediate_size:
        params += 3 * h * spec.shared_expert_intermediate_size // tp + h  # + its gate [1, H]
    return params


def model_params(spec: ModelSpec) -> int:
    """Parameters of the whole model (as counted in its Hugging Face checkpoint); q/k norms of
    a few hundred elements per layer are left out here and per rank alike."""
    outer = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    layer = _layer_params(spec, 1, spec.num_kv_heads, spec.num_experts,
                          spec.expert_intermediate_size)
    return spec.num_layers * layer + outer + spec.hidden_size


def rank_params(spec: ModelSpec, mapping: Mapping, stage: int) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds (TensorRT-LLM's sharding: q/o by
    tp, KV heads by tp and duplicated when fewer than tp, experts by moe_ep and their width by
    moe_tp; the embedding, replicated, on the first stage; lm_head, vocab padded to a multiple
    of tp and split, and the final norm on the last stage)."""
    layers = len(stage_layers(spec.num_layers, mapping.pp, stage))
    layer = _layer_params(spec, mapping.tp, math.ceil(spec.num_kv_heads / mapping.tp),
                          spec.num_experts // mapping.moe_ep,
                          spec.expert_intermediate_size // mapping.moe_tp)
    params = layers * layer
    if stage == 0:
        params += spec.vocab_size * spec.hidden_size
    if stage == mapping.pp - 1:
        params += math.ceil(spec.vocab_size / mapping.tp) * spec.hidden_size + spec.hidden_size
    return params


def _activation_dtype(cfg: MoepipeConfig, spec: ModelSpec) -> str:
    return spec.torch_dtype if cfg.model.dtype == "auto" else cfg.model.dtype


def engine_memory(cfg: MoepipeConfig, spec: ModelSpec, mapping: Mapping, weight_bytes: int,
                  kv_dtype_bytes: int) -> dict[str, int]:
    """Bytes one GPU needs for the engine limits of ``cfg.build``, on the busiest pipeline
    stage: ``weights``, ``kv_cache``, ``activations``, ``moe_workspace``, ``runtime`` and
    ``total`` (their sum).

    ``weight_bytes`` is the tensor bytes of the whole, unsharded model (``moepipe inspect``'s
    bytes_total; for a quantized model, of the quantized checkpoint); ``kv_dtype_bytes`` the
    bytes of one KV-cache element (2 for a 16-bit cache, 1 for FP8/INT8). Formulas (T = max
    tokens per step = min(max_num_tokens, max_batch_size x max_seq_len), A = num_heads x
    head_dim, tp/pp/moe_tp/moe_ep the mapping; planner-deepseek-facts.md A1):

    * weights = rank_params / model_params x weight_bytes - each rank's share of the
      parameters (:func:`rank_params`) at the model's mean bytes per parameter;
    * kv_cache = 2 (K and V) x layers of the stage x ceil(kv_heads / tp) x head_dim x tokens x
      kv_dtype_bytes, tokens = max_batch_size x (max_input_len + max_beam_width x
      (max_seq_len - max_input_len)): every request at full length, generated tokens per beam
      (TensorRT-LLM's per-rank KV size: local layers, KV heads duplicated when fewer than tp);
    * activations = max(act_bytes x T x A x c(tp), 70 MiB), c = 22, 13, 10, 10 for tp = 1, 2,
      4, 8+ (aiconfigurator's TensorRT-LLM fit for MoE models; TensorRT sizes the activation
      workspace at build time from max_num_tokens; pp does not shrink it), act_bytes the bytes
      of the model dtype;
    * moe_workspace = T x A x num_experts x top_k / moe_ep / 128 x 4 (aiconfigurator's MoE
      workspace, attention DP = 1 on the engine path);
    * runtime = NCCL buffers (0, 342, 392, 392 MiB for tp = 1, 2, 4, 8+) + 3.5 GiB for the CUDA
      context, cuBLAS and the runtime (aiconfigurator's nccl_mem and other_mem).
    """
    check_mapping(spec, mapping)
    b = cfg.build
    tokens_per_step = min(b.max_num_tokens, b.max_batch_size * b.max_seq_len)
    kv_tokens = b.max_batch_size * (b.max_input_len
                                    + b.max_beam_width * (b.max_seq_len - b.max_input_len))
    kv_heads = math.ceil(spec.num_kv_heads / mapping.tp)
    total_params = model_params(spec)
    act_bytes = ACTIVATION_BYTES[_activation_dtype(cfg, spec)]
    activations = max(act_bytes * tokens_per_step * spec.attn_width
                      * _by_tp(ACTIVATION_COEFF, mapping.tp), ACTIVATION_MIN)
    moe_workspace = (tokens_per_step * spec.attn_width * spec.num_experts * spec.top_k * 4
                     // (mapping.moe_ep * 128))
    runtime = _by_tp(NCCL_BYTES, mapping.tp) + OTHER_BYTES
    busiest: dict[str, int] = {}
    for stage in range(mapping.pp):
        layers = len(stage_layers(spec.num_layers, mapping.pp, stage))
        usage = {
            "weights": rank_params(spec, mapping, stage) * weight_bytes // total_params,
            "kv_cache": 2 * layers * kv_heads * spec.head_dim * kv_tokens * kv_dtype_bytes,
            "activations": activations,
            "moe_workspace": moe_workspace,
            "runtime": runtime,
        }
        usage["total"] = sum(usage.values())
        if not busiest or usage["total"] > busiest["total"]:
            busiest = usage
    return busiest


def check_engine_limits(cfg: MoepipeConfig, spec: ModelSpec, mapping: Mapping,
                        weight_bytes: int, kv_dtype_bytes: int) -> dict[str, int]:
    """Refuse engine limits that cannot work, with the numbers and what to change: limits that
    contradict each other or the model, options TensorRT-LLM rejects together, and limits whose
    memory (:func:`engine_memory`) exceeds ``build.gpu_memory_gb``. Returns the estimate."""
    b, t = cfg.build, cfg.deploy.trtllm
    _check_flags(b)
    if b.max_input_len >= b.max_seq_len:
        raise ConfigError(f"build.max_input_len ({b.max_input_len}) must be smaller than "
                          f"build.max_seq_len ({b.max_seq_len})",
                          "max_seq_len counts the prompt and the generated tokens")
    if b.max_seq_len > spec.max_position_embeddings:
        raise ConfigError(f"build.max_seq_len ({b.max_seq_len}) exceeds the model's "
                          f"max_position_embeddings ({spec.max_position_embeddings})",
                          f"lower build.max_seq_len to {spec.max_position_embeddings} or less")
    if b.max_num_tokens < b.max_input_len and not t.enable_chunked_context:
        raise ConfigError(f"build.max_num_tokens ({b.max_num_tokens}) is smaller than "
                          f"build.max_input_len ({b.max_input_len}): a full prompt does not fit "
                          "in one engine step",
                          f"raise build.max_num_tokens to at least {b.max_input_len}, or set "
                          "deploy.trtllm.enable_chunked_context: true")
    if b.opt_num_tokens is not None and b.opt_num_tokens > b.max_num_tokens:
        raise ConfigError(f"build.opt_num_tokens ({b.opt_num_tokens}) exceeds "
                          f"build.max_num_tokens ({b.max_num_tokens})",
                          "opt_num_tokens is the step size to tune for, within max_num_tokens")
    if t.max_beam_width > b.max_beam_width:
        raise ConfigError(f"deploy.trtllm.max_beam_width ({t.max_beam_width}) exceeds "
                          f"build.max_beam_width ({b.max_beam_width}), the widest beam the "
                          "engine is built for",
                          "raise build.max_beam_width or lower deploy.trtllm.max_beam_width")
    needs_paged_fmha = [name for name, on in (
        ("enable_chunked_context", t.enable_chunked_context),
        ("enable_kv_cache_reuse", t.enable_kv_cache_reuse)) if on]
    if needs_paged_fmha and not b.use_paged_context_fmha:
        raise ConfigError(f"deploy.trtllm.{needs_paged_fmha[0]} needs an engine built with "
                          "paged context attention, but build.use_paged_context_fmha is false",
                          "set build.use_paged_context_fmha: true, or turn "
                          f"deploy.trtllm.{' and '.join(needs_paged_fmha)} off")
    usage = engine_memory(cfg, spec, mapping, weight_bytes, kv_dtype_bytes)
    if usage["total"] > b.gpu_memory_gb * GIB:
        parts = " + ".join(f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in usage.items()
                           if k != "total")
        raise ConfigError(
            f"the engine limits need about {usage['total'] / GIB:.1f} GiB per GPU ({parts}) "
            f"with {mapping.describe()}, more than build.gpu_memory_gb ({b.gpu_memory_gb:g} "
            "GiB)",
            "use more GPUs (parallel.tp / parallel.pp), lower build.max_batch_size, "
            "max_seq_len or max_num_tokens, quantize the weights or KV cache, or set "
            "build.gpu_memory_gb to your GPU's memory")
    return usage


# --- building ---------------------------------------------------------------------------------


def _container_hint() -> str:
    return (f"build engines inside {TRITON_TRTLLM_CONTAINER} (TensorRT-LLM "
            f"{TRTLLM_ENGINE_VERSION}; docker/Dockerfile adds moepipe) on a machine with an "
            "NVIDIA GPU, e.g. `docker run --gpus all ...`")


def _cuda_visible(devices: str, gpus: int) -> int:
    """How many of ``gpus`` CUDA_VISIBLE_DEVICES leaves visible: CUDA stops at the first entry
    that is neither an index below ``gpus`` nor a GPU-/MIG- UUID (so ``-1`` hides them all)."""
    count = 0
    for entry in (e.strip() for e in devices.split(",")):
        if not (entry.isdigit() and int(entry) < gpus or entry.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return min(count, gpus)


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use: ``nvidia-smi -L``, narrowed by CUDA_VISIBLE_DEVICES.
    Raises EnvironmentMissing without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise EnvironmentMissing("no NVIDIA GPU visible: nvidia-smi not found", _container_hint())
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvironmentMissing(f"no NVIDIA GPU visible: nvidia-smi -L failed ({e})",
                                 _container_hint()) from None
    gpus = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    return gpus if devices is None else _cuda_visible(devices, gpus)


def require_build_environment() -> None:
    """Fail fast, naming the container, where ``trtllm-build`` or an NVIDIA GPU is missing."""
    if shutil.which(TRTLLM_BUILD) is None:
        raise EnvironmentMissing(f"{TRTLLM_BUILD} not found on PATH: TensorRT-LLM is not "
                                 "installed here", _container_hint())
    if visible_gpus() < 1:
        raise EnvironmentMissing("no NVIDIA GPU visible (nvidia-smi lists none, or "
                                 "CUDA_VISIBLE_DEVICES hides them all)", _container_hint())


def _read_config(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {what} config.json") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _checkpoint_mapping(checkpoint_dir: Path) -> Mapping:
    path = Path(checkpoint_dir) / "config.json"
    ckpt = _read_config(path, "TensorRT-LLM checkpoint")
    if "pretrained_config" in ckpt or not isinstance(ckpt.get("mapping"), dict):
        raise CheckpointError(f"{path} is not a TensorRT-LLM checkpoint config (no top-level "
                              "mapping; is it an engine?)", "run the convert stage first")
    return Mapping.from_trtllm(ckpt["mapping"])


def engine_version(engine_dir: Path) -> str:
    """The TensorRT-LLM version that built the engine in ``engine_dir`` (its config.json's
    ``version``); CheckpointError when there is none."""
    path = Path(engine_dir) / "config.json"
    return engine_config_version(_read_config(path, "engine"), str(path))


def _check_engine(engine_dir: Path, expected: Mapping) -> tuple[dict[str, Any], str]:
    """The engine config of a finished build: an engine (not a checkpoint), for the
    checkpoint's mapping, with every rank file, built by the pinned TensorRT-LLM."""
    path = engine_dir / "config.json"
    config = _read_config(path, "engine")
    where = f"{TRTLLM_BUILD} output {path.name}"
    world = engine_world_size(config, where)
    built = Mapping.from_trtllm(config["pretrained_config"].get("mapping") or {})
    if built != expected:
        raise CheckpointError(f"{where}: the engine's mapping ({built.describe()}) differs from "
                              f"the checkpoint's ({expected.describe()})",
                              "rebuild the checkpoint and the engine")
    missing = [f"rank{r}.engine" for r in range(world)
               if not (engine_dir / f"rank{r}.engine").is_file()]
    if missing:
        raise CheckpointError(f"{TRTLLM_BUILD} finished but {', '.join(missing)} is missing")
    version = engine_config_version(config, where)
    if version != TRTLLM_ENGINE_VERSION:
        raise EnvironmentMissing(f"{TRTLLM_BUILD} here is TensorRT-LLM {version}, but moepipe "
                                 f"builds and deploys with {TRTLLM_ENGINE_VERSION}",
                                 _container_hint())
    return config, version


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _run_logged(argv: list[str], log_path: Path) -> int:
    """Run ``argv`` with stdout and stderr going to ``log_path``; on Ctrl-C (or any error) its
    whole process group is stopped before the exception propagates."""
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
            raise


def build_engine(cfg: MoepipeConfig, checkpoint_dir: Path, output_dir: Path,
                 echo: Callable[[str], None]) -> dict[str, Any]:
    """Build the engine of ``checkpoint_dir`` into ``output_dir`` with ``trtllm-build``.

    Call :func:`check_engine_limits` first. ``trtllm-build`` writes into a temporary sibling of
    ``output_dir`` that replaces it only when the build succeeded and its config.json checks
    out; on failure (or Ctrl-C) the previous engine, if any, is left as it was. The build's
    output goes to ``<output_dir>.trtllm-build.log`` next to it; its tail is shown on failure.
    Returns ``{"trtllm_version", "command" (argv for output_dir), "config" (the engine's)}``.
    """
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = output_dir.parent / f"{output_dir.name}.trtllm-build.log"
    with atomic_dir(output_dir, overwrite=True) as tmp:
        result = build_engine_into(cfg, checkpoint_dir, tmp, log_path, echo)
    result["command"] = trtllm_build_command(cfg, checkpoint_dir, output_dir)
    return result


def build_engine_into(cfg: MoepipeConfig, checkpoint_dir: Path, dest: Path, log_path: Path,
                      echo: Callable[[str], None]) -> dict[str, Any]:
    """Run ``trtllm-build`` into ``dest`` (an empty folder the caller renames into place when
    this returns) and check what it wrote."""
    command = trtllm_build_command(cfg, checkpoint_dir, dest)
    expected = _checkpoint_mapping(checkpoint_dir)
    require_build_environment()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    echo(f"engine: {TRTLLM_BUILD} {expected.describe()} (log: {log_path})")
    start = time.monotonic()
    status = _run_logged(command, log_path)
    if status != 0:
        raise MoepipeError(f"{TRTLLM_BUILD} failed with exit status {status}",
                           f"the full output is in {log_path}", details=_tail(log_path))
    config, version = _check_engine(dest, expected)
    log.info("engine: built %s in %.0fs", dest, time.monotonic() - start)
    return {"trtllm_version": version, "command": command, "config": config}
