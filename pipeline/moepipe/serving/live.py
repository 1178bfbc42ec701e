"""Live weight updates of a serving engine, asked for by `moepipe deploy` over a Unix socket
(the model's ``control_socket`` parameter): one JSON command per connection, one JSON answer.

* ``status`` - the serving version, staged and held ones, the serving checkpoint;
* ``stage {version, checkpoint}`` - load the checkpoint's changed tensors as a new version
  beside the serving one (:func:`moepipe.runtime.update.load_update`); only requests that name
  it (request parameter ``moepipe_version``) run on it, which is how it is validated;
* ``switch {version}`` - serve the staged version from the engine's next step on; requests
  admitted before finish on the old one;
* ``released {version, timeout_s}`` - wait until no request runs on ``version`` any more;
* ``discard {version}`` - drop a staged version (a failed validation).

Every answer has ``ok``; a refusal says why in ``error`` (and ``hint``). Commands run one at a
time; loading runs on this thread while the engine keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from moepipe.errors import MoepipeError
from moepipe.ranks.errors import RankGroupLost
from moepipe.serving.batcher import Batcher
from moepipe.utils import unixsock

log = logging.getLogger("moepipe")
SWITCH_TIMEOUT_S = 30.0  # the engine switches at its next step: a step takes far less


class RankGroup(Protocol):
    """The other ranks of a rank group (:class:`moepipe.ranks.leader.Leader`): each loads and
    drops its own part of a version; steps name the version they run on by its id."""

    generation: int  # counts the groups formed: a new one holds only the serving version

    def stage(self, weights: int, checkpoint: str, base: int, timeout_s: float) -> dict: ...

    def discard(self, weights: int) -> None: ...

    def serve(self, checkpoint: str, weights: int) -> None: ...


class LiveUpdates:
    """The commands, against one engine (no socket: :class:`ControlServer` carries them).
    With a rank ``group`` every rank stages the version (each its own rank's changed
    tensors) before it is validated, and drops it with the leader."""

    def __init__(self, engine: Batcher, checkpoint: str | Path,
                 on_switch: Callable[[str, str], None] | None = None,
                 group: RankGroup | None = None, stage_timeout_s: float = 600.0):
        self.engine = engine
        self.checkpoints = {engine.versions.serving: str(checkpoint)}
        self.on_switch = on_switch  # (old, new) once the engine serves the new version
        self.group, self.stage_timeout_s = group, stage_timeout_s
        self._ids = {engine.versions.serving: engine.versions.model.weights_id}
        self._next_id = itertools.count(self._ids[engine.versions.serving] + 1)
        self._generation = 0  # the rank group's generation the staged version was loaded in
        self._lock = threading.Lock()

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("op")
        handler = {"status": self._status, "stage": self._stage, "switch": self._switch,
                   "released": self._released, "discard": self._discard}.get(str(op))
        if handler is None:
            return {"ok": False, "error": f"unknown command {op!r}"}
        with self._lock:
            try:
                return {"ok": True, **handler(cmd)}
            except MoepipeError as e:
                return {"ok": False, "error": e.message, "hint": e.hint}
            except (KeyError, TypeError, ValueError, OSError, RankGroupLost) as e:
                return {"ok": False, "error": f"{op}: {e}"}

    def _status(self, cmd: dict[str, Any]) -> dict[str, Any]:
        info = self.engine.versions.describe()
        return {**info, "checkpoint": self.checkpoints.get(info["version"])}

    def _stage(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from moepipe.runtime.update import load_update

        version, checkpoint = str(cmd["version"]), str(cmd["checkpoint"])
        versions = self.engine.versions
        for staged in versions.describe()["staged"]:  # one candidate at a time
            self._drop(staged)
        if version == versions.serving:
            return {"staged": False, "why": f"version {version} is serving already"}
        started = time.perf_counter()
        base = versions.model
        update = load_update(base, checkpoint)
        update.model.weights_id = weights = next(self._next_id)
        d = update.diff
        read, extra, changed = update.read_bytes, update.extra_bytes, d.changed_tensors
        if self.group is not None:  # every other rank loads its part (or none serves it)
            self._generation = self.group.generation
            others = self.group.stage(weights, checkpoint, base.weights_id,
                                      self.stage_timeout_s)
            read += others["read_bytes"]
            extra += others["extra_bytes"]
            changed += others["changed_tensors"]
        versions.stage(version, update.model)
        self.checkpoints[version], self._ids[version] = checkpoint, weights
        seconds = time.perf_counter() - started
        log.info("staged weights version %s: %d tensors read (%d bytes), %d bytes more "
                 "memory, %.2fs", version, changed, read, extra, seconds)
        return {"staged": True, "changed_tensors": changed,
                "total_tensors": d.total_tensors, "read_bytes": read,
                "extra_bytes": extra, "seconds": round(seconds, 3),
                "by_file": any(r.by_file and r.changed for r in d.ranks.values())}

    def _drop(self, version: str) -> bool:
        """Forget ``version`` here and on the other ranks."""
        self.checkpoints.pop(version, None)
        weights = self._ids.pop(version, None)
        if self.group is not None and weights is not None:
            self.group.discard(weights)
        return self.engine.versions.discard(version)

    def _switch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        version = str(cmd["version"])
        versions = self.engine.versions
        old = versions.serving
        if self.group is not None and version != old and \
                self.group.generation != self._generation:
            self._drop(version)
            raise MoepipeError(f"the rank group was formed again while version {version} was "
                               "validated; its new workers do not hold it",
                               "run the deploy again")
        switch = versions.switch(version)
        self.engine.wake()
        if not switch.done.wait(SWITCH_TIMEOUT_S):
            raise MoepipeError(f"the engine did not take version {version} within "
                               f"{SWITCH_TIMEOUT_S:.0f}s", "see the server log")
        if self.group is not None:  # a worker of a later generation loads this one
            self.group.serve(self.checkpoints[version], self._ids[version])
        if old != version:
            log.info("serving weights version %s (was %s)", version, old)
            if self.on_switch is not None:
                self.on_switch(old, version)
        return {"previous": old, "version": version,
                "seconds": round(switch.at - switch.asked, 3),
                "held": versions.describe()["held"]}

    def _released(self, cmd: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        version = str(cmd["version"])
        released = self.engine.versions.wait_released(version, float(cmd.get("timeout_s", 60)))
        if released and version != self.engine.versions.serving:  # no request holds it
            self._drop(version)
        return {"released": released, "seconds": round(time.monotonic() - started, 3)}

    def _discard(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"discarded": self._drop(str(cmd["version"]))}


class ControlServer:
    """Serves :class:`LiveUpdates` on a Unix socket, on its own thread."""

    def __init__(self, path: Path, live: LiveUpdates):
        self.path, self.live = path, live
        self._sock = unixsock.listen(path)
        self._thread = threading.Thread(target=self._run, name="moepipe-control", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed: the model is being unloaded
                return
            with conn:
                try:
                    conn.settimeout(10.0)  # the command arrives at once
                    cmd = unixsock.receive(conn)
                    conn.settimeout(None)  # loading a version takes what it takes
                    answer = self.live.handle(cmd if isinstance(cmd, dict) else {})
                    unixsock.send(conn, answer)
                except (OSError, ValueError) as e:
                    log.warning("control connection: %s", e)
                except Exception:  # a bug: said in the log; the channel keeps serving
                    log.exception("live-update command failed")

    def close(self) -> None:
        self._sock.close()
        self.path.unlink(missing_ok=True)


def start_control(path: str | None, live: LiveUpdates) -> ControlServer | None:
    """The control server at ``path`` (None when the deployment has none, or when another
    live server holds the socket: then this one cannot be updated live, and says so)."""
    if not path:
        return None
    try:
        return ControlServer(Path(path), live)
    except OSError as e:
        log.warning("live updates are off for this server: %s", e)
        return None


class VersionMetric:
    """``moepipe_model_info{model,version} 1``: the weights version serving (the build's
    fingerprint); the series of the version it replaced is removed. Called on the outbox
    thread only (metric calls from two threads can crash the Python backend)."""

    def __init__(self, pb_utils: Any, model: str, version: str):
        self.model = model
        self.family = pb_utils.MetricFamily(
            name="moepipe_model_info",
            description="The weights version serving (the build fingerprint): 1",
            kind=pb_utils.MetricFamily.GAUGE)
        self.metric: Any = None
        self.set(version)

    def set(self, version: str) -> None:
        old = self.metric
        self.metric = self.family.Metric(labels={"model": self.model, "version": version})
        self.metric.set(1)
        if old is not None:
            old.set(0)
            del old  # the Python backend removes a series when its Metric object goes away

    def close(self) -> None:
        self.metric = None
