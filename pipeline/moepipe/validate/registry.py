"""The validation jobs, in order. Adding a job = its module under :mod:`moepipe.validate.jobs`
(a function ``JobContext -> JobResult``) + one line here; ``moepipe validate``
(:mod:`moepipe.commands.validate`) knows no job by what it does."""

from __future__ import annotations

from moepipe.validate.base import Job
from moepipe.validate.jobs import (
    accuracy,
    balance,
    burst,
    long_tail,
    perf,
    recovery,
    smoke,
    soak,
)

JOBS: dict[str, Job] = {
    "smoke": smoke.smoke,
    "accuracy": accuracy.accuracy,
    "perf": perf.perf,
    "burst": burst.burst,
    "long-tail": long_tail.long_tail,
    "balance": balance.balance,
    "recovery": recovery.recovery,
    "soak": soak.soak,
}
