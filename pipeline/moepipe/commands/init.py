"""``moepipe init``: a commented ``moepipe.yaml`` whose comments come from the config model,
and ``moepipe schema``: the JSON Schema of that file, from the same model.

Every key's comment is its field description (and its choices) in :mod:`moepipe.config`, so the
file, ``--help`` and the model cannot drift apart; a few keys add a note of their own. The text
is parsed with the config model before it is returned.

``init`` writes the schema beside the config (:data:`SCHEMA_FILE`) and names it in the file's
first line, ``# yaml-language-server: $schema=moepipe.schema.json``: editors that use
yaml-language-server (VS Code's YAML extension, Neovim, Helix, ...) resolve a relative
``$schema`` against the YAML file's own folder (redhat-developer/yaml-language-server,
``src/languageservice/services/yamlSchemaService.ts``, ``getSchemaForResource``), so they check
and complete the config offline, with the installed moepipe's own model.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import yaml

from moepipe import __version__
from moepipe.config import MoepipeConfig, field_info, parse_config
from moepipe.errors import MoepipeError
from moepipe.utils.fs import write_text_atomic

SCHEMA_FILE = "moepipe.schema.json"
MODELINE = f"# yaml-language-server: $schema={SCHEMA_FILE}"

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
    lines = [MODELINE,
             "# moepipe pipeline configuration - read by `moepipe build`, `deploy` and `validate`.",
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


def config_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of moepipe.yaml, from the config model: every key with
    its description, type, default and choices; unknown keys refused."""
    from moepipe.examples import EXAMPLES

    schema = MoepipeConfig.model_json_schema(by_alias=True, mode="validation")
    # model.example is checked by a validator (the examples live in their own registry); the
    # schema lists them so that an editor completes them
    example = schema["$defs"]["ModelSection"]["properties"]["example"]
    example["anyOf"] = [{"enum": sorted(EXAMPLES), "type": "string"}, {"type": "null"}]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$comment": f"moepipe {__version__}: `moepipe schema` writes this file again",
            **schema, "title": "moepipe.yaml"}


def write_init(config: Path, text: str) -> Path:
    """Write the schema beside ``config``, then ``config`` (each whole or not at all); returns
    the schema's path."""
    schema = config.parent / SCHEMA_FILE
    write_text_atomic(schema, json.dumps(config_schema(), indent=2) + "\n")
    write_text_atomic(config, text)
    return schema


def run_init(config: Path, *, model: Path | None, example: str | None, target: str, tp: int,
             pp: int, moe_tp: int | None, moe_ep: int | None, quantize: str, kv_cache: str,
             force: bool, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """``moepipe init``: check the request, fill ``parallel`` from ``moepipe plan`` when
    ``plan`` (cluster, isl, osl, goal) is given, write the config and its schema. Returns
    what was written: config, schema, parallel, note."""
    if (model is None) == (example is None):
        raise MoepipeError("give exactly one of --model DIR or --example NAME")
    if config.exists() and not force:
        raise MoepipeError(f"{config}: already exists", "pass --force to overwrite it")
    if model is not None and not (model / "config.json").is_file():
        raise MoepipeError(f"{model}: not a Hugging Face checkpoint folder (no config.json)")
    path_text = None
    if model is not None:
        path_text = os.path.relpath(model.resolve(), config.resolve().parent)
    build, note, attention_dp = None, None, False
    if plan is not None:
        from moepipe.commands.plan import PlanRequest, init_values, run_plan

        chosen = init_values(run_plan(PlanRequest(
            str(model) if model is not None else str(example),
            quantize="auto" if quantize == "none" else quantize, kv_cache=kv_cache,
            target=target, **plan)))
        par, build, note = chosen["parallel"], chosen["build"], chosen["note"]
        tp, pp, moe_tp, moe_ep = par["tp"], par["pp"], par["moe_tp"], par["moe_ep"]
        attention_dp = par["attention_dp"]
    text = render_init(model_path=path_text, example=example, target=target, tp=tp, pp=pp,
                       moe_tp=moe_tp, moe_ep=moe_ep, quantize=quantize, kv_cache=kv_cache,
                       build=build, note=note, attention_dp=attention_dp)
    schema = write_init(config, text)
    return {"config": str(config.resolve()), "schema": str(schema.resolve()),
            "parallel": {"tp": tp, "pp": pp, "moe_tp": moe_tp, "moe_ep": moe_ep,
                         "attention_dp": attention_dp}, "note": note}
