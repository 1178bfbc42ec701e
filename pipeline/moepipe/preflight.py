"""Host-memory pre-flight: estimate a stage's peak RAM from the model's shapes and the options,
and refuse to start when this machine does not have it (with the estimate and what to change).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moepipe.errors import MoepipeError

if TYPE_CHECKING:
    from moepipe.commands.build import BuildContext, Stage

# Python, numpy and moepipe's modules, measured (about 60 MB) plus headroom.
CONVERT_BASE = 150 << 20


def convert_memory(ctx: BuildContext) -> int:
    """The converter streams 1 MiB blocks (16 in flight); a column slice (row-parallel weights
    at tp > 1, expert down-projections at moe_tp > 1) reads one whole source tensor, cuts it
    and may cast it: about three copies of the largest such tensor."""
    from moepipe.checkpoints.hf import open_hf_checkpoint
    from moepipe.checkpoints.st_io import CheckpointReader
    from moepipe.stages.convert import BLOCK_BYTES
    from moepipe.stages.registry import mapping_of

    source = ctx.outputs.get("quantize") or ctx.outputs.get("source")
    mapping = mapping_of(ctx.cfg)
    largest = 0  # casts of contiguous data happen block by block: no whole-tensor copy
    if (mapping.tp > 1 or mapping.moe_tp > 1) and source is not None \
            and (source / "config.json").is_file():
        open_hf_checkpoint(source)  # clear errors for a broken folder
        with CheckpointReader(source) as reader:
            largest = max(i.nbytes for i in reader.tensors.values())
    return CONVERT_BASE + 16 * BLOCK_BYTES + 3 * largest


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


def check_host_memory(ctx: BuildContext, stage: Stage) -> None:
    """Refuse to start ``stage`` when its estimated peak exceeds the available memory."""
    if stage.memory is None:
        return
    need, have = stage.memory(ctx), available_memory()
    if need > have:
        raise MoepipeError(
            f"{stage.name} needs about {need / 2**30:.1f} GiB of host memory; only "
            f"{have / 2**30:.1f} GiB is available", stage.memory_hint)
