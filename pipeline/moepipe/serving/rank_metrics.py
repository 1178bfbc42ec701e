"""Prometheus figures of a rank group (world size > 1) on the cpu target's metrics port:

* ``moepipe_rank_step_seconds{model,rank,op}`` - histogram of each rank's time per step in its
  own compute (``op="compute"``) and in each collective (``all_reduce``, ``all_gather``,
  ``send``, ``recv``, ``control``); summed over ops it is the rank's step time;
* ``moepipe_rank_wait_seconds{model,rank}`` - histogram of the part of the rank's collective
  time per step spent waiting for the slowest rank (see :mod:`moepipe.ranks.timings`);
* ``moepipe_rank_group_up{model}`` - 1 while the group can run steps, 0 from the moment a rank
  is lost until the next group is formed (``/v2/health/ready`` follows it where Triton asks the
  model, see the model's ``is_ready``);
* ``moepipe_rank_group_losses_total{model}`` - rank groups lost.

As with :mod:`moepipe.serving.metrics`, numbers are taken on the engine or monitor thread and
sent to the server by ``publish`` on one thread.
"""

from __future__ import annotations

from typing import Any

from moepipe.ranks.leader import Leader
from moepipe.ranks.timings import OPS

# Seconds: a collective of a tiny model on loopback takes ~100 us; a large prefill, seconds.
BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
           1.0, 2.5, 10.0]
STEP = "moepipe_rank_step_seconds"
WAIT = "moepipe_rank_wait_seconds"
UP = "moepipe_rank_group_up"
LOSSES = "moepipe_rank_group_losses_total"


class RankMetrics:
    """The metric families of one model's rank group (``pb_utils``: the Python backend's)."""

    def __init__(self, pb_utils: Any, model: str, leader: Leader):
        self.leader = leader
        mf = pb_utils.MetricFamily
        self._families = [
            mf(name=STEP, description="Time per step of each rank, by operation (its compute, "
                                      "each collective)", kind=mf.HISTOGRAM),
            mf(name=WAIT, description="Time per step each rank waited in collectives for the "
                                      "slowest rank", kind=mf.HISTOGRAM),
            mf(name=UP, description="1 while the rank group can run steps", kind=mf.GAUGE),
            mf(name=LOSSES, description="Rank groups lost (a rank died or hung)",
               kind=mf.COUNTER)]
        step, wait, up, losses = self._families
        world = leader.settings.world_size
        self.step = {(r, op): step.Metric(labels={"model": model, "rank": str(r), "op": op},
                                          buckets=BUCKETS)
                     for r in range(world) for op in OPS}
        self.wait = {r: wait.Metric(labels={"model": model, "rank": str(r)}, buckets=BUCKETS)
                     for r in range(world)}
        self.up = up.Metric(labels={"model": model})
        self.losses = losses.Metric(labels={"model": model})
        self._losses = 0

    def publish(self) -> None:
        """Send the step timings gathered since the last call, and the group's health."""
        for rank, op, seconds in self.leader.timings.drain():
            metric = self.wait.get(rank) if op == "wait" else self.step.get((rank, op))
            if metric is not None:
                metric.observe(max(0.0, seconds))
        self.up.set(1 if self.leader.ready else 0)
        if self.leader.losses > self._losses:
            self.losses.increment(self.leader.losses - self._losses)
            self._losses = self.leader.losses

    def close(self) -> None:
        del self.step, self.wait, self.up, self.losses
