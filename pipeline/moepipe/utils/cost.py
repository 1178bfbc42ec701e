"""What a token costs: US$ per million tokens from a price per hour and a token rate.

``$/M tokens = $/h / (tokens/s x 3600) x 1e6`` (NVIDIA's TCO formula, per GPU or per
deployment alike). moepipe quotes it per million *output* tokens (what a generation costs) and
per million tokens with input and output counted alike (what a blended price per token would
be); PromQL writes the same formula in ``moepipe.deploy.cluster.monitoring``.
"""

from __future__ import annotations

import math

SECONDS_PER_HOUR = 3600
MILLION = 1e6


def usd_per_million(usd_per_hour: float, tokens_per_s: float) -> float | None:
    """US$ per million tokens at ``tokens_per_s``; None where nothing was produced."""
    if not tokens_per_s > 0 or not math.isfinite(tokens_per_s):
        return None
    return usd_per_hour / (tokens_per_s * SECONDS_PER_HOUR) * MILLION
