"""The ``moepipe`` command line: a thin shell over the stages.

Heavy imports (torch, transformers, tritonclient) happen inside the commands, so ``--help`` is
instant and needs no GPU. User mistakes (:class:`MoepipeError`) print one line with a hint and
exit non-zero; anything else is a bug and shows a traceback with ``--debug``.

:mod:`._app` is the frame (app, options, entry point); :mod:`.models` and :mod:`.pipeline` hold
the commands, registered on the app in that order (the order of ``moepipe --help``).
"""

from moepipe.cli import models, pipeline  # noqa: F401 - registers their commands, in this order
from moepipe.cli._app import CiStep, ExampleName, Goal, PlanFormat, StageName, app, main

__all__ = ["CiStep", "ExampleName", "Goal", "PlanFormat", "StageName", "app", "main"]
