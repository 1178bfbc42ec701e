"""The scratch folder of layer-by-layer quantization, which lets a killed run resume at the
first unfinished segment.

It holds each finished segment's shard (``segment-NNNNN.safetensors``), the inputs of the next
segment (``activations.safetensors``: the previous decoder layer's outputs, one tensor per
calibration pass and batch, passes that are equal held once) and ``state.json``, which names
them with their sizes and the records of the finished segments. Every file is complete before
it has its name (written as ``.<name>.tmp``, then renamed), and ``state.json`` is renamed last:
after a kill, what it names is whole, and anything else is removed when the next run opens the
folder. A run whose calibration differs (``key``) starts again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.checkpoints.dtypes import BY_TORCH_NAME
from moepipe.checkpoints.reader import load_file, parse_header
from moepipe.checkpoints.writer import SafetensorsWriter

if TYPE_CHECKING:
    import torch

STATE = "state.json"
ACTIVATIONS = "activations.safetensors"


class Scratch:
    """Finished segments (``records``, in order) and the files that go with them."""

    def __init__(self, folder: Path, key: str, total: int, records: list[dict[str, Any]]):
        self.folder, self.key, self.total, self.records = folder, key, total, records

    @property
    def done(self) -> int:
        """Segments finished (the first one to run)."""
        return len(self.records)

    @classmethod
    def open(cls, folder: Path, key: str, total: int) -> Scratch:
        """The folder's finished segments when it belongs to the same calibration (``key``)
        of a model of ``total`` segments; anything half-written is removed."""
        folder.mkdir(parents=True, exist_ok=True)
        records: list[dict[str, Any]] = []
        try:
            data = json.loads((folder / STATE).read_text())
            if data.get("key") == key and data.get("total") == total:
                records = list(data["records"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        intact = all((folder / r["file"]).is_file()
                     and (folder / r["file"]).stat().st_size == r["file_size"] for r in records)
        if not intact or (2 <= len(records) < total and not (folder / ACTIVATIONS).is_file()):
            records = []
        keep = {r["file"] for r in records} | ({STATE, ACTIVATIONS} if records else set())
        for path in folder.iterdir():
            if path.name not in keep:
                path.unlink()
        return cls(folder, key, total, records)

    def finish(self, segment: int, record: dict[str, Any], tensors: dict[str, torch.Tensor],
               outputs: list[list[torch.Tensor]] | None) -> None:
        """Write segment ``segment``'s shard and, when a segment follows that reads them, its
        outputs; then the state that names them."""
        name = f"segment-{segment:05d}.safetensors"
        record = dict(record, file=name, names=sorted(tensors),
                      bytes=write_tensors(self.folder / name, tensors))
        record["file_size"] = (self.folder / name).stat().st_size
        if outputs is not None:
            self._save_activations(outputs)
        self.records.append(record)
        tmp = self.folder / f".{STATE}.tmp"
        tmp.write_text(json.dumps({"key": self.key, "total": self.total,
                                   "records": self.records}) + "\n")
        os.replace(tmp, self.folder / STATE)

    def _save_activations(self, passes: list[list[torch.Tensor]]) -> None:
        distinct: list[list[torch.Tensor]] = []
        order = []
        for p in passes:
            if not any(p is d for d in distinct):
                distinct.append(p)
            order.append(next(i for i, d in enumerate(distinct) if d is p))
        tensors = {f"p{i}.b{b}": t for i, p in enumerate(distinct) for b, t in enumerate(p)}
        write_tensors(self.folder / ACTIVATIONS, tensors, {"passes": json.dumps(order)})

    def activations(self) -> list[list[torch.Tensor]]:
        """The inputs of the first unfinished segment, per calibration pass."""
        path = self.folder / ACTIVATIONS
        parse_header(path)  # validated: size, offsets
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            order = json.loads(json.loads(f.read(length))["__metadata__"]["passes"])
        tensors = load_file(path)
        distinct = [[tensors[f"p{i}.b{b}"]
                     for b in range(sum(k.startswith(f"p{i}.") for k in tensors))]
                    for i in range(max(order) + 1)]
        return [distinct[i] for i in order]

    def move_shards(self, out: Path) -> dict[str, str]:
        """Rename the shards into ``out`` under transformers' names; returns the weight map."""
        from moepipe.quant.unified import shard_name

        weight_map = {}
        for i, r in enumerate(self.records):
            final = shard_name(i, len(self.records))
            os.replace(self.folder / r["file"], out / final)
            weight_map.update(dict.fromkeys(r["names"], final))
        return weight_map


    def clear(self) -> None:
        """The run is complete: nothing is left to resume."""
        for name in (STATE, ACTIVATIONS):
            (self.folder / name).unlink(missing_ok=True)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (in name order) as a safetensors file that has its name only when
    complete; returns the bytes of tensor data."""
    names = sorted(tensors)
    entries = [(n, BY_TORCH_NAME[str(tensors[n].dtype).removeprefix("torch.")],
                tuple(tensors[n].shape)) for n in names]
    tmp = path.with_name(f".{path.name}.tmp")
    writer = SafetensorsWriter(tmp, entries, {"format": "pt", **(metadata or {})})
    try:
        for n in names:
            if tensors[n].numel():
                writer.write(tensors[n].detach().cpu())
        writer.close()
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())
