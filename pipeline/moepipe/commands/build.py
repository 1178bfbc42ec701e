"""``moepipe build``: a cached, resumable pipeline of stages.

Each stage has a fingerprint: its version, the config values that shape its output, the
fingerprints of the stages it reads, and the versions of the tools it runs. Its output lives in
``<workdir>/artifacts/<stage>-<fingerprint>`` and is written to a temporary sibling that is
renamed into place only when complete. So a rerun with nothing changed finds every output and
does no work; a changed section reruns the stages it reaches; a build killed at any point leaves
no output that looks complete and the next build resumes from the last finished stage.
``<workdir>/build-manifest.json`` records the config, every stage's fingerprint, outputs with
their BLAKE3 digests (key ``"blake3"``), tool versions and timings;
``<workdir>/{model,checkpoint,...}`` are links to the current outputs.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shlex
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from moepipe import __version__
from moepipe.checkpoints.digest import ALGORITHM
from moepipe.config import MoepipeConfig, load_config
from moepipe.errors import MoepipeError
from moepipe.stages.base import BuildContext, Echo, Stage, fault_point
from moepipe.stages.integrity import (
    STAGE_FILE,
    changed_output,
    check_stage_disk,
    read_record,
    recorded_digests,
    write_stage_record,
)
from moepipe.stages.registry import STAGES
from moepipe.utils.fs import atomic_dir, write_text_atomic
from moepipe.utils.memory import available_memory
from moepipe.utils.oserrors import check_workdir, describe_os_error
from moepipe.utils.progress import task

MANIFEST = "build-manifest.json"
log = logging.getLogger("moepipe")


def check_host_memory(ctx: BuildContext, stage: Stage) -> None:
    """Refuse to start ``stage`` when its estimated peak exceeds the available memory."""
    if stage.memory is None:
        return
    need, have = stage.memory(ctx), available_memory()
    if need > have:
        hint = stage.memory_hint if isinstance(stage.memory_hint, str) else \
            stage.memory_hint(ctx)
        raise MoepipeError(
            f"{stage.name} needs about {need / 2**30:.1f} GiB of host memory; only "
            f"{have / 2**30:.1f} GiB is available", hint)


def _tool_versions(names: tuple[str, ...]) -> dict[str, str]:
    return {name: _tool_version(name) for name in names}


@functools.cache
def _tool_version(name: str) -> str:
    """Installed version of a distribution (cached: reading package metadata is slow)."""
    from moepipe.trtllm.versions import TRTLLM_ENGINE_VERSION

    if name == "tensorrt-llm":  # not installable here: the declared version is the input
        return TRTLLM_ENGINE_VERSION
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def fingerprint(stage: Stage, cfg: MoepipeConfig, upstream: dict[str, str],
                extra: dict[str, Any] | None = None) -> str:
    blob = {"stage": stage.name, "version": stage.version, "moepipe": __version__,
            "settings": stage.settings(cfg),
            "inputs": {n: upstream[n] for n in stage.inputs if n in upstream},
            "tools": _tool_versions(stage.tools), **(extra or {})}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def artifact_dir(cfg: MoepipeConfig, stage: str, fp: str) -> Path:
    return cfg.workdir / "artifacts" / f"{stage}-{fp[:16]}"


def _complete(path: Path, fp: str) -> tuple[bool, str | None]:
    """(complete for ``fp`` and unchanged since, why a complete output cannot be reused)."""
    record = read_record(path)
    if record is None or record.get("fingerprint") != fp:
        return False, None
    changed = changed_output(path, record)
    return changed is None, changed


@dataclass
class PlanEntry:
    stage: Stage
    fingerprint: str
    output: Path
    cached: bool
    forced: bool = False
    changed: str | None = None  # why a finished output cannot be reused (it was modified)

    @property
    def action(self) -> str:
        return "run" if self.forced or not self.cached else "reuse"


def plan(cfg: MoepipeConfig, force: tuple[str, ...] = (),
         until: str | None = None) -> list[PlanEntry]:
    """Fingerprints and cache state of every stage the config needs, up to ``until``
    (no side effects)."""
    names = [s.name for s in STAGES]
    unknown = sorted((set(force) | ({until} if until else set())) - set(names))
    if unknown:
        raise MoepipeError(f"unknown stage(s) {', '.join(unknown)}",
                           f"stages: {', '.join(names)}")
    fps: dict[str, str] = {}
    entries = []
    for stage in STAGES:
        if not stage.needed(cfg):
            continue
        extra = stage.external(cfg) if stage.external is not None else None
        fp = fingerprint(stage, cfg, fps, extra)
        fps[stage.name] = fp
        in_place = stage.in_place(cfg) if stage.in_place is not None else None
        changed = None
        if in_place is not None:
            out, cached = in_place, True  # the user's folder is used in place
        else:
            out = artifact_dir(cfg, stage.name, fp)
            cached, changed = _complete(out, fp)
        entries.append(PlanEntry(stage, fp, out, cached, stage.name in force, changed))
        if stage.name == until:
            break
    return entries


@contextlib.contextmanager
def _lock(workdir: Path) -> Iterator[None]:
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / ".build.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MoepipeError(f"another `moepipe build` is running in {workdir}",
                               "wait for it to finish") from None
        yield


def _clean_partials(cfg: MoepipeConfig) -> None:
    """Remove what builds killed mid-stage left behind (never mistaken for outputs)."""
    root = cfg.workdir / "artifacts"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".") and ".partial-" in p.name:
                shutil.rmtree(p, ignore_errors=True)


def _scratch(entry: PlanEntry) -> Path:
    """The resumable stage's scratch folder for this fingerprint; those of its other
    fingerprints (a config changed since a build was killed) are removed."""
    folder = entry.output.with_name(f".{entry.output.name}.resume")
    for old in entry.output.parent.glob(f".{entry.stage.name}-*.resume"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _link(cfg: MoepipeConfig, stage: Stage, target: Path) -> None:
    """Point ``<workdir>/<stage.link>`` at the stage's current output (atomically)."""
    if stage.link is None:
        return
    link = cfg.workdir / stage.link
    if link.exists() and not link.is_symlink():
        raise MoepipeError(f"{link} exists and is not a moepipe link", "move it away")
    tmp = cfg.workdir / f".{stage.link}.link-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    try:
        os.replace(tmp, link)
    finally:
        tmp.unlink(missing_ok=True)


