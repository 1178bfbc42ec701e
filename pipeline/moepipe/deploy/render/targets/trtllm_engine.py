"""Template values of the two GPU targets (rendered here; they run only on a GPU machine).

``trtllm-engine`` - TensorRT engines + the C++ ``tensorrtllm`` backend
(``targets/trtllm-engine/``: ``model_repo/tensorrt_llm/config.pbtxt`` and ``launch.sh``):

=============================== ==============================================================
value                           source
=============================== ==============================================================
engine_dir                      ``Artifacts.engine_dir``; without one (no GPU here yet)
                                ``<workdir>/engine``, where ``moepipe build`` puts it; as
                                it is when served: under ``deploy.serve_root``
engine_tokenizer_dir            ``<deploy>/tokenizer`` under ``deploy.serve_root`` (the C++
                                backend's tokenizer_dir is absolute)
logits_datatype                 ``logits_dtype`` of the engine's config.json; before the engine
                                exists ``build.logits_dtype`` (what trtllm-build is given), as
                                the backend checks that they agree
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
deploy_dir                      ``cfg.deploy_dir`` under ``deploy.serve_root`` (launch.sh
                                serves ``<deploy_dir>/model_repo``)
world_size, tp_size, pp_size    ``parallel`` resolved by :class:`moepipe.mapping.Mapping`;
                                world_size = tp x pp
host, http_port, grpc_port,     ``deploy.<same name>`` (launch.sh's message)
metrics_port
tritonserver                    ``deploy.tritonserver``, else ``tritonserver`` from PATH
mpi_ranks                       every rank's flags:
                                :meth:`moepipe.deploy.tritonserver.ServerCommand.mpi_ranks`
raise_stack                     :data:`moepipe.deploy.tritonserver.RAISE_STACK`
trtllm_container                :data:`moepipe.trtllm.versions.TRITON_TRTLLM_CONTAINER` (messages)
=============================== ==============================================================

Literal in the template (facts of the backend, not choices): ``num_nodes`` 1 (launch.sh starts
every rank on one node), ``FORCE_CPU_ONLY_INPUT_TENSORS`` no, ``executor_worker_path`` (the
container's worker binary), and empty ``guided_decoding_backend`` /
``xgrammar_tokenizer_info_path`` (guided decoding off; the backend fails to load without the
keys). Left out, so
TensorRT-LLM decides: ``gpu_device_ids`` (leader mode uses the visible GPUs in rank order;
launch.sh checks there are exactly world_size) and ``participant_ids`` (orchestrator mode only).
launch.sh reads the world size, max_beam_width and version from the engine's own config.json at
start and refuses to run when they disagree with the rendered values, the visible GPUs or the
installed TensorRT-LLM. When the engine exists at render time, its world size and its recorded
TensorRT-LLM version (which must be
:data:`moepipe.trtllm.versions.TRTLLM_ENGINE_VERSION`) are checked
already here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.deploy.render.targets.base import LOGITS_DATATYPES, Artifacts, flag, quotable
from moepipe.deploy.serve_paths import ServePaths
from moepipe.deploy.tritonserver import RAISE_STACK, ServerCommand
from moepipe.errors import CheckpointError, MappingError
from moepipe.trtllm.engine import check_engine_version, engine_world_size
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER
from moepipe.utils.fs import read_json

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig

def _read_json_if(path: Path) -> dict[str, Any] | None:
    return read_json(path, "its folder") if path.is_file() else None


def _logits_datatype(engine_cfg: dict[str, Any] | None, cfg: MoepipeConfig) -> str:
    """The C++ backend checks that the engine's logits have the config's data type."""
    dtype = cfg.build.logits_dtype
    if engine_cfg is not None:
        dtype = engine_cfg["pretrained_config"].get("logits_dtype") or "float32"
    if dtype not in LOGITS_DATATYPES:
        raise CheckpointError(f"logits_dtype '{dtype}' has no Triton data type here; "
                              f"supported: {', '.join(LOGITS_DATATYPES)}")
    return LOGITS_DATATYPES[dtype]


def _parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'


def values(cfg: MoepipeConfig, art: Artifacts, paths: ServePaths) -> dict[str, str]:
    """Values of ``targets/trtllm-engine`` (see the module docstring for each source)."""
    t = cfg.deploy.trtllm
    d = cfg.deploy
    mapping = cfg.parallel.to_mapping()
    engine = (art.engine_dir or cfg.workdir / "engine").resolve()
    engine_cfg = _read_json_if(engine / "config.json")
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
        "engine_dir": quotable(paths.absolute(engine, "the engine"), "engine_dir"),
        # the C++ backend reads it by absolute path (the Python models' is relative)
        "engine_tokenizer_dir": quotable(paths.absolute(paths.deploy_dir / "tokenizer",
                                                        "the tokenizer"), "tokenizer_dir"),
        "logits_datatype": _logits_datatype(engine_cfg, cfg),
        "batching_strategy": t.batching_strategy,
        "max_beam_width": str(t.max_beam_width),
        "batch_scheduler_policy": t.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(t.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": flag(t.enable_kv_cache_reuse),
        "enable_chunked_context": flag(t.enable_chunked_context),
        "exclude_input_in_output": flag(d.exclude_input_in_output),
        "normalize_log_probs": flag(t.normalize_log_probs),
        "cancellation_check_period_ms": str(t.cancellation_check_period_ms),
        "stats_check_period_ms": str(t.stats_check_period_ms),
        "iter_stats_max_iterations": str(t.iter_stats_max_iterations),
        "request_stats_max_iterations": str(t.request_stats_max_iterations),
        "optional_parameters": "\n".join(_parameter(k, str(v)) for k, v in optional.items()
                                         if v is not None),
        # launch.sh
        "deploy_dir": quotable(paths.absolute(paths.deploy_dir, "deploy.output"),
                               "deploy.output"),
        "world_size": str(mapping.world_size),
        "tp_size": str(mapping.tp),
        "pp_size": str(mapping.pp),
        "host": quotable(d.host, "deploy.host"),
        "http_port": str(d.http_port),
        "grpc_port": str(d.grpc_port),
        "metrics_port": str(d.metrics_port),
        "tritonserver": quotable(str(d.tritonserver or "tritonserver"), "deploy.tritonserver"),
        "mpi_ranks": ServerCommand.of(cfg, Path(paths.repository()))
        .mpi_ranks('"$TRITONSERVER"', '"$WORLD_SIZE"'),
        "raise_stack": RAISE_STACK,
        "trtllm_container": TRITON_TRTLLM_CONTAINER,
    }
