"""How much host memory this process can still allocate, and how many cores it may use
(cgroup-aware)."""

from __future__ import annotations

import math
import os
from pathlib import Path


def available_cpus() -> int:
    """Cores this process may run on: its CPU affinity, or fewer where a cgroup's CPU quota
    (``cpu.max``: a container, a Kubernetes pod's limit) allows less."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def available_memory() -> int:
    """Bytes this process can still allocate: the machine's available memory, or less where
    a cgroup (a container, a Kubernetes pod, a CI runner) limits it."""
    import psutil

    available = int(psutil.virtual_memory().available)
    limit = _cgroup_room()
    return available if limit is None else min(available, limit)


def _cgroup_room() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2 or v1), None without a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and line.startswith("0::"):  # v2
            base = Path("/sys/fs/cgroup") / rel.strip().lstrip("/")
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            base = Path("/sys/fs/cgroup/memory") / rel.strip().lstrip("/")
            if not base.is_dir():
                base = Path("/sys/fs/cgroup/memory")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        try:
            limit = (base / files[0]).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # v1 writes a huge number for none
                continue
            return max(int(limit) - int((base / files[1]).read_text()), 0)
        except (OSError, ValueError):
            continue
    return None
