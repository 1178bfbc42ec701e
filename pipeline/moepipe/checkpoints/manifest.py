"""A converted checkpoint's manifest (``moepipe-manifest.json``, written by the converter) and
what it says about two checkpoints: which tensors of which rank file differ.

The manifest lists every output file's BLAKE3 digest and, since live updates, every tensor's
(``"tensors": {"blake3": {file: {tensor: digest}}}``). :func:`diff_checkpoints` compares two
of them: a rank file whose digest is unchanged is unchanged whole; in a changed one, the tensors
whose digests differ (or that are new) are what a live update reads. A manifest without tensor
digests (a checkpoint converted by an older moepipe) makes every tensor of a changed rank file
count as changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moepipe.checkpoints.digest import ALGORITHM
from moepipe.checkpoints.reader import parse_header
from moepipe.errors import CheckpointError

MANIFEST = "moepipe-manifest.json"


def read_manifest(folder: Path) -> dict[str, Any]:
    """The converter's manifest of ``folder``; a clear error where there is none."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no {MANIFEST}",
                              "a live update compares checkpoints written by `moepipe build`"
                              ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})", "build it again") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a moepipe manifest", "build it again")
    return data


def file_digests(manifest: dict[str, Any]) -> dict[str, str]:
    """file name -> BLAKE3 of the output files the manifest lists."""
    return dict((manifest.get("output") or {}).get(ALGORITHM) or {})


def tensor_digests(manifest: dict[str, Any]) -> dict[str, dict[str, str]] | None:
    """rank file -> tensor -> BLAKE3 of its bytes; None for a manifest without them."""
    tensors = (manifest.get("tensors") or {}).get(ALGORITHM)
    return tensors if isinstance(tensors, dict) else None


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


@dataclass
class RankDiff:
    """What differs in one rank file between two checkpoints."""

    changed: list[str] = field(default_factory=list)  # to read from the new file
    removed: list[str] = field(default_factory=list)  # in the old file only
    unchanged: int = 0  # tensors kept as they are
    changed_bytes: int = 0  # what reading ``changed`` reads (as stored in the file)
    by_file: bool = False  # no tensor digests: the file's digest decided for all its tensors


@dataclass
class CheckpointDiff:
    """Per rank: the tensors a live update reads; and whether ``config.json`` changed."""

    ranks: dict[int, RankDiff]
    config_changed: bool

    @property
    def changed_tensors(self) -> int:
        return sum(len(r.changed) for r in self.ranks.values())

    @property
    def total_tensors(self) -> int:
        return sum(len(r.changed) + r.unchanged for r in self.ranks.values())

    @property
    def changed_bytes(self) -> int:
        return sum(r.changed_bytes for r in self.ranks.values())

    @property
    def nothing(self) -> bool:
        return not self.config_changed and not any(r.changed or r.removed
                                                   for r in self.ranks.values())


def diff_checkpoints(old: Path, new: Path, world_size: int,
                     ranks: list[int] | None = None) -> CheckpointDiff:
    """Which tensors of ``ranks`` (default: all) differ from checkpoint ``old`` to ``new``:
    from their manifests, and the safetensors headers of the new rank files (their names and
    sizes); no tensor data is read."""
    a, b = read_manifest(old), read_manifest(new)
    fa, fb = file_digests(a), file_digests(b)
    ta, tb = tensor_digests(a) or {}, tensor_digests(b) or {}
    out: dict[int, RankDiff] = {}
    for rank in range(world_size) if ranks is None else ranks:
        name = rank_file(rank)
        if name not in fb:
            raise CheckpointError(f"{new / MANIFEST} lists no {name}",
                                  "the checkpoint is incomplete; build it again")
        infos = parse_header(new / name)
        if name in ta and name in tb:
            old_t, new_t = ta[name], tb[name]
            diff = RankDiff(changed=[t for t in infos if old_t.get(t) != new_t.get(t)],
                            removed=[t for t in old_t if t not in new_t])
        elif fa.get(name) == fb[name]:
            diff = RankDiff(by_file=True)
        else:
            old_names = set(parse_header(old / name)) if (old / name).is_file() else set()
            diff = RankDiff(changed=list(infos), removed=sorted(old_names - set(infos)),
                            by_file=True)
        diff.unchanged = len(infos) - len(diff.changed)
        diff.changed_bytes = sum(infos[t].nbytes for t in diff.changed)
        out[rank] = diff
    return CheckpointDiff(out, fa.get("config.json") != fb.get("config.json"))
