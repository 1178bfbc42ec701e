"""One strict config model: errors name the YAML path, line, bad value and valid choices; every
shipped config validates."""

from pathlib import Path

import pytest
import yaml

from moepipe.commands.init import render_init
from moepipe.config import load_config
from moepipe.errors import ConfigError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.target in ("cpu", "trtllm-engine", "trtllm-pytorch")


def test_configs_folder_is_not_empty():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("text,needle", [
    ("model: {example: tiny-mixtral}\nparallel:\n  tpp: 2\n",
     "moepipe.yaml:3: parallel.tpp: unknown key; valid keys: tp, pp, moe_tp, moe_ep"),
    ("model: {example: tiny-mixtral}\ntarget: gpu\n",
     "moepipe.yaml:2: target: 'gpu' is not valid; choose 'cpu', 'trtllm-engine' or "
     "'trtllm-pytorch'"),
    ("model: {example: tiny-mixtral}\nparallel: {tp: two}\n", "parallel.tp"),
    ("model: {example: tiny-gpt}\n", "unknown example 'tiny-gpt'; valid: tiny-"),
    ("model: {example: tiny-mixtral, path: /x}\n", "exactly one of 'path' or 'example'"),
    ("model: {example: tiny-mixtral}\nworkers: 2\n", "workers: unknown key"),
    ("model: [1, 2\n", "not valid YAML"),
    ("- just\n- a list\n", "expected a mapping"),
    ("model: {example: tiny-mixtral}\nquantize: {format: int3}\n",
     "quantize.format: 'int3' is not valid; choose 'none', 'fp8', 'int8_sq', 'int4_awq'"),
    ("model: {example: tiny-mixtral}\nquantize: {kv_cache: fp8}\n",
     "quantize.kv_cache needs a weight format too"),
    ("model: {example: tiny-mixtral}\ntarget: trtllm-pytorch\n"
     "quantize: {format: fp8, kv_cache: int8}\n", "kv_cache int8 is not served"),
    ("model: {example: tiny-mixtral}\nquantize: {quality: {min_logit_cosine: 2}}\n",
     "quantize.quality.min_logit_cosine"),
])
def test_config_errors(tmp_path, text, needle):
    path = tmp_path / "moepipe.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert needle in str(err.value).replace(str(tmp_path) + "/", "")


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "moepipe.yaml"
    path.write_text("model: {path: ../models/m}\nworkdir: out\n")
    cfg = load_config(path)
    assert cfg.model.path == (tmp_path / "models" / "m").resolve()
    assert cfg.workdir == (tmp_path / "sub" / "out").resolve()


def test_init_template_round_trips():
    text = render_init(model_path="/models/x", example=None, target="trtllm-engine", tp=4, pp=1,
                       moe_tp=None, moe_ep=4)
    assert "path: /models/x" in text and "moe_ep: 4" in text
    # every key of the file carries its field description as a comment
    from moepipe.config import field_info
    for key in ("model.dtype", "parallel.tp", "deploy.decoupled", "quantize.format"):
        first_words = " ".join(field_info(key)[0].split()[:3])
        assert first_words in text, key


def test_init_with_quantization_writes_the_quantize_section():
    text = render_init(model_path=None, example="tiny-mixtral", target="cpu", tp=2, pp=1,
                       moe_tp=None, moe_ep=2, quantize="int4_awq", kv_cache="fp8")
    assert "\n  format: int4_awq\n" in text and "\n  kv_cache: fp8\n" in text
    assert yaml.safe_load(text)["quantize"] == {"format": "int4_awq", "kv_cache": "fp8"}
    # A quantized model is not expected to equal the unquantized one token for token.
    assert "min_token_agreement: 0.0" in text


def _fields(model=None, prefix=""):
    from pydantic import BaseModel

    from moepipe.config import MoepipeConfig

    model = model or MoepipeConfig
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        yield key, field
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann, key + ".")


def test_every_config_field_has_a_description():
    missing = [key for key, field in _fields() if not (field.description or "").strip()]
    assert missing == []


def test_cli_help_lists_the_config_models_choices():
    from typer.testing import CliRunner

    from moepipe.cli import app
    from moepipe.config import field_info

    out = CliRunner().invoke(app, ["init", "--help"], env={"COLUMNS": "400"}).output
    for key in ("target", "quantize.format", "quantize.kv_cache"):
        description, choices = field_info(key)
        assert choices and all(c in out for c in choices), key


