"""``trtllm-pytorch`` - TensorRT-LLM's PyTorch backend (LLM API) inside a Python model
(``targets/trtllm-pytorch/model_repo/tensorrt_llm/``: ``config.pbtxt``, ``1/model.yaml``,
``1/model.py``):

=============================== ==============================================================
value                           source
=============================== ==============================================================
hf_model_dir                    ``Artifacts.hf_serving_dir``, else ``Artifacts.model_dir``:
                                relative to the model's folder, which model.py resolves
                                against ``args["model_repository"]`` (a checkpoint outside
                                the workdir: its path under ``deploy.serve_root``)
tensor_parallel_size, ...       ``parallel`` resolved by :class:`moepipe.mapping.Mapping`
                                (pipeline, moe_tensor and moe_expert parallel sizes too)
moe_backend                     ``deploy.trtllm.moe_backend`` (moe_config.backend)
enable_attention_dp             ``parallel.attention_dp``
moe_load_balancer               ``deploy.trtllm.expert_placement``'s ``load_balancer`` (checked by
                                :mod:`moepipe.trtllm.load_balancer`), null without one
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
expert_statistic_iters, _path   ``deploy.trtllm.expert_statistic`` as TensorRT-LLM's
                                ``EXPERT_STATISTIC_ITER_RANGE`` and the folder
                                (``<workdir>/expert-statistic``); empty when off. model.py sets
                                them where the server's environment lacks them and exports the
                                counts (:mod:`moepipe.trtllm.expert_statistic`, shipped beside it)
=============================== ==============================================================

The ``triton_config`` block of model.yaml mirrors config.pbtxt's max_batch_size and decoupled
(the shared ``triton_max_batch_size`` / ``decoupled_mode`` values); model.py checks they agree.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import yaml

from moepipe.deploy.render.targets.base import Artifacts, flag, quotable
from moepipe.deploy.serve_paths import ServePaths
from moepipe.mapping import Mapping
from moepipe.trtllm.expert_statistic import ENV_ITER_RANGE, ENV_PATH, environment
from moepipe.trtllm.load_balancer import read_placement
from moepipe.trtllm.versions import TRITON_TRTLLM_CONTAINER, TRTLLM_ENGINE_VERSION

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig


def values(cfg: MoepipeConfig, art: Artifacts, paths: ServePaths) -> dict[str, str]:
    """Values of ``targets/trtllm-pytorch`` (see the module docstring for each source)."""
    t = cfg.deploy.trtllm
    mapping = cfg.parallel.to_mapping()
    model = paths.from_model(art.hf_serving_dir or art.model_dir, "the served checkpoint")
    window = t.max_attention_window_size
    return {
        "hf_model_dir": quotable(model, "model path"),
        "tensor_parallel_size": str(mapping.tp),
        "pipeline_parallel_size": str(mapping.pp),
        "moe_tensor_parallel_size": str(mapping.moe_tp),
        "moe_expert_parallel_size": str(mapping.moe_ep),
        "moe_backend": t.moe_backend,
        "enable_attention_dp": flag(cfg.parallel.attention_dp),
        "moe_load_balancer": _load_balancer(cfg, mapping),
        "max_num_tokens": str(cfg.build.max_num_tokens),
        "max_seq_len": str(cfg.build.max_seq_len),
        "max_beam_width": str(t.max_beam_width),
        "kv_cache_free_gpu_mem_fraction": str(t.kv_cache_free_gpu_mem_fraction),
        "kv_cache_max_tokens": json.dumps(t.max_tokens_in_paged_kv_cache),  # null: unset
        "kv_cache_max_attention_window": json.dumps(None if window is None else [window]),
        "enable_kv_cache_reuse": flag(t.enable_kv_cache_reuse),
        "enable_chunked_context": flag(t.enable_chunked_context),
        "capacity_scheduler_policy": t.batch_scheduler_policy.upper(),
        "trust_remote_code": flag(cfg.model.trust_remote_code),
        "exclude_input_in_output": flag(cfg.deploy.exclude_input_in_output),
        "trtllm_container": TRITON_TRTLLM_CONTAINER,
        "trtllm_version": TRTLLM_ENGINE_VERSION,
        **_expert_statistic(cfg, paths),
    }


def _expert_statistic(cfg: MoepipeConfig, paths: ServePaths) -> dict[str, str]:
    window = cfg.deploy.trtllm.expert_statistic
    if window is None:
        return {"expert_statistic_iters": "", "expert_statistic_path": ""}
    # where the server writes them: the workdir as it is served (deploy.serve_root)
    env = environment(window.start, window.stop,
                      paths.absolute(cfg.expert_statistic_dir, "the expert statistics"))
    return {"expert_statistic_iters": env[ENV_ITER_RANGE],
            "expert_statistic_path": quotable(env[ENV_PATH], "workdir")}


def _load_balancer(cfg: MoepipeConfig, mapping: Mapping) -> str:
    """``moe_config.load_balancer`` as a YAML flow mapping (integer layer keys), or null."""
    path = cfg.deploy.trtllm.expert_placement
    if path is None:
        return "null"
    block = read_placement(path, mapping.moe_ep)
    return yaml.safe_dump(block, default_flow_style=True, width=1 << 30).strip()