def run_build(config: Path | None, echo: Echo = print, force: tuple[str, ...] = (),
              dry_run: bool = False, until: str | None = None) -> dict:
    """Build what ``config`` needs (each stage a progress task: :mod:`moepipe.utils.progress`)."""
    cfg = load_config(config)
    check_workdir(cfg.workdir)
    if dry_run:
        return print_plan(cfg, force, echo, until)
    with _lock(cfg.workdir):
        _clean_partials(cfg)
        return _build(cfg, echo, force, until)


def _stage_details(entry: PlanEntry) -> dict[str, Any]:
    try:
        return json.loads((entry.output / STAGE_FILE).read_text()).get("details", {})
    except (OSError, ValueError):
        return {}


def _build(cfg: MoepipeConfig, echo: Echo, force: tuple[str, ...],
           until: str | None) -> dict:
    ctx = BuildContext(cfg, echo)
    entries = plan(cfg, force, until)
    for entry in entries:  # where it will fail, fail before hours of work
        ctx.add(entry.stage, entry.output)
        if entry.action == "run" and entry.stage.preflight is not None:
            entry.stage.preflight(ctx)
    ctx.outputs.clear()
    ctx.hf_outputs.clear()
    started = time.time()
    records = []
    for entry in entries:
        name = entry.stage.name
        t0 = time.perf_counter()
        if entry.action == "reuse":
            status = "reused"
            ctx.details[name] = _stage_details(entry)
        else:
            if entry.changed:
                echo(f"{name:9} {entry.output.name}: {entry.changed}; building it again")
            ctx.stage, ctx.steps = name, 0
            check_host_memory(ctx, entry.stage)
            needed = check_stage_disk(ctx, entry.stage, entry.output)
            entry.output.parent.mkdir(parents=True, exist_ok=True)
            ctx.scratch = _scratch(entry) if entry.stage.resumable else None
            try:
                with atomic_dir(entry.output, overwrite=True) as tmp, \
                        task(name) as running:
                    ctx.status = running.say
                    details = entry.stage.run(ctx, tmp) or {}
                    fault_point(name)
                    write_stage_record(tmp, name, entry.fingerprint, details)
            except OSError as e:  # a disk that filled up (or went read-only) mid-stage
                raise describe_os_error(e, needed) from None
            if ctx.scratch is not None:
                shutil.rmtree(ctx.scratch, ignore_errors=True)
            ctx.details[name] = details
            status = "built"
        ctx.add(entry.stage, entry.output)
        ctx.fingerprints[name] = entry.fingerprint
        seconds = time.perf_counter() - t0
        echo(f"{name:9} {status:6} {entry.fingerprint[:12]}  {entry.output}  ({seconds:.2f}s)")
        records.append({"stage": name, "fingerprint": entry.fingerprint, "status": status,
                        "output": str(entry.output), "seconds": round(seconds, 3),
                        "tools": _tool_versions(entry.stage.tools),
                        "details": ctx.details[name]})
        _link(cfg, entry.stage, entry.output)
        _write_manifest(cfg, records, started)
        if entry.stage.check is not None:
            entry.stage.check(cfg, ctx.details[name])
    for rec in records:  # digests last: a build that only reuses stages hashes nothing new
        rec[ALGORITHM] = recorded_digests(Path(str(rec["output"])))
    return _write_manifest(cfg, records, started, finished=True)


