"""GPUs and clusters the planner knows.

Figures per GPU: memory as aiconfigurator's system files count it (``mem_capacity``, GiB;
ai-dynamo/aiconfigurator ``systems/*.yaml``), HBM bandwidth, NVLink bandwidth per direction
(``intra_node_bw``; PCIe for the L40S, which has no NVLink), inter-node bandwidth per GPU
(``inter_node_bw``: ConnectX-7 400 Gb/s for Hopper and L40S nodes, 200 Gb/s for A100,
ConnectX-8 800 Gb/s for B200) and dense BF16 throughput, from NVIDIA's datasheets and the same
aiconfigurator files. ``formats``: the quantization formats whose kernels the GPU runs (FP8
needs Ada/Hopper or newer, NVFP4 Blackwell).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from moepipe.errors import ConfigError

GIB = 1 << 30
GB = 10**9


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s per direction, inside a node
    internode_bw: float  # bytes/s per GPU, between nodes
    bf16_flops: float  # dense
    formats: tuple[str, ...]
    aiconfigurator_system: str | None  # aiconfigurator's --system name, None where it has none


_ALL = ("none", "int4_awq", "int8_sq")
_FP8 = (*_ALL, "fp8", "fp8_block")

GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("A100-40", 40 * GIB, 1555 * GB, 300 * GB, 25 * GB, 312e12, _ALL, None),
    GPU("A100-80", 80 * GIB, 2039 * GB, 300 * GB, 25 * GB, 312e12, _ALL, "a100_sxm"),
    GPU("H100", 80 * GIB, 3350 * GB, 450 * GB, 50 * GB, 989e12, _FP8, "h100_sxm"),
    GPU("H200", 141 * GIB, 4800 * GB, 450 * GB, 50 * GB, 989e12, _FP8, "h200_sxm"),
    GPU("B200", 180 * GIB, 7700 * GB, 900 * GB, 100 * GB, 2250e12, (*_FP8, "nvfp4"),
        "b200_sxm"),
    GPU("L40S", 46068 << 20, 864 * GB, 32 * GB, 50 * GB, 362e12, _FP8, "l40s"),
)}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def describe(self) -> str:
        if self.nodes > 1:
            return f"{self.nodes}x{self.gpus_per_node}x{self.gpu.name}"
        return f"{self.gpus}x{self.gpu.name}"


def gpu_named(name: str) -> GPU:
    for key, gpu in GPUS.items():
        if key.lower() == name.lower():
            return gpu
    raise ConfigError(f"GPU '{name}' is not in the planner's table",
                      f"choose one of {', '.join(GPUS)}")


_CLUSTER = re.compile(r"(?:(\d{1,6})x)?(\d{1,6})x([A-Za-z0-9-]+)")
MAX_NODES, MAX_GPUS_PER_NODE = 4096, 72  # 72: an NVL72 rack is one NVLink domain
MAX_LINK_GBPS = 100_000.0  # GB/s; 100x the fastest link in the table


def _link(value: float | None, flag: str) -> float | None:
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_LINK_GBPS):
        raise ConfigError(f"{flag} {value:g} is not a link speed",
                          f"give GB/s per direction, more than 0 and at most {MAX_LINK_GBPS:g}")
    return value


def parse_cluster(text: str, nvlink_gbps: float | None = None,
                  internode_gbps: float | None = None) -> Cluster:
    """``8xH100`` (one node) or ``2x8xH100`` (nodes x GPUs per node), with optional
    bandwidth overrides in GB/s; every field checked here, once."""
    m = _CLUSTER.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"cluster {text[:80]!r} is not GPUSxKIND or NODESxGPUSxKIND",
                          "for example 8xH100 or 2x8xH200")
    nodes, per_node, kind = int(m.group(1) or 1), int(m.group(2)), m.group(3)
    if not (1 <= nodes <= MAX_NODES and 1 <= per_node <= MAX_GPUS_PER_NODE):
        raise ConfigError(f"cluster '{text}' needs 1..{MAX_NODES} nodes of "
                          f"1..{MAX_GPUS_PER_NODE} GPUs", "for example 8xH100 or 2x8xH200")
    gpu = gpu_named(kind)
    nvlink, internode = _link(nvlink_gbps, "--nvlink-gbps"), _link(internode_gbps,
                                                                   "--internode-gbps")
    if nvlink is not None:
        gpu = replace(gpu, nvlink_bw=nvlink * GB)
    if internode is not None:
        gpu = replace(gpu, internode_bw=internode * GB)
    return Cluster(gpu, nodes * per_node, per_node)
