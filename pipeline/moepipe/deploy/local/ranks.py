"""The worker ranks of a local deployment whose ``tensorrt_llm`` model is rank 0 of a rank
group (cpu target, world size > 1): what the rendered deployment says about the group, and
starting its workers (``python -m moepipe.ranks.worker``, one process per rank 1..W-1, each
logging to ``<state dir>/rank{r}.log``). They carry the deployment's tag
(:func:`moepipe.deploy.local.processes.tagged`), so stop, status and the next deploy find them
as part of the deployment; the supervisor starts them again when the group loses a rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from moepipe.deploy.local import processes
from moepipe.deploy.local.binary import server_env

# Written by moepipe.deploy.render.repository next to model_repo/: the rendered values.
MANIFEST = "moepipe-deploy.json"


@dataclass(frozen=True)
class RankGroup:
    world_size: int
    leader: str  # host:port where rank 0 listens
    checkpoint: str
    connect_timeout_s: float

    @classmethod
    def of(cls, repository: Path) -> RankGroup | None:
        """The group of the deployment rendered at ``repository`` (None: a single process)."""
        try:
            values = json.loads((Path(repository).parent / MANIFEST).read_text())["values"]
            world = int(values.get("world_size") or 1)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if world <= 1 or not values.get("rank_listen"):
            return None
        # rendered relative to the tensorrt_llm model's folder (moepipe.deploy.serve_paths)
        checkpoint = Path(repository).resolve() / "tensorrt_llm" / values["checkpoint_dir"]
        return cls(world, values["rank_listen"], os.path.normpath(checkpoint),
                   float(values.get("rank_form_timeout_s") or 180))


def start_workers(group: RankGroup, repository: Path, state_dir: Path) -> dict[int, int]:
    """Start ranks 1..W-1 (detached, like the server); returns rank -> pid."""
    pids = {}
    for rank in range(1, group.world_size):
        with open(state_dir / f"rank{rank}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", processes.RANK_MODULE, "--leader", group.leader,
                 "--rank", str(rank), "--checkpoint", group.checkpoint,
                 "--connect-timeout", f"{group.connect_timeout_s:g}",
                 "--deployment", str(repository)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=processes.tagged(server_env(), state_dir), start_new_session=True)
        pids[rank] = proc.pid
    return pids


def dead_ranks(ranks: dict[int, int] | None) -> list[str]:
    """The recorded worker ranks whose process is gone."""
    return [f"rank {r} (pid {pid})" for r, pid in sorted((ranks or {}).items())
            if not processes.alive(pid)]