def _write_manifest(cfg: MoepipeConfig, records: list[dict], started: float,
                    finished: bool = False) -> dict:
    manifest = {
        "moepipe": __version__, "target": cfg.target,
        "config": cfg.model_dump(mode="json", by_alias=True),
        "stages": records, "started": started,
        "finished": time.time() if finished else None,
        "tools": _tool_versions(("torch", "transformers", "safetensors", "nvidia-modelopt",
                                 "tensorrt-llm", "tritonclient")),
    }
    write_text_atomic(cfg.workdir / MANIFEST, json.dumps(manifest, indent=2, default=str) + "\n")
    return manifest


def print_plan(cfg: MoepipeConfig, force: tuple[str, ...], echo: Echo,
               until: str | None = None) -> dict:
    """``--dry-run``: stages to run or reuse, their commands and memory estimates."""
    entries = plan(cfg, force, until)
    ctx = BuildContext(cfg, echo)
    stages: list[dict[str, Any]] = []
    out: dict[str, Any] = {"target": cfg.target, "stages": stages}
    echo(f"build plan for target {cfg.target} (workdir {cfg.workdir}):")
    for e in entries:
        ctx.add(e.stage, e.output)
        info = e.stage.estimate(ctx) if e.stage.estimate else {}
        echo(f"  {e.stage.name:9} {e.action:6} {e.fingerprint[:12]}  {e.output}")
        for key, value in info.items():
            if isinstance(value, list):
                value = " ".join(shlex.quote(str(v)) for v in value)
            echo(f"      {key}: {value}")
        stages.append({"stage": e.stage.name, "action": e.action,
                              "fingerprint": e.fingerprint, "output": str(e.output), **info})
    return out


# -- what other commands read ---------------------------------------------------------------
def outputs(cfg: MoepipeConfig, optional: tuple[str, ...] = ()) -> dict[str, Path]:
    """stage -> output folder, for every stage the config needs; each must be built for the
    config as it is now (and pass its gates), except the ``optional`` ones."""
    if not (cfg.workdir / MANIFEST).is_file():
        raise MoepipeError(f"{cfg.workdir}: nothing has been built here",
                           "run `moepipe build` first")
    out = {}
    for entry in plan(cfg):
        if not entry.cached:
            if entry.changed:
                raise MoepipeError(f"the {entry.stage.name} output {entry.output} no longer "
                                   f"matches what the build recorded: {entry.changed}",
                                   "run `moepipe build` to build it again")
            if entry.stage.name in optional:
                continue
            raise MoepipeError(f"the {entry.stage.name} stage is not built for the config as "
                               "it is now", "run `moepipe build`")
        if entry.stage.check is not None:
            entry.stage.check(cfg, _stage_details(entry))
        out[entry.stage.name] = entry.output
    return out


def model_dir(cfg: MoepipeConfig) -> Path:
    """The source Hugging Face checkpoint of the config."""
    if cfg.model.path is not None:
        return cfg.model.path
    entry = next(e for e in plan(cfg) if e.stage.hf_checkpoint)
    if not entry.cached:
        raise MoepipeError(f"the example {cfg.model.example} has not been built in "
                           f"{cfg.workdir}", "run `moepipe build` first")
    return entry.output


# The stage whose output each kind of artifact is: its fingerprint is the deployment's version
# (``hf``: the quantize stage's checkpoint where it runs, else the source).
SERVED_STAGE = {"checkpoint": "convert", "engine": "engine"}


def served_version(cfg: MoepipeConfig) -> str:
    """The build fingerprint of what the config's deployment serves (12 hex digits): its
    version in status, metrics, reports and live updates."""
    from moepipe.targets import get_target

    fps = {e.stage.name: e.fingerprint for e in plan(cfg)}
    stage = SERVED_STAGE.get(get_target(cfg.target).artifact) or \
        ("quantize" if "quantize" in fps else "source")
    return fps.get(stage, fps["source"])[:12]
