"""The Kubernetes memory request of a serving pod comes from the sizing model
(moepipe.sizing.pods): exact weight bytes of the pod's ranks, the cpu runtime's KV cache."""

import math

import pytest

from moepipe.config import parse_config
from moepipe.deploy.cluster.operate import pod_memory
from moepipe.planner.plan import load_model
from moepipe.sizing.gpu import kv_bytes_per_token
from moepipe.sizing.pods import CPU_HEADROOM, GIB, pod_memory_bytes
from moepipe.sizing.weights import Sharding, stage_weight_bytes

# mistralai/Mixtral-8x7B-v0.1 model.safetensors.index.json metadata.total_size (bf16)
MIXTRAL_HF_BYTES = 93_405_585_408


def test_a_gpu_pod_holds_its_share_of_the_published_weights_plus_reserve():
    m = load_model("Mixtral-8x7B")
    s = Sharding(8, 1, 1, 8)
    one_node = pod_memory_bytes(m, s, "trtllm-pytorch", gpus_per_pod=8)
    # every rank's slice of the HF files passes through host memory; the replicated tensors
    # (the embedding, 32000 x 4096 bf16, and the norms and routers) once per rank
    assert one_node == 8 * stage_weight_bytes(m, s, 0, "none", hf_layout=True) + 8 * GIB
    assert 0 < one_node - 8 * GIB - MIXTRAL_HF_BYTES <= 7 * (32000 * 4096 * 2 + 2 ** 25)
    two_nodes = pod_memory_bytes(m, Sharding(8, 2, 1, 8), "trtllm-engine", gpus_per_pod=8)
    s = Sharding(8, 2, 1, 8)
    ranks = 8 * (stage_weight_bytes(m, s, 0, "none") + stage_weight_bytes(m, s, 1, "none"))
    assert two_nodes == math.ceil(ranks / 2) + 8 * GIB  # one node of the two
    fp8 = pod_memory_bytes(m, Sharding(8, 1, 1, 8), "trtllm-engine", fmt="fp8", gpus_per_pod=8)
    assert fp8 < 0.6 * one_node  # GEMM weights in 1 byte; embedding, norms stay bf16


@pytest.mark.parametrize("tp,moe_ep", [(1, 1), (2, 2)])
def test_a_cpu_pod_holds_one_rank_in_float32_and_its_kv_cache(examples, tp, moe_ep):
    # world size > 1 is a rank group with one rank process per pod (moepipe.ranks)
    m = load_model(examples["tiny-mixtral"])
    s = Sharding(tp, 1, tp // moe_ep, moe_ep)
    got = pod_memory_bytes(m, s, "cpu", max_batch_size=4, max_seq_len=256)
    weights = stage_weight_bytes(m, s, 0, "none", "float32")
    kv = kv_bytes_per_token(m, s, m.num_layers, 4) * 4 * 256
    assert tp * kv == 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4 * 4 * 256  # all ranks
    assert got == math.ceil(weights * CPU_HEADROOM) + kv + 2 * GIB


def test_a_cpu_pipeline_stage_pod_is_sized_for_the_larger_stage(examples):
    m = load_model(examples["tiny-mixtral"])
    s = Sharding(1, 2, 1, 1)
    got = pod_memory_bytes(m, s, "cpu", max_batch_size=4, max_seq_len=256)
    per_stage = [math.ceil(stage_weight_bytes(m, s, st, "none", "float32") * CPU_HEADROOM)
                 + kv_bytes_per_token(m, s, m.num_layers // 2, 4) * 4 * 256 for st in (0, 1)]
    assert got == max(per_stage) + 2 * GIB


def test_deploy_uses_the_planner_for_the_configured_mapping(examples, tmp_path):
    cfg = parse_config({"model": {"path": str(examples["tiny-mixtral"])},
                        "parallel": {"tp": 2, "moe_ep": 2}, "workdir": str(tmp_path),
                        "build": {"max_batch_size": 4, "max_input_len": 128, "max_seq_len": 256}})
    m = load_model(examples["tiny-mixtral"])
    want = pod_memory_bytes(m, Sharding(2, 1, 1, 2), "cpu", max_batch_size=4, max_seq_len=256)
    assert pod_memory(cfg) == math.ceil(want / GIB) * 1024
