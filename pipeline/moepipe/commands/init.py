"""``moepipe init``: a commented ``moepipe.yaml`` whose comments come from the config model.

Every key's comment is its field description (and its choices) in :mod:`moepipe.config`, so the
file, ``--help`` and the model cannot drift apart; a few keys add a note of their own. The text
is parsed with the config model before it is returned.
"""

from __future__ import annotations

import textwrap
from typing import Any

import yaml

from moepipe.config import field_info, parse_config

# What init writes, in order: (dotted key, value). None writes an empty value (the default).
# Sections not listed here keep their defaults and are left out of the file.
WIDTH = 96

# Notes that say more than a field description can (shown under the description).
NOTES = {
    "target": "cpu needs no GPU; the two GPU targets run in NVIDIA's TensorRT-LLM {trtllm} "
              "container.",
    "parallel": "`moepipe inspect MODEL` lists the legal mappings of a model.",
    "quantize": "Routers and shared-expert gates are never quantized.",
    "deploy.host": "Set 0.0.0.0 only behind your own network controls.",
    "validate.min_token_agreement": "A quantized model drifts: the quality stage gates it, and "
                                    "on the cpu target the accuracy job also checks the server "
                                    "answers exactly what the quantized checkpoint does.",
}


def _comment(key: str, indent: str, trtllm: str) -> list[str]:
    description, choices = field_info(key)
    text = description + (f" Choices: {', '.join(choices)}." if choices else "")
    if key in NOTES:
        text += " " + NOTES[key].format(trtllm=trtllm)
    return [f"{indent}# {line}" for line in
            textwrap.wrap(text, WIDTH - len(indent) - 2, break_on_hyphens=False)]


def _value(value: Any) -> str:
    if value is None:
        return ""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip() \
        .removesuffix("...").strip()


# The build section init writes unless a plan gives other limits.
INIT_BUILD = {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048}


def render_init(*, model_path: str | None, example: str | None, target: str, tp: int, pp: int,
                moe_tp: int | None, moe_ep: int | None, quantize: str = "none",
                kv_cache: str = "none", build: dict[str, Any] | None = None,
                note: str | None = None, attention_dp: bool = False) -> str:
    """A commented moepipe.yaml; validated before it is returned. ``build``: the build
    section's values (default :data:`INIT_BUILD`); ``note``: a comment above ``parallel``
    (where the values come from, e.g. `moepipe init --plan`)."""
    from moepipe.trtllm.versions import TRTLLM_ENGINE_VERSION as trtllm

    model = [("model.path", model_path)] if model_path is not None \
        else [("model.example", example)]
    layout: list[tuple[str, list[tuple[str, Any]]]] = [
        ("model", model + [("model.dtype", "auto"), ("model.trust_remote_code", False)]),
        ("target", []),
        ("parallel", [("parallel.tp", tp), ("parallel.pp", pp), ("parallel.moe_tp", moe_tp),
                      ("parallel.moe_ep", moe_ep), ("parallel.attention_dp", attention_dp)]),
        ("convert", [("convert.workers", 1)]),
        ("quantize", [("quantize.format", quantize), ("quantize.kv_cache", kv_cache)]),
        ("build", [(f"build.{k}", v) for k, v in (build or INIT_BUILD).items()]),
        ("deploy", [("deploy.host", "127.0.0.1"), ("deploy.http_port", 8000),
                    ("deploy.grpc_port", 8001), ("deploy.metrics_port", 8002),
                    ("deploy.decoupled", True)]),
        ("validate", [("validate.jobs", ["smoke", "accuracy"]), ("validate.max_tokens", 16),
                      ("validate.min_token_agreement", 1.0 if quantize == "none" else 0.0)]),
        ("workdir", []),
    ]
    lines = ["# moepipe pipeline configuration - read by `moepipe build`, `deploy` and `validate`.",
             "# Every key is checked: unknown keys and bad values are errors that name the line.",
             "# Each comment is the key's description (`moepipe init --help` shows the same)."]
    scalars = {"target": target, "workdir": "moepipe-work"}
    for section, keys in layout:
        lines.append("")
        if section == "parallel" and note:
            lines.extend(f"# {line}" for line in textwrap.wrap(note, WIDTH - 2))
        lines.extend(_comment(section, "", trtllm))
        if not keys:
            lines.append(f"{section}: {_value(scalars[section])}")
            continue
        lines.append(f"{section}:")
        for key, value in keys:
            lines.extend(_comment(key, "  ", trtllm))
            lines.append(f"  {key.split('.', 1)[1]}: {_value(value)}".rstrip())
    text = "\n".join(lines) + "\n"
    parse_config(yaml.safe_load(text), "moepipe.yaml", text)
    return text
