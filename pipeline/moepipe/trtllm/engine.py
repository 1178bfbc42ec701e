"""TensorRT-LLM 1.2 engines: the ``trtllm-build`` command, the GPU memory its limits imply (by the
sizing model of :mod:`moepipe.sizing`), and reading an engine's (or checkpoint's)
``config.json`` back.

Everything here runs anywhere; only :mod:`moepipe.stages.engine` runs ``trtllm-build``.
Sources of the flags and rules: ``tensorrt_llm/commands/build.py``, ``builder.py``
(``BuildConfig``) and ``plugin/plugin.py`` (``PluginConfig``) of TensorRT-LLM 1.2.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.checkpoints.dtypes import itemsize
from moepipe.errors import CheckpointError, ConfigError, EnvironmentMissing, UnsupportedError
from moepipe.mapping import Mapping, check_mapping, stage_layers
from moepipe.sizing.gpu import kv_bytes_per_token, kv_itemsize, step_reserve
from moepipe.sizing.shapes import shape_of
from moepipe.sizing.weights import Sharding, stage_weight_bytes
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER, TRTLLM_ENGINE_VERSION
from moepipe.utils.fs import read_json

if TYPE_CHECKING:
    from moepipe.arch.spec import ModelSpec
    from moepipe.config import BuildSection, MoepipeConfig

TRTLLM_BUILD = "trtllm-build"
# trtllm-build with moepipe's routing plugin in every MoE layer (build.plugins.router: moepipe;
# moepipe.plugins.trtllm_build, a console script of the moepipe package)
MOEPIPE_TRTLLM_BUILD = "moepipe-trtllm-build"
GIB = 1 << 30


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
    argv = [MOEPIPE_TRTLLM_BUILD if b.plugins.router == "moepipe" else TRTLLM_BUILD,
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


def engine_memory(cfg: MoepipeConfig, spec: ModelSpec, mapping: Mapping) -> dict[str, int]:
    """Bytes one GPU needs for the engine limits of ``cfg.build``, on the busiest pipeline
    stage: ``weights``, ``kv_cache``, ``activations``, ``moe_workspace``, ``runtime`` and
    ``total`` (their sum), from the one sizing model (:mod:`moepipe.sizing`):

    * weights: the stage's tensors in TensorRT-LLM's checkpoint layout as one rank holds them
      (:func:`moepipe.sizing.weights.stage_weight_bytes`: DeepSeek's dense first layers and
      MLA projections as they are, routers in float32, GEMM weights in ``quantize.format``);
    * kv_cache: the stage's KV bytes per token (:func:`moepipe.sizing.gpu.kv_bytes_per_token`,
      in the model dtype or the quantized cache's) x max_batch_size x (max_input_len +
      max_beam_width x (max_seq_len - max_input_len)): every request at full length,
      generated tokens per beam;
    * activations, moe_workspace, runtime: :func:`moepipe.sizing.gpu.step_reserve` with
      T = min(max_num_tokens, max_batch_size x max_seq_len) tokens per step in the model
      dtype (attention DP = 1 on the engine path).
    """
    check_mapping(spec, mapping)
    b, q = cfg.build, cfg.quantize
    dtype = spec.torch_dtype if cfg.model.dtype == "auto" else cfg.model.dtype
    shape = shape_of(spec)
    s = Sharding(mapping.tp, mapping.pp, mapping.moe_tp, mapping.moe_ep)
    tokens_per_step = min(b.max_num_tokens, b.max_batch_size * b.max_seq_len)
    kv_tokens = b.max_batch_size * (b.max_input_len
                                    + b.max_beam_width * (b.max_seq_len - b.max_input_len))
    reserve = step_reserve(shape, s, tokens_per_step, itemsize(dtype))
    kv_bytes = kv_itemsize(q.kv_cache, dtype)
    busiest: dict[str, int] = {}
    for stage in range(mapping.pp):
        layers = len(stage_layers(spec.num_layers, mapping.pp, stage))
        usage = {"weights": stage_weight_bytes(shape, s, stage, q.format, dtype),
                 "kv_cache": kv_bytes_per_token(shape, s, layers, kv_bytes) * kv_tokens,
                 **reserve}
        usage["total"] = sum(usage.values())
        if not busiest or usage["total"] > busiest["total"]:
            busiest = usage
    return busiest


def _check_format(cfg: MoepipeConfig, spec: ModelSpec) -> None:
    """int8_sq (W8A8_SQ_PER_CHANNEL) takes TensorRT-LLM 1.2's non-plugin SmoothQuant path
    (``smooth_quantize_ootb``: it is not in ``W8A8_SQ_PLUGIN_LIST``), which quantizes the linear
    layers and leaves the norms alone; the MoE block is excluded, and ``quantize_layers``
    re-creates an excluded MoE as a plain ``MixtureOfExperts`` with ``QuantMode(0)``
    (``tensorrt_llm/quantization/quantize.py``, ``mode.py``). That keeps Mixtral-style routed
    experts in the model dtype, but a shared expert (Qwen2-MoE's ``SharedMoE``) would be lost."""
    if cfg.quantize.format == "int8_sq" and spec.shared_expert_intermediate_size:
        raise UnsupportedError(
            "quantize.format int8_sq on trtllm-engine: TensorRT-LLM 1.2 keeps a SmoothQuant "
            "model's MoE block unquantized by re-creating it as a plain MixtureOfExperts, "
            "which drops this model's shared expert",
            "use fp8 or int4_awq for this model on GPUs (int8_sq is served by the cpu target)")


def check_engine_limits(cfg: MoepipeConfig, spec: ModelSpec, mapping: Mapping
                        ) -> dict[str, int]:
    """Refuse engine limits that cannot work, with the numbers and what to change: limits that
    contradict each other or the model, options TensorRT-LLM rejects together, and limits whose
    memory (:func:`engine_memory`) exceeds ``build.gpu_memory_gb``. Returns the estimate."""
    b, t = cfg.build, cfg.deploy.trtllm
    _check_flags(b)
    _check_format(cfg, spec)
    # max_input_len < max_seq_len is the config model's rule (config.BuildSection).
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
    usage = engine_memory(cfg, spec, mapping)
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


def checkpoint_mapping(checkpoint_dir: Path) -> Mapping:
    path = Path(checkpoint_dir) / "config.json"
    ckpt = read_json(path, "a TensorRT-LLM checkpoint folder")
    if "pretrained_config" in ckpt or not isinstance(ckpt.get("mapping"), dict):
        raise CheckpointError(f"{path} is not a TensorRT-LLM checkpoint config (no top-level "
                              "mapping; is it an engine?)", "run the convert stage first")
    return Mapping.from_trtllm(ckpt["mapping"])


def engine_world_size(config: dict[str, Any], where: str = "engine config.json") -> int:
    """World size of a TensorRT-LLM engine from its ``config.json`` (the same rule launch.sh
    applies at start: ``pretrained_config.mapping.world_size``, else tp x pp x cp)."""
    if not isinstance(config.get("pretrained_config"), dict) \
            or not isinstance(config.get("build_config"), dict):
        raise CheckpointError(f"{where} is not a TensorRT-LLM engine config (no "
                              "pretrained_config and build_config; is it a checkpoint?)")
    mapping = config["pretrained_config"].get("mapping") or {}
    tp, pp, cp = (int(mapping.get(k) or 1) for k in ("tp_size", "pp_size", "cp_size"))
    world = int(mapping.get("world_size") or tp * pp * cp)
    if world != tp * pp * cp:
        raise CheckpointError(f"{where}: mapping.world_size {world} != tp_size {tp} x pp_size "
                              f"{pp} x cp_size {cp}")
    return world


def engine_config_version(config: dict[str, Any], where: str = "engine config.json") -> str:
    """The TensorRT-LLM version that built an engine (``version`` of its ``config.json``, which
    trtllm-build writes from ``tensorrt_llm.__version__``)."""
    version = config.get("version")
    if not isinstance(version, str) or not version.strip() or len(version.split()) != 1:
        raise CheckpointError(f"{where} records no TensorRT-LLM version (got {version!r})",
                              "rebuild the engine with `moepipe build`")
    return version.strip()


def check_engine_version(config: dict[str, Any], where: str) -> str:
    """Refuse an engine built by a TensorRT-LLM other than the pinned one: engines are not
    portable across TensorRT-LLM (or TensorRT) versions, and the deployment runs in the
    container of :data:`TRTLLM_ENGINE_VERSION`."""
    version = engine_config_version(config, where)
    if version != TRTLLM_ENGINE_VERSION:
        raise EnvironmentMissing(
            f"{where}: the engine was built with TensorRT-LLM {version}, but moepipe builds "
            f"and deploys with TensorRT-LLM {TRTLLM_ENGINE_VERSION} ({TRITON_TRTLLM_CONTAINER})",
            f"rebuild the engine (`moepipe build`) inside {TRITON_TRTLLM_CONTAINER}; or, to "
            f"serve TensorRT-LLM {version} engines, set TRTLLM_VERSION and TRITON_TRTLLM_IMAGE "
            "in docker/versions.env and rebuild moepipe and its image (docker/Dockerfile)")
    return version


