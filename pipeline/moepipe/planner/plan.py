"""``moepipe plan``: every legal mapping of a model on a cluster, estimated and ranked.

A model is a checkpoint folder, a built-in example or a bare ``config.json`` (published
configs plan without weights). For each legal (tp, pp, moe_tp, moe_ep) - and, on the
trtllm-pytorch target, each with attention data parallelism - :func:`moepipe.plan.estimate`
gives memory, KV capacity, traffic and a roofline time; mappings that do not fit are ranked
last with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moepipe.errors import ConfigError
from moepipe.mapping import legal_mappings
from moepipe.planner.estimate import Estimate, Workload, estimate
from moepipe.planner.hardware import Cluster
from moepipe.sizing.shapes import ModelShape, load_shape, model_shape
from moepipe.sizing.weights import FORMATS, Sharding, model_bytes
from moepipe.targets import Target, get_target
from moepipe.utils.cost import usd_per_million

# Published config.json files shipped with moepipe (plan without downloading anything):
# mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3
# (their Hugging Face model repositories; README.md of this folder lists the sources).
CONFIGS = Path(__file__).parent / "configs"
PUBLISHED = {
    "Mixtral-8x7B": CONFIGS / "mixtral-8x7b.json",
    "Qwen3-30B-A3B": CONFIGS / "qwen3-30b-a3b.json",
    "Qwen3-235B-A22B": CONFIGS / "qwen3-235b-a22b.json",
    "DeepSeek-V3": CONFIGS / "deepseek-v3.json",
}
HF_IDS = {"Mixtral-8x7B": "mistralai/Mixtral-8x7B-v0.1", "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B",
          "Qwen3-235B-A22B": "Qwen/Qwen3-235B-A22B", "DeepSeek-V3": "deepseek-ai/DeepSeek-V3"}
GOALS = ("throughput", "latency")
MAX_NUM_TOKENS = 1 << 24  # tokens per engine step


@dataclass
class Plan:
    model: ModelShape
    cluster: Cluster
    workload: Workload
    target: str
    candidates: list[Estimate]
    host_memory: dict[str, int]
    notes: list[str] = field(default_factory=list)
    usd_per_gpu_hour: float | None = None  # prices the roofline's throughput
    dense: Plan | None = None  # the dense model of the same parameters, same cluster

    def usd_per_million_output_tokens(self, e: Estimate) -> float | None:
        """US$ per million output tokens of a mapping at its roofline throughput."""
        if self.usd_per_gpu_hour is None or not e.fits:
            return None
        return usd_per_million(self.usd_per_gpu_hour, e.tokens_per_s_per_gpu)

    @property
    def best(self) -> Estimate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None


def load_model(source: str | Path) -> ModelShape:
    """A model from a checkpoint folder, a ``config.json`` file, a published config's name
    (:data:`PUBLISHED`) or a built-in example."""
    from moepipe.examples import EXAMPLES

    if str(source) in PUBLISHED:
        cfg = json.loads(PUBLISHED[str(source)].read_text())
        return model_shape(cfg, str(source), str(PUBLISHED[str(source)]))
    shape = load_shape(source)
    if shape is None:
        raise ConfigError(f"model '{source}' is neither a folder, a config.json, a published "
                          "model nor an example",
                          f"published: {', '.join(PUBLISHED)}; examples: {', '.join(EXAMPLES)}")
    return shape


def candidates(model: ModelShape, max_world: int, target: str) -> list[Sharding]:
    """Legal shardings with at most ``max_world`` GPUs (powers of two, as ``inspect``), each
    also with attention data parallelism where the target has it."""
    attention_dp = get_target(target).attention_dp
    out = []
    for m in legal_mappings(model, max_world):
        out.append(Sharding(m.tp, m.pp, m.moe_tp, m.moe_ep))
        if attention_dp and m.tp > 1:
            out.append(Sharding(m.tp, m.pp, m.moe_tp, m.moe_ep, attention_dp=True))
    return out


def host_memory(model: ModelShape) -> dict[str, int]:
    """Peak host RAM of the build stages: convert (streams; a column slice reads a whole
    tensor, cut and cast: three copies of the largest) and quantize (one decoder layer at a
    time in float32 with the default calibration: ``moepipe.quant.memory``)."""
    from moepipe.config import CalibrationSection
    from moepipe.conversion.write import peak_memory
    from moepipe.quant.memory import quantize_memory

    cal = CalibrationSection()
    return {"convert": peak_memory(model.largest_tensor_bytes()),
            "quantize": quantize_memory(model.largest_layer_parameters(),
                                        model.vocab_size * model.hidden_size,
                                        model.hidden_size, cal.samples * cal.seq_len)}


def make_plan(model: ModelShape, cluster: Cluster, workload: Workload,
              target: str = "trtllm-pytorch", usd_per_gpu_hour: float | None = None) -> Plan:
    """Estimate and rank every legal mapping of ``model`` on ``cluster``; with a price, also
    plan the dense model of the same parameters (:meth:`ModelShape.dense`) to compare."""
    if usd_per_gpu_hour is not None and not 0 < usd_per_gpu_hour < float("inf"):
        raise ConfigError(f"--usd-per-gpu-hour {usd_per_gpu_hour:g} is not a price",
                          "a positive number of US$, e.g. 2.5")
    if workload.goal not in GOALS:
        raise ConfigError(f"goal '{workload.goal}' is unknown", f"choose {' or '.join(GOALS)}")
    served = get_target(target)  # an unknown target lists the supported ones
    if workload.fmt not in FORMATS:
        raise ConfigError(f"quantization format '{workload.fmt}' is unknown",
                          f"choose one of {', '.join(FORMATS)}")
    if workload.isl < 1 or workload.osl < 1:
        raise ConfigError("input and output lengths must be at least 1 token")
    if workload.seq_len > model.max_position_embeddings:
        raise ConfigError(f"isl + osl = {workload.seq_len} exceeds the model's "
                          f"max_position_embeddings ({model.max_position_embeddings})",
                          "plan shorter sequences")
    if not 1 <= workload.max_num_tokens <= MAX_NUM_TOKENS:
        raise ConfigError(f"max_num_tokens {workload.max_num_tokens} is outside "
                          f"1..{MAX_NUM_TOKENS}", "TensorRT-LLM's default is 8192")
    if not 0 < workload.kv_fraction < 1:
        raise ConfigError(f"the KV-cache memory fraction must be in (0, 1), got "
                          f"{workload.kv_fraction}", "TensorRT-LLM's default is 0.9")
    # the weights as the target's artifact holds them (the HF checkpoint, or TensorRT-LLM's)
    workload = replace(workload, hf_layout=served.hf_layout)
    ests = [estimate(model, cluster, s, workload)
            for s in candidates(model, cluster.gpus, target)]
    if workload.goal == "latency":
        key = lambda e: (not e.fits, e.tpot_s, -e.max_sequences)  # noqa: E731
    else:
        key = lambda e: (not e.fits, -e.tokens_per_s_per_gpu, e.tpot_s)  # noqa: E731
    refusal = _not_served(model, served)
    if refusal:
        for e in ests:
            e.problems.append(refusal)
    fitting = sorted((e for e in ests if e.fits), key=key)
    others = sorted((e for e in ests if not e.fits), key=lambda e: e.weights)
    plan = Plan(model, cluster, workload, target, fitting + others, host_memory(model),
                usd_per_gpu_hour=usd_per_gpu_hour)
    if usd_per_gpu_hour is not None and model.num_experts > 1:
        plan.dense = make_plan(model.dense(), cluster, workload, target, usd_per_gpu_hour)
    return plan


def _not_served(model: ModelShape, target: Target) -> str | None:
    """Why ``target`` cannot serve this model (:meth:`Target.family_problem`)."""
    from moepipe.arch import get_family

    return target.family_problem(get_family(model.architecture), model.spec)


def model_summary(model: ModelShape, fmt: str) -> dict[str, Any]:
    return {"name": model.name, "architecture": model.architecture,
            "parameters": model.parameters(), "active_parameters": model.active_parameters(),
            "attention": "MLA" if model.mla else "GQA", "layers": model.num_layers,
            "moe_layers": model.moe_layers, "experts": model.num_experts, "top_k": model.top_k,
            "weight_bytes": model_bytes(model, fmt)}
