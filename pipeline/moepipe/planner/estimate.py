"""Per-mapping estimates: memory per GPU, KV-cache capacity, traffic per token, a roofline time.

Memory (one GPU of the busiest pipeline stage) = weights (exact, :mod:`moepipe.sizing.weights`)
+ activations + MoE workspace + runtime (:func:`moepipe.sizing.gpu.step_reserve`, the engine
pre-flight's formulas). The KV cache (:func:`moepipe.sizing.gpu.kv_bytes_per_token`) gets
``kv_fraction`` of what is left, as TensorRT-LLM's ``free_gpu_memory_fraction`` does, and every
rank gets the smallest stage's block count (TensorRT-LLM min-reduces it over ranks).

Traffic per generated token, per GPU, at uniform routing (NCCL ring factors,
nccl-tests ``doc/PERFORMANCE.md``): TP all-reduce ``2 x layers x H x b x 2(tp-1)/tp`` (after
attention and after the MoE: TensorRT-LLM reduces experts through the same all-reduce unless
attention DP is on); with attention DP, MoE all-to-all ``moe layers x 2 (dispatch + combine) x
top_k x H x b x (ep-1)/ep``, or all-gather + reduce-scatter ``moe layers x 2 x H x b x
(tp-1)/tp`` where TensorRT-LLM uses those (moe_tp > 1, or moe_ep <= top_k:
``_torch/modules/fused_moe/fused_moe_wide_ep.py`` ``select_alltoall_method_type``); pipeline
send ``H x b`` per stage boundary.

Time per decode step is a roofline, not a measurement: weights and KV read at 80 % of the HBM
bandwidth (aiconfigurator's empirical factor), FLOPs at the dense BF16 peak, traffic at the
link bandwidth plus 10 us per collective (aiconfigurator's p2p latency). It orders mappings;
for measured kernels, ``moepipe plan --write`` emits aiconfigurator's inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moepipe.mapping import stage_layers
from moepipe.planner.hardware import Cluster
from moepipe.sizing.gpu import kv_bytes_per_token, step_reserve
from moepipe.sizing.shapes import ModelShape
from moepipe.sizing.weights import Sharding, rank_shape, stage_weight_bytes, tensor_bytes

TOKENS_PER_BLOCK = 32  # LLM-API KvCacheConfig.tokens_per_block (tensorrt_llm/llmapi/llm_args.py)
HBM_EFFICIENCY = 0.8
COLLECTIVE_LATENCY = 10e-6
ACT_BYTES = 2  # activations travel in 16 bits


@dataclass(frozen=True)
class Workload:
    isl: int
    osl: int
    goal: str = "throughput"
    fmt: str = "none"
    kv_bytes: int = 2
    kv_fraction: float = 0.9
    max_num_tokens: int = 8192
    max_batch_size: int = 2048  # LLM-API default (tensorrt_llm/llmapi/llm_args.py)
    hf_layout: bool = False  # weights as the Hugging Face checkpoint stores them
    kv_format: str = "none"  # none | fp8 | int8

    @property
    def seq_len(self) -> int:
        return self.isl + self.osl


@dataclass
class Estimate:
    sharding: Sharding
    replicas: int
    weights: int = 0
    activations: int = 0
    moe_workspace: int = 0
    runtime: int = 0
    kv_budget: int = 0
    kv_bytes_per_token: int = 0
    kv_tokens: int = 0  # per model instance
    max_sequences: int = 0  # per model instance, at isl + osl
    comm: dict[str, int] = field(default_factory=dict)  # bytes per token per GPU
    tpot_s: float = 0.0  # batch 1
    batch: int = 0
    tokens_per_s_per_gpu: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems


def _links(cluster: Cluster, s: Sharding) -> tuple[float, float]:
    """(bandwidth of the TP/EP group, of the pipeline hops): NVLink inside a node."""
    gpu = cluster.gpu
    tp_bw = gpu.nvlink_bw if s.tp <= cluster.gpus_per_node else gpu.internode_bw
    pp_bw = gpu.nvlink_bw if s.world_size <= cluster.gpus_per_node else gpu.internode_bw
    return tp_bw, pp_bw


def _comm(model: ModelShape, s: Sharding, layers: range) -> tuple[dict[str, int], int]:
    """Bytes per token one GPU sends, by kind, and the number of collectives per step."""
    h = model.hidden_size * ACT_BYTES
    moe = sum(model.is_moe_layer(layer) for layer in layers)
    out = {"tp_allreduce": 0, "ep_alltoall": 0, "pp_sendrecv": 0}
    calls = 0
    if s.tp > 1 and not s.attention_dp:
        out["tp_allreduce"] = int(2 * len(layers) * h * 2 * (s.tp - 1) / s.tp)
        calls += 2 * len(layers)
    elif s.tp > 1:  # attention DP: experts exchange tokens
        if s.moe_tp == 1 and s.moe_ep > model.top_k:
            out["ep_alltoall"] = int(moe * 2 * model.top_k * h * (s.moe_ep - 1) / s.moe_ep)
        else:  # all-gather the tokens, reduce-scatter the outputs
            out["ep_alltoall"] = int(moe * 2 * h * (s.tp - 1) / s.tp)
        calls += 2 * moe
    if s.pp > 1:
        out["pp_sendrecv"] = h
        calls += 1
    return out, calls


def _stage_time(model: ModelShape, cluster: Cluster, s: Sharding, stage: int, batch: float,
                w: Workload, weights: int) -> float:
    """Roofline seconds of one decode step of ``batch`` sequences on one stage."""
    layers = stage_layers(model.num_layers, s.pp, stage)
    per_gpu_batch = batch / s.tp if s.attention_dp else batch
    touched = 1 - (1 - 1 / model.num_experts) ** (per_gpu_batch * model.top_k
                                                   if s.attention_dp else batch * model.top_k)
    expert_bytes = _expert_bytes(model, s, layers, w)
    read = weights - expert_bytes * (1 - touched)
    ctx = w.isl + w.osl / 2
    read += per_gpu_batch * ctx * kv_bytes_per_token(model, s, len(layers), w.kv_bytes)
    active = model.active_parameters() * len(layers) / model.num_layers / s.tp
    flops = 2 * active * batch
    t = max(read / (cluster.gpu.hbm_bw * HBM_EFFICIENCY), flops / cluster.gpu.bf16_flops)
    comm, calls = _comm(model, s, layers)
    tp_bw, pp_bw = _links(cluster, s)
    t += (comm["tp_allreduce"] + comm["ep_alltoall"]) * batch / tp_bw
    t += comm["pp_sendrecv"] * batch / pp_bw + calls * COLLECTIVE_LATENCY
    return t


def _expert_bytes(model: ModelShape, s: Sharding, layers: range, w: Workload) -> int:
    moe = sum(model.is_moe_layer(layer) for layer in layers)
    first = next((layer for layer in layers if model.is_moe_layer(layer)), None)
    if first is None:
        return 0
    per_layer = sum(tensor_bytes(t, *rank_shape(t, s), w.fmt, model.dtype)
                    for t in model.layer_tensors(first) if t.experts > 1)
    return moe * per_layer


def estimate(model: ModelShape, cluster: Cluster, s: Sharding, w: Workload) -> Estimate:
    """Everything the plan says about one mapping on ``cluster`` for workload ``w``."""
    est = Estimate(s, replicas=cluster.gpus // s.world_size)
    gpu = cluster.gpu
    tokens = min(w.max_num_tokens, w.max_batch_size * w.seq_len)
    reserve_of = step_reserve(model, s, tokens, ACT_BYTES)
    est.activations = reserve_of["activations"]
    est.moe_workspace = reserve_of["moe_workspace"]
    est.runtime = reserve_of["runtime"]
    reserve = est.activations + est.moe_workspace + est.runtime
    stage_weights = [stage_weight_bytes(model, s, st, w.fmt, hf_layout=w.hf_layout)
                     for st in range(s.pp)]
    kv_tokens = None
    for st, weights in enumerate(stage_weights):
        layers = len(stage_layers(model.num_layers, s.pp, st))
        per_token = kv_bytes_per_token(model, s, layers, w.kv_bytes)
        budget = int(max(gpu.memory - weights - reserve, 0) * w.kv_fraction)
        blocks = budget // (per_token * TOKENS_PER_BLOCK)
        if kv_tokens is None or blocks * TOKENS_PER_BLOCK < kv_tokens:
            kv_tokens = blocks * TOKENS_PER_BLOCK
            est.kv_budget, est.kv_bytes_per_token = budget, per_token
        if weights > est.weights:
            est.weights = weights
    est.kv_tokens = kv_tokens or 0
    blocks_per_seq = math.ceil(w.seq_len / TOKENS_PER_BLOCK)
    est.max_sequences = (est.kv_tokens // TOKENS_PER_BLOCK) // blocks_per_seq
    if s.attention_dp:  # every rank serves its own requests from its own pool
        est.max_sequences *= s.tp
        est.kv_tokens *= s.tp
    layers0 = stage_layers(model.num_layers, s.pp, 0)
    est.comm, _ = _comm(model, s, layers0)
    _check(model, cluster, s, w, est, reserve)
    if est.fits:
        est.tpot_s = sum(_stage_time(model, cluster, s, st, 1, w, stage_weights[st])
                         for st in range(s.pp))
        est.batch = min(est.max_sequences, w.max_batch_size)
        micro = est.batch / s.pp
        cycle = s.pp * max(_stage_time(model, cluster, s, st, micro, w, stage_weights[st])
                           for st in range(s.pp))
        est.tokens_per_s_per_gpu = est.batch / cycle / s.world_size
    return est


def _check(model: ModelShape, cluster: Cluster, s: Sharding, w: Workload, est: Estimate,
           reserve: int) -> None:
    gib = 1 << 30
    mem = cluster.gpu.memory
    if w.fmt not in cluster.gpu.formats:
        est.problems.append(f"{cluster.gpu.name} has no {w.fmt} kernels")
    if w.kv_format == "fp8" and "fp8" not in cluster.gpu.formats:
        est.problems.append(f"{cluster.gpu.name} has no fp8 KV-cache kernels")
    if est.weights + reserve > mem:
        est.problems.append(
            f"weights {est.weights / gib:.1f} GiB + runtime reserve {reserve / gib:.1f} GiB "
            f"exceed the {mem / gib:.0f} GiB of one {cluster.gpu.name}")
    elif est.max_sequences < 1:
        need = est.kv_bytes_per_token * w.seq_len
        est.problems.append(
            f"the KV cache has {est.kv_budget / gib:.2f} GiB per GPU; one sequence of "
            f"{w.seq_len} tokens needs {need / gib:.2f} GiB")
    if s.tp > cluster.gpus_per_node:
        est.notes.append(f"the tp group ({s.tp} GPUs) crosses nodes: its all-reduce runs at "
                         f"{cluster.gpu.internode_bw / 1e9:.0f} GB/s")
    if cluster.gpus % s.world_size:
        est.notes.append(f"{cluster.gpus % s.world_size} GPU(s) left idle")
