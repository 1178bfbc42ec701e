"""Supported upstream versions, declared once (pin, don't sniff).

Stage code reads these constants; nothing probes installed packages with ``hasattr``. The
TensorRT-LLM version of the ``trtllm-engine`` target and its NGC image are declared in
``docker/versions.env`` (shipped in the wheel as ``moepipe.docker/versions.env``), which
``docker/Dockerfile`` repeats as its ``ARG`` defaults; this module reads it at import.
"""

from __future__ import annotations

from importlib.resources import files

VERSIONS_ENV = "versions.env"
# Keys versions.env must declare, no more and no less.
VERSIONS_ENV_KEYS = ("TRTLLM_VERSION", "TRITON_TRTLLM_IMAGE")
# Characters a value may not contain: the file is read by docker --env-file and by a shell too,
# and neither would see quotes, spaces or expansions the same way.
_UNSAFE = set(" \t\"'`$\\#")


def parse_versions_env(text: str, where: str = VERSIONS_ENV) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``versions.env`` (``#`` comments and blank lines skipped).

    A malformed file is a packaging bug, not a user mistake: it raises ``ValueError``.
    """
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier() or not value or _UNSAFE & set(value):
            raise ValueError(f"{where}:{number}: expected KEY=VALUE without quotes or spaces, "
                             f"got {raw!r}")
        if key in values:
            raise ValueError(f"{where}:{number}: {key} is declared twice")
        values[key] = value
    if set(values) != set(VERSIONS_ENV_KEYS):
        raise ValueError(f"{where}: declares {', '.join(sorted(values)) or 'nothing'}; "
                         f"expected exactly {', '.join(VERSIONS_ENV_KEYS)}")
    return values


def _read_versions_env() -> dict[str, str]:
    resource = files("moepipe.docker").joinpath(VERSIONS_ENV)
    return parse_versions_env(resource.read_text(encoding="utf-8"), str(resource))


_PINNED = _read_versions_env()

# TensorRT-LLM line whose checkpoint format / trtllm-build the `trtllm-engine` target emits.
# 1.2.x is the last stable line that still has the TensorRT engine flow.
TRTLLM_ENGINE_VERSION = _PINNED["TRTLLM_VERSION"]
# NGC Triton container that ships TRTLLM_ENGINE_VERSION (Triton 26.04-26.07 ship 1.2.1).
TRITON_TRTLLM_CONTAINER = _PINNED["TRITON_TRTLLM_IMAGE"]
