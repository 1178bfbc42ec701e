"""The build stages, in order. Adding a stage = its module (which declares ``STAGE``) + one
line here; the runner (:mod:`moepipe.commands.build`) knows nothing about what a stage does."""

from __future__ import annotations

from moepipe.stages import convert, engine, inspect, quality, quantize, source
from moepipe.stages.base import Stage

STAGES: tuple[Stage, ...] = (
    source.STAGE,
    inspect.STAGE,
    quantize.STAGE,
    convert.STAGE,
    quality.STAGE,
    engine.STAGE,
)
