"""``moepipe deploy`` against a running cpu deployment: new weights of the same model are
swapped in while it serves; anything else restarts it.

1. What changed: the target, the ports, any rendered setting other than the checkpoint, the
   tokenizer, or the checkpoint's ``config.json`` beyond dtype / quantization (the
   architecture, its sizes, the mapping) restart the server (:func:`why_restart` says which, in
   one line). Otherwise:
2. stage: the model loads the tensors whose digests changed as a new version beside the serving
   one; in a rank group every rank process reads its own rank file's changed tensors;
3. validate: smoke and accuracy (greedy tokens against transformers on the new build) run
   through the live server on requests pinned to the new version, beside the traffic; a
   failure drops it: the old version keeps serving and the deploy fails with the reason;
4. switch: the engine serves the new version from its next step; requests admitted before
   finish on the old one, which is released when the last of them ends;
5. the deployment folder is rendered for the new build (a restart serves it) and
   ``versions.json`` remembers the version before, which ``--rollback`` returns to the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moepipe.config import MoepipeConfig
from moepipe.deploy.render.targets import Artifacts
from moepipe.errors import MoepipeError

# rendered values a live update changes (the others restart the server)
LIVE_VALUES = frozenset({"checkpoint_dir", "weights_version"})
VALIDATION_JOBS = ("smoke", "accuracy")


class UpdateRejected(MoepipeError):
    """The new weights failed their validation; the old version keeps serving."""

    exit_code = 1


@dataclass
class Release:
    """A build that can serve: what ``versions.json`` records of it."""

    version: str
    checkpoint: str
    model_dir: str
    vocab_size: int

    @classmethod
    def of(cls, art: Artifacts) -> Release:
        if art.checkpoint_dir is None:
            raise MoepipeError("no converted checkpoint to serve", "run `moepipe build` first")
        return cls(art.version, str(art.checkpoint_dir.resolve()), str(art.model_dir),
                   art.vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "checkpoint": self.checkpoint,
                "model_dir": self.model_dir, "vocab_size": self.vocab_size}

    def artifacts(self) -> Artifacts:
        model = Path(self.model_dir)
        return Artifacts(model_dir=model, checkpoint_dir=Path(self.checkpoint),
                         hf_serving_dir=model, vocab_size=self.vocab_size,
                         version=self.version)


def previous_release(state_dir: Path) -> Release:
    """The version that served before the current one (``--rollback``'s target)."""
    from moepipe.deploy.local.live import VERSIONS_FILE, read_versions

    prev = read_versions(state_dir).get("previous")
    if not prev:
        raise MoepipeError(f"no previous version is recorded in {state_dir / VERSIONS_FILE}",
                           "--rollback returns to the version a deploy replaced; none has")
    if not prev.get("model_dir"):
        raise MoepipeError(f"the source checkpoint of version {prev.get('version')} is not "
                           "recorded (it was deployed by an older moepipe)",
                           "deploy that build again instead")
    release = Release(str(prev["version"]), str(prev["checkpoint"]), str(prev["model_dir"]),
                      int(prev["vocab_size"]))
    if not (Path(release.checkpoint) / "config.json").is_file():
        raise MoepipeError(f"the checkpoint of version {release.version} is gone "
                           f"({release.checkpoint})", "build that version again to return to it")
    return release


def why_restart(cfg: MoepipeConfig, art: Artifacts, running: dict[str, Any],
                serving: str | None) -> str | None:
    """What changed beyond the weights, in one phrase (None: only the weights); ``serving``:
    the checkpoint the running model serves (as it says)."""
    from moepipe.arch.hf import tokenizer_files
    from moepipe.deploy.render.repository import MANIFEST, deployment_values
    from moepipe.runtime.checkpoint import read_config
    from moepipe.runtime.update import structure_changes

    try:
        deployed = json.loads((cfg.deploy_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"the running deployment's {MANIFEST} is missing"
    if deployed.get("target") != cfg.target:
        return f"the target changed ({deployed.get('target')} -> {cfg.target})"
    d = cfg.deploy
    for what, port in (("http", d.http_port), ("grpc", d.grpc_port),
                       ("metrics", d.metrics_port)):
        if running.get(what) != f"{d.host}:{port}":
            return f"the {what} address changed ({running.get(what)} -> {d.host}:{port})"
    if d.fallback is not None:
        return "deploy.fallback is set (its model is not updated in place)"
    old, new = deployed.get("values") or {}, deployment_values(cfg, art)
    settings = [k for k in sorted(set(old) | set(new))
                if k not in LIVE_VALUES and old.get(k) != new.get(k)]
    if settings:
        shown = ", ".join(f"{k}: {old.get(k)} -> {new.get(k)}" for k in settings[:3])
        return f"deployment settings changed ({shown})"
    served = cfg.deploy_dir / "tokenizer"
    for path in tokenizer_files(art.model_dir):
        if not (served / path.name).is_file() or \
                (served / path.name).read_bytes() != path.read_bytes():
            return f"the tokenizer changed ({path.name})"
    try:
        before = read_config(Path(serving or ""))
    except MoepipeError:
        return "the serving checkpoint is gone"
    after = read_config(Path(Release.of(art).checkpoint))
    changed = structure_changes(before, after)
    if "mapping" in changed:
        def shape(m: dict) -> str:
            return ", ".join(f"{k}={m.get(k)}" for k in ("tp_size", "pp_size", "moe_tp_size",
                                                         "moe_ep_size"))
        return f"the mapping changed ({shape(before['mapping'])} -> {shape(after['mapping'])})"
    if changed:
        return f"the model changed ({', '.join(changed[:4])} in config.json)"
    return None


def update_running(cfg: MoepipeConfig, art: Artifacts, running: dict[str, Any],
                   echo: Callable[[str], None]) -> dict[str, Any]:
    """Update the running deployment to ``art`` in place; ``{"restart": why}`` when it
    cannot be (the caller restarts it)."""
    from moepipe.deploy.local import live
    from moepipe.deploy.local.state import state_dir

    started = time.monotonic()
    target = Release.of(art)
    where = state_dir(cfg.workdir)
    try:
        status = live.ask(where, {"op": "status"})
    except live.Unreachable as e:
        return {"restart": e.message}
    why = why_restart(cfg, art, running, status.get("checkpoint"))
    if why is not None:
        return {"restart": why}
    serving = str(status.get("version") or "")
    if target.version == serving:
        echo(f"deploy: version {serving} is serving already; nothing to update")
        return {"updated": False, "version": serving, **running}
    recorded = live.read_versions(where).get("serving") or {}
    before = recorded if recorded.get("version") == serving else \
        {"version": serving, "checkpoint": status.get("checkpoint"), "model_dir": None,
         "vocab_size": art.vocab_size}  # served by a deploy that did not record it
    staged = live.ask(where, {"op": "stage", "version": target.version,
                              "checkpoint": target.checkpoint}, timeout=600)
    read = "whole changed rank files" if staged.get("by_file") else "tensors"
    echo(f"deploy: live update {serving} -> {target.version}: {staged['changed_tensors']} of "
         f"{staged['total_tensors']} {read} changed, read {staged['read_bytes'] / 2**20:.1f} "
         f"MiB ({staged['extra_bytes'] / 2**20:.1f} MiB more memory) in {staged['seconds']:.2f}s")
    checked = time.monotonic()
    report = _validate(cfg, art, target.version, running, echo)
    validate_s = time.monotonic() - checked
    if not report.passed:
        live.ask(where, {"op": "discard", "version": target.version})
        raise UpdateRejected(
            f"version {target.version} failed its validation ({_first_failure(report)}); "
            f"version {serving} keeps serving",
            f"see {cfg.workdir / 'reports' / 'update' / 'validate.json'}")
    switched = live.ask(where, {"op": "switch", "version": target.version}, timeout=60)
    serving_s = time.monotonic() - started
    from moepipe.deploy.render.repository import render_deployment

    render_deployment(cfg, art)  # a restart (the supervisor's) serves the new version
    live.record_versions(where, target.to_dict(), before)
    drain = (f"requests admitted before finish on {serving}" if switched.get("held")
             else f"nothing was running on {serving}")
    echo(f"deploy: version {target.version} serving ({serving_s:.1f}s after the command; "
         f"{drain})")
    released = live.ask(where, {"op": "released", "version": serving,
                                "timeout_s": cfg.deploy.exit_timeout_s},
                        timeout=cfg.deploy.exit_timeout_s + 10)
    if released["released"]:
        echo(f"deploy: version {serving} released after {released['seconds']:.1f}s; "
             "`moepipe deploy --rollback` returns to it")
    return {**running, "updated": True, "version": target.version, "previous": serving,
            "changed_tensors": staged["changed_tensors"],
            "total_tensors": staged["total_tensors"], "read_bytes": staged["read_bytes"],
            "extra_bytes": staged["extra_bytes"], "stage_s": staged["seconds"],
            "validate_s": round(validate_s, 3), "switch_s": switched["seconds"],
            "serving_s": round(serving_s, 3), "released": released["released"],
            "released_s": released["seconds"]}


def _validate(cfg: MoepipeConfig, art: Artifacts, version: str, running: dict[str, Any],
              echo: Callable[[str], None]):
    """Smoke and accuracy on requests pinned to ``version``, through the live server (its
    own addresses, whatever ``validation.url`` points at)."""
    from moepipe.commands.validate import endpoint_for, run_jobs
    from moepipe.deploy.local.state import state_dir
    from moepipe.serving.versions import VERSION_PARAMETER
    from moepipe.validate.base import JobContext

    ep = endpoint_for(cfg, running["http"], running["grpc"])
    ep.parameters = {VERSION_PARAMETER: version}
    ctx = JobContext(ep, cfg, art.model_dir, art.checkpoint_dir, state_dir(cfg.workdir))
    echo(f"deploy: validating version {version} beside the traffic "
         f"({', '.join(VALIDATION_JOBS)})")
    report = run_jobs(ctx, list(VALIDATION_JOBS), echo, version=version)
    report.write(cfg.workdir / "reports" / "update")
    return report


def _first_failure(report) -> str:
    for job in report.jobs:
        for case in job.cases:
            if case.status in ("failed", "error"):
                return f"{job.job}.{case.name}: {case.message}"[:300]
    return "no case passed"
