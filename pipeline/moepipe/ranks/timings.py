"""Where a step's time goes on each rank: its own compute and each collective it waited in
(``OPS``), and - once every rank's timing of a step is in - the part of each rank's collective
time spent waiting for the slowest rank.

A collective ends on every rank at about the same moment, when the last rank has arrived and
the data has moved; so the rank that arrived last spent the least time in it, and what any
rank spent beyond that least time is waiting for the others (``wait``). The communication share
of a step is the collective time over the step time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# Time of a step on one rank, by operation; "control" is the leader sending the step (and
# pipeline logits coming back), "compute" the rest of the step.
OPS = ("compute", "all_reduce", "all_gather", "send", "recv", "control")
COLLECTIVES = tuple(op for op in OPS if op != "compute")
# Steps whose timings wait for a missing rank (a lost one) are dropped after this many.
PENDING_STEPS = 256


@dataclass
class StepTiming:
    """One rank's seconds of one step, by operation (``compute`` included)."""

    rank: int
    step: int
    seconds: dict[str, float] = field(default_factory=dict)
    experts: list[list[int]] | None = None  # (layer, count per expert...) of a later stage

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def comm(self) -> float:
        return sum(v for k, v in self.seconds.items() if k != "compute")

    def to_json(self) -> dict:
        out: dict = {"rank": self.rank, "step": self.step, "seconds": self.seconds}
        if self.experts:
            out["experts"] = self.experts
        return out

    @classmethod
    def from_json(cls, d: dict) -> StepTiming:
        return cls(int(d["rank"]), int(d["step"]), {k: float(v) for k, v in d["seconds"].items()},
                   d.get("experts"))


class StepClock:
    """Times one rank's steps: ``start``, the collectives inside ``timed(op)``, ``stop``."""

    def __init__(self, rank: int):
        self.rank = rank
        self._ops: dict[str, float] = {}
        self._t0 = 0.0
        self._step = 0

    def start(self, step: int) -> None:
        self._step, self._ops, self._t0 = step, {}, time.perf_counter()

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._ops[op] = self._ops.get(op, 0.0) + time.perf_counter() - t

    def stop(self) -> StepTiming:
        total = time.perf_counter() - self._t0
        ops = dict(self._ops)
        ops["compute"] = max(0.0, total - sum(ops.values()))
        return StepTiming(self.rank, self._step, ops)


class GroupTimings:
    """The timings of a group's steps as they arrive (the leader's own on the engine thread,
    the workers' on the monitor thread): observations for the metrics and running totals."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._lock = threading.Lock()
        self._pending: dict[int, dict[int, StepTiming]] = {}
        self._observed: list[tuple[int, str, float]] = []  # (rank, op or "wait", seconds)
        self.steps = 0  # steps with every rank's timing
        self.totals: dict[int, dict[str, float]] = {}  # rank -> op (and "wait") -> seconds

    def add(self, timing: StepTiming) -> None:
        with self._lock:
            step = self._pending.setdefault(timing.step, {})
            step[timing.rank] = timing
            if len(step) == self.world_size:
                self._complete(self._pending.pop(timing.step))
            if len(self._pending) > PENDING_STEPS:
                for old in sorted(self._pending)[:-PENDING_STEPS]:
                    del self._pending[old]

    def _complete(self, ranks: dict[int, StepTiming]) -> None:
        least = min(t.comm for t in ranks.values())
        self.steps += 1
        for rank, t in ranks.items():
            totals = self.totals.setdefault(rank, {})
            for op, seconds in [*t.seconds.items(), ("wait", t.comm - least)]:
                self._observed.append((rank, op, seconds))
                totals[op] = totals.get(op, 0.0) + seconds

    def drain(self) -> list[tuple[int, str, float]]:
        """The observations since the last call: (rank, op, seconds), op ``wait`` being the
        part of the rank's collective time spent waiting for the slowest rank."""
        with self._lock:
            out, self._observed = self._observed, []
        return out

    def forget_pending(self) -> None:
        """A lost group's half-reported steps will never complete."""
        with self._lock:
            self._pending.clear()
