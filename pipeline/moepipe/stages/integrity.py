"""What a finished stage wrote, and whether it is still there unchanged.

A stage's record (``moepipe-stage.json``, written last) lists every output file with its size,
mtime and BLAKE3 digest (under the key ``"blake3"``; records of older versions name
``"sha256"``). Reusing the stage checks each file cheaply: it must exist with the recorded
size; when its mtime moved, its digest is computed and compared. So a deleted rank file or a
flipped byte is found before a build reuses the output or a deploy serves it, and an untouched
output costs one ``stat`` per file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moepipe.utils.fs import STAGE_FILE
from moepipe.utils.oserrors import check_disk_space

if TYPE_CHECKING:
    from moepipe.stages.base import BuildContext, Stage



def _files(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != STAGE_FILE]


def write_stage_record(folder: Path, stage: str, fingerprint: str,
                       details: dict[str, Any]) -> None:
    """Write the record that marks ``folder`` complete: details and every file's size,
    mtime and digest (a digest its writer remembered while writing it is not computed again:
    the converter's rank files are not read back)."""
    from moepipe.checkpoints.digest import ALGORITHM, file_digest
    from moepipe.checkpoints.hashcache import lookup

    files = {}
    for p in _files(folder):
        st = p.stat()
        digest = lookup(p) or file_digest(p)
        files[str(p.relative_to(folder))] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                             ALGORITHM: digest}
    (folder / STAGE_FILE).write_text(json.dumps(
        {"stage": stage, "fingerprint": fingerprint, "details": details, "files": files},
        indent=2, sort_keys=True, default=str) + "\n")


def read_record(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / STAGE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def changed_output(folder: Path, record: dict[str, Any] | None = None) -> str | None:
    """Why ``folder`` no longer holds what its stage recorded (None: it does). Records of
    older moepipe versions list no files and are taken as they are; their sha256 digests are
    checked with sha256."""
    from moepipe.checkpoints.digest import ALGORITHMS, file_digest

    record = read_record(folder) if record is None else record
    files = (record or {}).get("files")
    if not isinstance(files, dict):
        return None
    for rel, want in sorted(files.items()):
        path = folder / rel
        try:
            st = path.stat()
        except OSError:
            return f"{rel} is missing"
        if st.st_size != want.get("size"):
            return f"{rel} has {st.st_size} bytes, {want.get('size')} were written"
        if st.st_mtime_ns == want.get("mtime_ns"):
            continue
        algorithm = next((a for a in ALGORITHMS if a in want), None)
        if algorithm is None or file_digest(path, algorithm) != want[algorithm]:
            return f"{rel} was modified (its {algorithm} digest differs from the one recorded)"
    return None


def recorded_digests(folder: Path) -> dict[str, str]:
    """relative path -> BLAKE3 of a verified output (from its record; an older record, which
    lists sha256 or nothing, is hashed once through the hash cache)."""
    from moepipe.checkpoints.digest import ALGORITHM
    from moepipe.checkpoints.hashcache import cached_digest

    files = (read_record(folder) or {}).get("files")
    if isinstance(files, dict) and all(ALGORITHM in info for info in files.values()):
        return {rel: info[ALGORITHM] for rel, info in sorted(files.items())}
    return {str(p.relative_to(folder)): cached_digest(p) for p in _files(folder)}


def check_stage_disk(ctx: BuildContext, stage: Stage, output: Path) -> int | None:
    """Refuse to run ``stage`` when its output cannot fit on the workdir's disk; returns the
    estimate (bytes) for the message of a disk that fills up anyway."""
    if stage.disk is None:
        return None
    needed = stage.disk(ctx)
    check_disk_space(output.parent, needed, f"the {stage.name} stage")
    return needed
