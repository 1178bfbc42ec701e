"""The one error of a rank group that serving turns into Triton's UNAVAILABLE."""

from __future__ import annotations

# The prefix of every message of a lost rank group (clients and tests match on it).
RANK_GROUP_LOST = "rank group unavailable"


class RankGroupLost(RuntimeError):
    """The rank group cannot run steps: a rank was lost, or the group is being formed again.
    The message starts with :data:`RANK_GROUP_LOST` and says why."""

    triton_code = "UNAVAILABLE"  # how the serving core answers it (serving.core.errors)

    def __init__(self, why: str):
        super().__init__(f"{RANK_GROUP_LOST}: {why}")
