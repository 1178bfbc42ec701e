"""A new version of a loaded model's weights, read from a newer build of the same model: only
the tensors the two checkpoints' manifests say changed are read (each rank's from its own rank
file); every other tensor, and everything the runtime made from it, is the previous version's
own object. The previous version is left untouched, so requests that started on it finish on
it while new ones run on the new one.

What may change in place: tensor values, the dtype and the quantization (``config.json``'s
``dtype`` and ``quantization``). Anything else in ``config.json`` (the architecture, its sizes,
the mapping) is a different model: :class:`IncompatibleUpdate`, and the deployment restarts.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moepipe.checkpoints.manifest import CheckpointDiff, diff_checkpoints, rank_file
from moepipe.checkpoints.reader import load_file
from moepipe.errors import MoepipeError
from moepipe.runtime.checkpoint import read_config, with_tensors
from moepipe.runtime.model import ReferenceModel

# config.json keys a weight update may change: they change how tensors are stored, not the model
MUTABLE_CONFIG = frozenset({"dtype", "quantization"})


class IncompatibleUpdate(MoepipeError):
    """The new build is another model (architecture, sizes or mapping differ)."""


def structure_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The ``config.json`` keys that differ between two checkpoints, other than
    :data:`MUTABLE_CONFIG` (empty: the same model, new weights)."""
    keys = sorted((set(old) | set(new)) - MUTABLE_CONFIG)
    return [k for k in keys if old.get(k) != new.get(k)]


@dataclass
class WeightUpdate:
    """A loaded new version and what loading it cost."""

    model: ReferenceModel
    diff: CheckpointDiff
    read_bytes: int  # tensor bytes read from the new rank files
    extra_bytes: int  # memory the new version holds that the previous one does not share
    seconds: float


def load_update(current: ReferenceModel, new_dir: str | Path) -> WeightUpdate:
    """The weights of checkpoint ``new_dir`` as a new :class:`ReferenceModel` beside
    ``current``, sharing every tensor that did not change."""
    started = time.perf_counter()
    new_dir = Path(new_dir).resolve()
    old = current.ckpt
    cfg = read_config(new_dir)
    changed = structure_changes(old.config, cfg)
    if changed:
        raise IncompatibleUpdate(
            f"{new_dir} is not the same model as the one serving ({', '.join(changed)} "
            "differ in config.json)", "only new weights of the same model update in place")
    ranks = sorted(old.ranks)  # a rank process holds (and reads) its own rank only
    diff = diff_checkpoints(Path(old.path), new_dir, old.mapping.world_size, ranks)
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    read = 0
    for rank in ranks:
        d = diff.ranks[rank]
        fresh = load_file(new_dir / rank_file(rank), d.changed) if d.changed else {}
        read += sum(t.nbytes for t in fresh.values())
        gone = set(d.removed)
        tensors[rank] = {**{n: t for n, t in old.ranks[rank].items()
                            if n not in gone and n not in fresh}, **fresh}
    model = ReferenceModel(with_tensors(new_dir, cfg, tensors), current.route, current.comm,
                           previous=current)
    before = storages(current)
    extra = sum(n for ptr, n in storages(model).items() if ptr not in before)
    return WeightUpdate(model, diff, read, extra, time.perf_counter() - started)


def storages(model: ReferenceModel) -> dict[int, int]:
    """data pointer -> bytes of every tensor storage the model holds (its checkpoint's
    tensors and everything made from them): what two versions share, or not."""
    out: dict[int, int] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.numel():
                storage = obj.untyped_storage()
                out[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, list | tuple):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):  # layers, ranks, activation quantizers
                visit(getattr(obj, f.name))

    visit(model.ckpt.ranks)
    visit(model.layers)
    visit([model.embedding, model.ln_f, model.lm_head])
    return out
