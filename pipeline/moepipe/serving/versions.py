"""The weight versions one engine serves, by name (the build fingerprint).

* the *serving* version: every request that names none runs on it;
* *staged* versions: loaded beside it (a live update being validated), run only by requests
  that name them (Triton request parameter :data:`VERSION_PARAMETER`);
* *held* versions: a request runs, from its admission to its end, on the version it was
  admitted on: after a switch, requests admitted before it finish on the old version, which
  lives as long as the last of them (the requests hold it; nothing else does).

A switch is asked for from any thread and happens on the engine thread, between two steps
(:meth:`WeightVersions.at_step`), so no step and no request sees two versions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from moepipe.serving.core.triton import VERSION_PARAMETER
from moepipe.serving.request import RequestError

__all__ = ["VERSION_PARAMETER", "requested_version"]


@dataclass
class Switch:
    """A switch asked for: done when the engine serves ``version``."""

    version: str
    asked: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    at: float = 0.0  # monotonic time of the switch


class WeightVersions:
    """Versions by name; thread-safe (the control thread stages and switches, the engine
    thread applies switches and tells which versions running requests still hold)."""

    def __init__(self, model: Any, version: str):
        self.serving = version
        self._models: dict[str, Any] = {version: model}  # serving and staged
        self._staged: set[str] = set()
        self._switch: Switch | None = None
        self._held: frozenset[str] = frozenset()  # versions running requests hold
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @property
    def model(self) -> Any:
        """The serving version's model."""
        return self._models[self.serving]

    def pin(self, version: str | None) -> tuple[str, Any] | None:
        """(name, model) of the version a request names (None when it names none); a
        request naming a version that is not loaded is refused."""
        if not version:
            return None
        with self._lock:
            if version not in self._models:
                loaded = ", ".join(sorted(self._models))
                raise RequestError(f"weights version '{version}' is not loaded here "
                                   f"(loaded: {loaded})")
            return version, self._models[version]

    def stage(self, version: str, model: Any) -> None:
        """Load ``model`` beside the serving version, for requests that name it."""
        with self._lock:
            if version in self._models:
                raise ValueError(f"version {version} is already loaded")
            self._models[version] = model
            self._staged.add(version)

    def discard(self, version: str) -> bool:
        """Forget a staged version (requests already running on it finish on it)."""
        with self._lock:
            if version not in self._staged:
                return False
            self._staged.discard(version)
            del self._models[version]
            return True

    def switch(self, version: str) -> Switch:
        """Ask the engine to serve the staged ``version`` from its next step on."""
        with self._lock:
            if version != self.serving and version not in self._staged:
                raise ValueError(f"version {version} is not staged")
            self._switch = Switch(version)
            return self._switch

    def at_step(self, running_versions: set[str]) -> Any:
        """On the engine thread, before a step: apply the switch asked for, note which
        versions running requests hold; returns the serving model."""
        with self._lock:
            sw, self._switch = self._switch, None
            if sw is not None and sw.version != self.serving:
                old = self.serving
                self.serving = sw.version
                self._staged.discard(sw.version)
                del self._models[old]  # the requests on it hold it now
            if sw is not None:
                sw.at = time.monotonic()
                sw.done.set()
            held = frozenset(running_versions - {self.serving} - self._staged)
            if held != self._held:
                self._held = held
                self._changed.notify_all()
            return self._models[self.serving]

    def wait_released(self, version: str, timeout: float) -> bool:
        """Block until no running request holds ``version`` (True) or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while version in self._held:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"version": self.serving, "staged": sorted(self._staged),
                    "held": sorted(self._held)}


def requested_version(parameters: dict) -> str | None:
    """The version a request names in its Triton parameters, or None."""
    value = parameters.get(VERSION_PARAMETER)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"the {VERSION_PARAMETER} parameter must be a string, got {value!r}")
    return value
