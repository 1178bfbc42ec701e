"""TensorRT-LLM 1.2 engines: the ``trtllm-build`` command, the GPU memory its limits imply, and
reading an engine's (or checkpoint's) ``config.json`` back.

Everything here runs anywhere; only :mod:`moepipe.stages.engine` runs ``trtllm-build``.
Sources of the flags and rules: ``tensorrt_llm/commands/build.py``, ``builder.py``
(``BuildConfig``) and ``plugin/plugin.py`` (``PluginConfig``) of TensorRT-LLM 1.2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.arch.mla import DeepseekSpec
from moepipe.errors import CheckpointError, ConfigError, EnvironmentMissing, UnsupportedError
from moepipe.mapping import Mapping, check_mapping, stage_layers
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


def layer_params(spec: ModelSpec) -> int:
    """Parameters of one (MoE) decoder layer, as counted in its Hugging Face checkpoint."""
    return _layer_params(spec, 1, spec.num_kv_heads, spec.num_experts,
                         spec.expert_intermediate_size)


def model_params(spec: ModelSpec) -> int:
    """Parameters of the whole model (as counted in its Hugging Face checkpoint); q/k norms of
    a few hundred elements per layer are left out here and per rank alike."""
    outer = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return spec.num_layers * layer_params(spec) + outer + spec.hidden_size


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


def _kv_width(spec: ModelSpec, kv_heads: int) -> int:
    """KV-cache elements per token and layer on one rank: K and V of the rank's KV heads, or
    MLA's one latent (kv_lora_rank + qk_rope_head_dim, one head, replicated over tp)."""
    if isinstance(spec, DeepseekSpec):
        return spec.kv_lora_rank + spec.qk_rope_head_dim
    return 2 * kv_heads * spec.head_dim


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
      kv_dtype_bytes (MLA: layers x (kv_lora_rank + qk_rope_head_dim) x tokens x bytes),
      tokens = max_batch_size x (max_input_len + max_beam_width x (max_seq_len -
      max_input_len)): every request at full length, generated tokens per beam (TensorRT-LLM's
      per-rank KV size: local layers, KV heads duplicated when fewer than tp);
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
            "kv_cache": layers * _kv_width(spec, kv_heads) * kv_tokens * kv_dtype_bytes,
            "activations": activations,
            "moe_workspace": moe_workspace,
            "runtime": runtime,
        }
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


def check_engine_limits(cfg: MoepipeConfig, spec: ModelSpec, mapping: Mapping,
                        weight_bytes: int, kv_dtype_bytes: int) -> dict[str, int]:
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


