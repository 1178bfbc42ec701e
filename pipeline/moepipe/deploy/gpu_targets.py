"""Template values of the two GPU targets (rendered here; they run only on a GPU machine).

``trtllm-engine`` - TensorRT engines + the C++ ``tensorrtllm`` backend
(``targets/trtllm-engine/``: ``model_repo/tensorrt_llm/config.pbtxt`` and ``launch.sh``):

=============================== ==============================================================
value                           source
=============================== ==============================================================
engine_dir                      ``Artifacts.engine_dir``; without one (no GPU here yet)
                                ``<workdir>/engine``, where ``moepipe build`` puts it
logits_datatype                 ``logits_dtype`` of the engine's config.json, else of the
                                converted checkpoint's, else float32 (what moepipe writes)
batching_strategy               ``deploy.trtllm.batching_strategy`` (parameter gpt_model_type)
max_beam_width, ...             ``deploy.trtllm.<same name>``: batch_scheduler_policy,
                                kv_cache_free_gpu_mem_fraction, enable_kv_cache_reuse,
                                enable_chunked_context, normalize_log_probs,
                                cancellation_check_period_ms, stats_check_period_ms,
                                iter_stats_max_iterations, request_stats_max_iterations
optional_parameters             ``deploy.trtllm`` max_tokens_in_paged_kv_cache,
                                max_attention_window_size, decoding_mode: one parameter line
                                each when set, nothing when None (TensorRT-LLM's default)
exclude_input_in_output         ``deploy.exclude_input_in_output``
deploy_dir                      ``cfg.deploy_dir`` (launch.sh serves ``<deploy_dir>/model_repo``)
world_size, tp_size, pp_size    ``parallel`` resolved by :class:`moepipe.trtllm.mapping.Mapping`;
                                world_size = tp x pp
host, http_port, grpc_port,     ``deploy.<same name>``
metrics_port
exit_timeout_secs               ``deploy.exit_timeout_s``
tritonserver                    ``deploy.tritonserver``, else ``tritonserver`` from PATH
trtllm_container                :data:`moepipe.trtllm.versions.TRITON_TRTLLM_CONTAINER` (messages)
=============================== ==============================================================

Literal in the template (facts of the backend, not choices): ``num_nodes`` 1 (launch.sh starts
every rank on one node), ``FORCE_CPU_ONLY_INPUT_TENSORS`` no, ``executor_worker_path`` (the
container's worker binary), and empty ``guided_decoding_backend`` /
``xgrammar_tokenizer_info_path`` (guided decoding off; the backend fails to load without the
keys). ``tokenizer_dir`` is the shared value (``<deploy>/tokenizer``). Left out, so
TensorRT-LLM decides: ``gpu_device_ids`` (leader mode uses the visible GPUs in rank order;
launch.sh checks there are exactly world_size) and ``participant_ids`` (orchestrator mode only).
launch.sh reads the world size, max_beam_width and version from the engine's own config.json at
start and refuses to run when they disagree with the rendered values, the visible GPUs or the
installed TensorRT-LLM. When the engine exists at render time, its world size and its recorded
TensorRT-LLM version (which must be
:data:`moepipe.trtllm.versions.TRTLLM_ENGINE_VERSION`) are checked
already here.

``trtllm-pytorch`` - TensorRT-LLM's PyTorch backend (LLM API) inside a Python model
(``targets/trtllm-pytorch/model_repo/tensorrt_llm/``: ``config.pbtxt``, ``1/model.yaml``,
``1/model.py``):

=============================== ==============================================================
value                           source
=============================== ==============================================================
hf_model_dir                    ``Artifacts.hf_serving_dir``, else ``Artifacts.model_dir``
tensor_parallel_size, ...       ``parallel`` resolved by :class:`moepipe.trtllm.mapping.Mapping`
                                (pipeline, moe_tensor and moe_expert parallel sizes too)
moe_backend                     ``deploy.trtllm.moe_backend`` (moe_config.backend)
max_num_tokens, max_seq_len     ``build.<same name>``; max_batch_size is the shared
                                ``triton_max_batch_size`` (``build.max_batch_size``)
max_beam_width                  ``deploy.trtllm.max_beam_width``
kv_cache_free_gpu_mem_fraction  ``deploy.trtllm`` (kv_cache_config.free_gpu_memory_fraction)
kv_cache_max_tokens             ``deploy.trtllm.max_tokens_in_paged_kv_cache`` (null = unset)
kv_cache_max_attention_window   ``deploy.trtllm.max_attention_window_size`` (null = unset)
enable_kv_cache_reuse           ``deploy.trtllm`` (kv_cache_config.enable_block_reuse)
enable_chunked_context          ``deploy.trtllm`` (enable_chunked_prefill)
capacity_scheduler_policy       ``deploy.trtllm.batch_scheduler_policy``, upper-cased
trust_remote_code               ``model.trust_remote_code``
exclude_input_in_output         ``deploy.exclude_input_in_output`` (config.pbtxt parameter)
trtllm_container                :data:`moepipe.trtllm.versions.TRITON_TRTLLM_CONTAINER` (the error
                                model.py raises where tensorrt_llm is missing)
trtllm_version                  :data:`moepipe.trtllm.versions.TRTLLM_ENGINE_VERSION` (warns
                                model.py when another version is installed)
=============================== ==============================================================

The ``triton_config`` block of model.yaml mirrors config.pbtxt's max_batch_size and decoupled
(the shared ``triton_max_batch_size`` / ``decoupled_mode`` values); model.py checks they agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.errors import CheckpointError, ConfigError, MappingError, MoepipeError
from moepipe.trtllm.mapping import Mapping
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER, TRTLLM_ENGINE_VERSION

if TYPE_CHECKING:  # repository.py imports this module to register the targets
    from moepipe.config import MoepipeConfig
    from moepipe.deploy.repository import Artifacts

# TensorRT-LLM logits_dtype -> Triton data type of context_logits / generation_logits.
LOGITS_DATATYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}
# Characters the rendered files could not carry inside their double quotes (config.pbtxt,
# model.yaml, launch.sh).
_UNQUOTABLE = set('"\\`$\n\r')


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def _quotable(value: str, what: str) -> str:
    bad = sorted(_UNQUOTABLE & set(value))
    if bad:
        raise ConfigError(f"{what} {value!r} contains {' '.join(map(repr, bad))}, which the "
                          "rendered deployment files cannot quote",
                          "use a path / address without quotes, backslashes, '$' or backticks")
    return value


def _mapping(cfg: MoepipeConfig) -> Mapping:
    p = cfg.parallel
    return Mapping.create(tp=p.tp, pp=p.pp, moe_tp=p.moe_tp, moe_ep=p.moe_ep)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


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
        raise MoepipeError(
            f"{where}: the engine was built with TensorRT-LLM {version}, but moepipe deploys "
            f"with TensorRT-LLM {TRTLLM_ENGINE_VERSION} ({TRITON_TRTLLM_CONTAINER})",
            f"rebuild the engine (`moepipe build`) inside {TRITON_TRTLLM_CONTAINER}; or, to "
            f"serve TensorRT-LLM {version} engines, set TRTLLM_VERSION and TRITON_TRTLLM_IMAGE "
            "in docker/versions.env and rebuild moepipe and its image (docker/Dockerfile)")
    return version


def _logits_datatype(engine_cfg: dict[str, Any] | None, art: Artifacts) -> str:
    dtype = None
    if engine_cfg is not None:
        dtype = engine_cfg["pretrained_config"].get("logits_dtype")
    elif art.checkpoint_dir is not None:
        ckpt = _read_json(art.checkpoint_dir / "config.json")
        dtype = ckpt.get("logits_dtype") if ckpt else None
    dtype = dtype or "float32"
    if dtype not in LOGITS_DATATYPES:
        raise CheckpointError(f"logits_dtype '{dtype}' has no Triton data type here; "
                              f"supported: {', '.join(LOGITS_DATATYPES)}")
    return LOGITS_DATATYPES[dtype]


def _parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'


def engine_values(cfg: MoepipeConfig, art: Artifacts, out: Path) -> dict[str, str]:
    """Values of ``targets/trtllm-engine`` (see the module docstring for each source)."""
    t = cfg.deploy.trtllm
    d = cfg.deploy
    mapping = _mapping(cfg)
    engine = (art.engine_dir or cfg.workdir / "engine").resolve()
    engine_cfg = _read_json(engine / "config.json")
    if engine_cfg is not None:  # built already: catch a mismatch now rather than at launch
        built = engine_world_size(engine_cfg, str(engine / "config.json"))
        check_engine_version(engine_cfg, str(engine / "config.json"))
        if built != mapping.world_size:
            raise MappingError(
                f"{engine}: the engine was built for world size {built}, but the config asks "
                f"for tp={mapping.tp} x pp={mapping.pp} = {mapping.world_size}",
                "rebuild the engine (`moepipe build`) or fix parallel.tp / parallel.pp")
    optional = {"max_tokens_in_paged_kv_cache": t.max_tokens_in_paged_kv_cache,
                "max_attention_window_size": t.max_attention_window_size,
                "decoding_mode": t.decoding_mode}
    return {
        "engine_dir": _quotable(str(engine), "engine_dir"),
        "logits_datatype": _logits_datatype(engine_cfg, art),
        "batching_strategy": t.batching_strategy,
        "max_beam_width": str(t.max_beam_width),
        "batch_scheduler_policy": t.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(t.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": _b(t.enable_kv_cache_reuse),
        "enable_chunked_context": _b(t.enable_chunked_context),
        "exclude_input_in_output": _b(d.exclude_input_in_output),
        "normalize_log_probs": _b(t.normalize_log_probs),
        "cancellation_check_period_ms": str(t.cancellation_check_period_ms),
        "stats_check_period_ms": str(t.stats_check_period_ms),
        "iter_stats_max_iterations": str(t.iter_stats_max_iterations),
        "request_stats_max_iterations": str(t.request_stats_max_iterations),
        "optional_parameters": "\n".join(_parameter(k, str(v)) for k, v in optional.items()
                                         if v is not None),
        # launch.sh
        "deploy_dir": _quotable(str(out.resolve()), "deploy.output"),
        "world_size": str(mapping.world_size),
        "tp_size": str(mapping.tp),
        "pp_size": str(mapping.pp),
        "host": _quotable(d.host, "deploy.host"),
        "http_port": str(d.http_port),
        "grpc_port": str(d.grpc_port),
        "metrics_port": str(d.metrics_port),
        "exit_timeout_secs": str(d.exit_timeout_s),
        "tritonserver": _quotable(str(d.tritonserver or "tritonserver"), "deploy.tritonserver"),
        "trtllm_container": TRITON_TRTLLM_CONTAINER,
    }


def pytorch_values(cfg: MoepipeConfig, art: Artifacts, out: Path) -> dict[str, str]:
    """Values of ``targets/trtllm-pytorch`` (see the module docstring for each source)."""
    t = cfg.deploy.trtllm
    mapping = _mapping(cfg)
    model = (art.hf_serving_dir or art.model_dir).resolve()
    window = t.max_attention_window_size
    return {
        "hf_model_dir": _quotable(str(model), "model path"),
        "tensor_parallel_size": str(mapping.tp),
        "pipeline_parallel_size": str(mapping.pp),
        "moe_tensor_parallel_size": str(mapping.moe_tp),
        "moe_expert_parallel_size": str(mapping.moe_ep),
        "moe_backend": t.moe_backend,
        "max_num_tokens": str(cfg.build.max_num_tokens),
        "max_seq_len": str(cfg.build.max_seq_len),
        "max_beam_width": str(t.max_beam_width),
        "kv_cache_free_gpu_mem_fraction": str(t.kv_cache_free_gpu_mem_fraction),
        "kv_cache_max_tokens": json.dumps(t.max_tokens_in_paged_kv_cache),  # null: unset
        "kv_cache_max_attention_window": json.dumps(None if window is None else [window]),
        "enable_kv_cache_reuse": _b(t.enable_kv_cache_reuse),
        "enable_chunked_context": _b(t.enable_chunked_context),
        "capacity_scheduler_policy": t.batch_scheduler_policy.upper(),
        "trust_remote_code": _b(cfg.model.trust_remote_code),
        "exclude_input_in_output": _b(cfg.deploy.exclude_input_in_output),
        "trtllm_container": TRITON_TRTLLM_CONTAINER,
        "trtllm_version": TRTLLM_ENGINE_VERSION,
    }