def _leaves(model=None, prefix=""):
    """(YAML key, annotation) of every field that holds a value, through optional sections."""
    import typing

    from pydantic import BaseModel

    from moepipe.config import MoepipeConfig

    for name, field in (model or MoepipeConfig).model_fields.items():
        key = prefix + (field.alias or name)
        sections = [a for a in (field.annotation, *typing.get_args(field.annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        if sections:
            yield from _leaves(sections[0], key + ".")
        else:
            yield key, field.annotation


# What YAML can say that pydantic's lax mode would convert: per kind of field.
WRONG = {"int": [(True, ""), (2.0, ""), ("2", "")], "float": [(True, ""), ("1.5", "")],
         "bool": [(1, ""), ("yes", "")], "list[int]": [([1, True], "[1]"), ([2.0], "[0]")],
         "list[float]": [([1.5, True], "[1]"), (["1.5"], "[0]")]}


def _kind(annotation) -> str | None:
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)] \
        if typing.get_origin(annotation) in (typing.Union, __import__("types").UnionType) \
        else [annotation]
    if len(args) != 1:
        return None
    a = args[0]
    if typing.get_origin(a) is list:
        item = typing.get_args(a)[0]
        if typing.get_origin(item) is typing.Annotated:  # a bounded item: list[Rate]
            item = typing.get_args(item)[0]
        return f"list[{item.__name__}]" if item in (int, float) else None
    return a.__name__ if a in (int, float, bool) else None


def config_with(key: str, value) -> dict:
    """The tiny example's config with the dotted ``key`` set to ``value`` (an optional
    section it passes through gets its required keys)."""
    data: dict = {"model": {"example": "tiny-mixtral"}}
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if part == "fallback":
            node["config"] = "fallback.yaml"
    node[parts[-1]] = value
    return data


def test_numbers_and_booleans_are_taken_only_as_written_in_every_field():
    """`validate.perf.concurrency: [true, 2.0]` was accepted as [1, 2]: every int, float, bool
    and list field of the model refuses what lax conversion would accept, naming the key."""
    from moepipe.config import parse_config

    checked = set()
    for key, annotation in _leaves():
        kind = _kind(annotation)
        for value, where in WRONG.get(kind, []):
            with pytest.raises(ConfigError) as err:
                parse_config(config_with(key, value), "moepipe.yaml")
            message = err.value.message
            assert f"moepipe.yaml: {key}{where}: expected " in message, (key, value, message)
            assert " (got " not in message
            checked.add(kind)
    assert checked == set(WRONG)


def test_right_numbers_still_pass():
    from moepipe.config import parse_config

    cfg = parse_config({"model": {"example": "tiny-mixtral"},
                        "validate": {"perf": {"concurrency": [1, 2], "rates": [1, 2.5]}},
                        "deploy": {"k8s": {"cpus": 2}, "ready_timeout_s": 30}})
    assert cfg.validation.perf.concurrency == [1, 2] and cfg.validation.perf.rates == [1, 2.5]
    assert cfg.deploy.k8s.cpus == 2.0 and cfg.deploy.ready_timeout_s == 30.0


def test_every_key_keeps_its_description_and_choices():
    """The editor's hover text is the field description; its completions are the choices."""
    from moepipe.commands.init import config_schema

    schema = config_schema()

    def node(key):
        here = schema
        for part in key.split("."):
            here = here["properties"][part]
            while "$ref" in here or "anyOf" in here:
                ref = here.get("$ref") or next((a["$ref"] for a in here.get("anyOf", [])
                                                if "$ref" in a), None)
                if ref is None:
                    break
                here = schema["$defs"][ref.rsplit("/", 1)[1]]
        return here

    for key, field in _fields():
        if field.description and not key.startswith("deploy.fallback"):
            parent = node(key.rsplit(".", 1)[0]) if "." in key else schema
            prop = parent["properties"][key.rsplit(".", 1)[-1]]
            assert prop.get("description") == field.description, key
    assert node("target")["enum"] == ["cpu", "trtllm-engine", "trtllm-pytorch"]
    example = schema["$defs"]["ModelSection"]["properties"]["example"]["anyOf"][0]["enum"]
    assert "tiny-mixtral-trained" in example
