"""``moepipe.yaml``: one strict configuration model for every stage.

Unknown keys are errors; every error names the YAML path (and line), the bad value and the valid
choices. Relative paths are resolved against the folder of the YAML file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from moepipe.errors import ConfigError

DEFAULT_CONFIG = "moepipe.yaml"
TARGETS = ("cpu", "trtllm-engine", "trtllm-pytorch")
Target = Literal["cpu", "trtllm-engine", "trtllm-pytorch"]
Dtype = Literal["auto", "float32", "float16", "bfloat16"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    path: Path | None = Field(None, description="Hugging Face checkpoint folder (safetensors).")
    example: str | None = Field(None, description="A built-in tiny example instead of a path.")
    dtype: Dtype = Field("auto", description="Weight dtype of the TensorRT-LLM checkpoint "
                                             "('auto' keeps the checkpoint's).")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the "
                                                       "checkpoint (off by default).")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.example is None):
            raise ValueError("set exactly one of 'path' or 'example'")
        if self.example is not None:
            from moepipe.examples import EXAMPLES

            if self.example not in EXAMPLES:
                raise ValueError(f"unknown example '{self.example}'; valid: "
                                 f"{', '.join(sorted(EXAMPLES))}")
        return self


class ParallelSection(Section):
    tp: int = Field(1, ge=1, description="Tensor-parallel size.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel size.")
    moe_tp: int | None = Field(None, ge=1, description="MoE tensor-parallel size (default: "
                                                        "derived, moe_tp * moe_ep = tp).")
    moe_ep: int | None = Field(None, ge=1, description="MoE expert-parallel size.")


class ConvertSection(Section):
    workers: int = Field(1, ge=1, description="Ranks converted in parallel.")


class MoepipeConfig(Section):
    model: ModelSection
    target: Target = Field("cpu", description="cpu | trtllm-engine | trtllm-pytorch")
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    convert: ConvertSection = Field(default_factory=ConvertSection)
    workdir: Path = Field(Path("moepipe-work"), description="Where build outputs, logs and "
                                                             "reports go.")

    # Set by load_config(): the file this config came from.
    _source: Path | None = PrivateAttr(None)

    @property
    def source(self) -> Path | None:
        return self._source

    def resolve_paths(self, base: Path) -> MoepipeConfig:
        if self.model.path is not None and not self.model.path.is_absolute():
            self.model.path = (base / self.model.path).resolve()
        if not self.workdir.is_absolute():
            self.workdir = (base / self.workdir).resolve()
        return self


def _line_of(text: str, loc: tuple) -> int | None:
    """Line number (1-based) of a key path in YAML text, best effort."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == str(part):
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _describe(err: dict[str, Any], model: type[BaseModel]) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = ".".join(str(p) for p in loc) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = model
        for part in loc[:-1]:
            field = parent.model_fields.get(str(part))
            ann = field.annotation if field else None
            parent = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
            if parent is None:
                break
        valid = f"; valid keys: {', '.join(parent.model_fields)}" if parent else ""
        return f"{path}: unknown key{valid}"
    if kind == "literal_error":
        choices = err["msg"].replace("Input should be", "choose")
        return f"{path}: {err['input']!r} is not valid; {choices}"
    if kind == "missing":
        return f"{path}: required"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{path}: {msg} (got {err.get('input')!r})" if "input" in err and \
        not isinstance(err.get("input"), dict) else f"{path}: {msg}"


def parse_config(data: Any, source: str = "<config>", text: str | None = None) -> MoepipeConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(data).__name__}",
                          "see `moepipe init` for a commented example")
    try:
        return MoepipeConfig.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        first = errors[0]
        where = source
        if text is not None:
            line = _line_of(text, tuple(first["loc"]))
            if line:
                where = f"{source}:{line}"
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise ConfigError(f"{where}: {_describe(first, MoepipeConfig)}{more}",
                          "fix the value or run `moepipe init --force` for a fresh file") from None


def load_config(path: str | Path | None = None) -> MoepipeConfig:
    path = Path(path or DEFAULT_CONFIG)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file",
                          "run `moepipe init --example tiny-mixtral` (or --model DIR) first, "
                          "or pass -c FILE")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    cfg = parse_config(data, str(path), text)
    cfg._source = path.resolve()
    return cfg.resolve_paths(path.resolve().parent)


INIT_TEMPLATE = """\
# moepipe pipeline configuration - read by `moepipe build`, `deploy` and `validate`.
# Every key is checked: unknown keys and bad values are errors that name the line.

model:
{model_line}
  # Weight dtype of the TensorRT-LLM checkpoint: auto (keep the checkpoint's), float32,
  # float16 or bfloat16.
  dtype: auto
  # Custom modelling code from the checkpoint is never run unless you allow it.
  trust_remote_code: false

# cpu: moepipe's reference runtime inside a local Triton server (no GPU needed).
# trtllm-engine: TensorRT engines (trtllm-build, TensorRT-LLM {trtllm}) + the tensorrtllm backend.
# trtllm-pytorch: TensorRT-LLM's PyTorch backend through Triton's llmapi model.
target: {target}

# Parallel mapping. moe_tp * moe_ep must equal tp; leave them empty to use TensorRT-LLM's
# defaults (none set: moe_tp = tp; one set: the other is derived).
# `moepipe inspect MODEL` lists the legal mappings of a model.
parallel:
  tp: {tp}
  pp: {pp}
  moe_tp: {moe_tp}
  moe_ep: {moe_ep}

convert:
  # Ranks converted in parallel (each holds about one expert slice in memory).
  workers: 1

# Build outputs, server logs, pid file and validation reports.
workdir: moepipe-work
"""


def render_init(*, model_path: str | None, example: str | None, target: str, tp: int, pp: int,
                moe_tp: int | None, moe_ep: int | None) -> str:
    """A commented moepipe.yaml; validated before it is returned."""
    from moepipe.versions import TRTLLM_ENGINE_VERSION

    if model_path is not None:
        model_line = ("  # Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer)\n"
                      f"  path: {yaml.safe_dump(model_path).splitlines()[0]}")
    else:
        model_line = ("  # A built-in tiny example (written under the workdir by `build`);\n"
                      "  # replace with `path: /models/your-checkpoint` for a real model.\n"
                      f"  example: {example}")
    text = INIT_TEMPLATE.format(
        model_line=model_line, target=target, tp=tp, pp=pp, trtllm=TRTLLM_ENGINE_VERSION,
        moe_tp="" if moe_tp is None else moe_tp, moe_ep="" if moe_ep is None else moe_ep)
    parse_config(yaml.safe_load(text), "moepipe.yaml", text)
    return text
