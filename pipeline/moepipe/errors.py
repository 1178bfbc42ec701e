"""User-facing errors.

A :class:`MoepipeError` is a mistake the user can fix (bad path, bad config key, impossible
mapping, corrupt file). The CLI prints it as one line with a hint and exits non-zero; anything
else is a bug and shows a traceback (with ``--debug``).
"""

from __future__ import annotations


class MoepipeError(Exception):
    """An error caused by input the user controls, with a hint on how to fix it."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None, details: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details  # extra context printed after the one-line error (log tails)

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message


class ConfigError(MoepipeError):
    """moepipe.yaml (or a command-line value) is invalid."""


class CheckpointError(MoepipeError):
    """A checkpoint on disk is missing, corrupt, truncated or inconsistent with its config."""


class MappingError(MoepipeError):
    """The requested tensor/pipeline/expert-parallel mapping cannot be applied to the model."""


class UnsupportedError(MoepipeError):
    """The model or option is not supported (yet)."""


class EnvironmentMissing(MoepipeError):
    """A tool this step needs (GPU, TensorRT-LLM, tritonserver, ...) is not available here."""
