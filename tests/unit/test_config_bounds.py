"""Every number in moepipe.yaml is bounded by what the machine, Triton and TensorRT-LLM can
honour (issue 26, items 2 and 15): `deploy.instance_count: 1000000` or `cpu_threads: 1000000`
took the machine down, `ready_timeout_s: .inf` waited forever, a 5,000-digit port was a
traceback, `validate.burst.bin_s: 1e-6` allocated millions of bins, and `deploy.k8s.name:
"moepipe\\n"` passed the DNS-1123 check. The bounds are read from the config model itself:
each numeric field (list items too) is tried just beyond both of its ends, at infinity and
NaN, and must be refused in one line naming the key and the limit."""

import math
import typing

import annotated_types as at
import pytest
import test_config
import yaml
from pydantic import BaseModel

from moepipe.cli import main
from moepipe.config import MAX_BINS, PER_CORE, MoepipeConfig, parse_config
from moepipe.errors import ConfigError


def numeric_leaves(model=MoepipeConfig, prefix=""):
    """(YAML key, kind, lower bound, upper bound, in a list) of every numeric field."""
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        members = [a for a in typing.get_args(field.annotation) or (field.annotation,)
                   if a is not type(None)]
        section = [a for a in members if isinstance(a, type) and issubclass(a, BaseModel)]
        if section:
            yield from numeric_leaves(section[0], key + ".")
            continue
        kind, metadata, listed = members[0], field.metadata, False
        if typing.get_origin(kind) is list:
            kind, listed = typing.get_args(kind)[0], True
            if typing.get_origin(kind) is typing.Annotated:
                kind, *extra = typing.get_args(kind)
                metadata = [m for info in extra for m in info.metadata]
        if kind not in (int, float):
            continue
        lo = next(((m.ge, True) if isinstance(m, at.Ge) else (m.gt, False) for m in metadata
                   if isinstance(m, (at.Ge, at.Gt))), None)
        hi = next(((m.le, True) if isinstance(m, at.Le) else (m.lt, False) for m in metadata
                   if isinstance(m, (at.Le, at.Lt))), None)
        yield key, kind, lo, hi, listed


LEAVES = list(numeric_leaves())


def config_with(key, value, listed=False):
    return test_config.config_with(key, [value] if listed else value)


def refused(key, value, listed=False):
    with pytest.raises(ConfigError) as err:
        parse_config(config_with(key, value, listed), "moepipe.yaml")
    message = err.value.message
    assert message.startswith(f"moepipe.yaml: {key}"), message
    assert "\n" not in message and len(message) < 300, message
    return message


def test_every_numeric_field_has_both_bounds():
    assert len(LEAVES) > 80  # the walk finds the model's numbers, list items included
    unbounded = [key for key, _, lo, hi, _ in LEAVES if lo is None or hi is None]
    assert unbounded == []


@pytest.mark.parametrize("key, kind, lo, hi, listed", LEAVES, ids=[leaf[0] for leaf in LEAVES])
def test_every_number_is_refused_beyond_its_bounds(key, kind, lo, hi, listed):
    (low, low_in), (high, high_in) = lo, hi

    def shown(bound):  # as pydantic writes it: 1e6 is 1000000
        return int(bound) if float(bound).is_integer() else bound
    step = 1 if kind is int else 1e-6 + abs(high) * 1e-6
    assert f"less than{' or equal to' if high_in else ''} {shown(high)}" in refused(
        key, high + step, listed)
    step = 1 if kind is int else 1e-6 + abs(low) * 1e-6
    assert f"greater than{' or equal to' if low_in else ''} {shown(low)}" in refused(
        key, low - step, listed)
    if kind is int:
        assert "less than or equal to" in refused(key, 10**40, listed)
    else:
        for v in (math.inf, -math.inf, math.nan):
            assert "finite number" in refused(key, v, listed)
    # at an inclusive bound nothing is refused for the bound (another rule may still apply:
    # max_input_len must stay below max_seq_len, ports must differ, ...)
    for edge, inclusive in ((low, low_in), (high, high_in)):
        if not inclusive:
            continue
        try:
            parse_config(config_with(key, edge, listed), "moepipe.yaml")
        except ConfigError as e:
            assert "less than" not in e.message and "greater than" not in e.message, e.message


def test_a_huge_yaml_integer_is_one_line(tmp_path, capsys):
    path = tmp_path / "moepipe.yaml"
    path.write_text("model: {example: tiny-mixtral}\ndeploy:\n  http_port: " + "9" * 5000 + "\n")
    with pytest.raises(SystemExit) as exc:
        main(["build", "-c", str(path), "--dry-run"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and len(err) < 300
    assert f"{path}:3: a number of 5000 digits is not a value moepipe.yaml takes" in err


@pytest.mark.parametrize("text, says", [
    ("deploy: {ready_timeout_s: .inf}", "deploy.ready_timeout_s: Input should be a finite"),
    ("deploy: {instance_count: 1000000}", "deploy.instance_count: Input should be less than "
                                          "or equal to 256"),
    ("deploy: {cpu_threads: 1000000}", "deploy.cpu_threads: Input should be less than or "
                                       "equal to 1024"),
    ("deploy: {http_port: 70000}", "deploy.http_port: Input should be less than or equal to "
                                   "65535"),
    ("validate: {burst: {bin_s: 1.0e-6}}", f"more than {MAX_BINS} bins; use bin_s >= 0.0002"),
    ("validate: {perf: {rates: [.nan]}}", "validate.perf.rates[0]: Input should be a finite"),
])
def test_issue_cases_are_refused_naming_the_key(tmp_path, text, says):
    from moepipe.config import load_config

    path = tmp_path / "moepipe.yaml"
    path.write_text("model: {example: tiny-mixtral}\n" + text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert says in err.value.message


def test_instances_and_threads_are_bounded_by_the_machines_cores(tmp_path, capsys):
    from moepipe.utils.memory import available_cpus

    cores = available_cpus()
    cfg = parse_config(config_with("deploy.cpu_threads", PER_CORE * cores))
    cfg.deploy.check_machine(cores)  # at the limit: fine
    for key in ("instance_count", "cpu_threads"):
        over = PER_CORE * cores + 1
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump({**config_with(f"deploy.{key}", over),
                                        "workdir": str(tmp_path / "work")}))
        with pytest.raises(SystemExit) as exc:
            main(["deploy", "-c", str(path)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
        assert (f"deploy.{key}: {over} is more than this machine's {cores} core(s) can run "
                f"(at most {PER_CORE} per core: {PER_CORE * cores})") in err
        assert not (tmp_path / "work" / "server").exists()  # nothing was started


@pytest.mark.parametrize("key, value, ok", [
    ("name", "moepipe\n", False),  # `$` matched before the final newline
    ("name", "Moepipe", False),
    ("name", "-moepipe", False),
    ("name", "m" * 41, False),
    ("name", "moepipe-2", True),
    ("namespace", "serving\n", False),
    ("namespace", "team_a", False),
    ("namespace", "n" * 64, False),
    ("namespace", "team-a", True),
    ("volume_claim", "work claim", False),
    ("volume_claim", "work.\n", False),
    ("volume_claim", "Work", False),
    ("volume_claim", "work.v1", True),
    ("image", "registry.example/moepipe:1.0\n", False),
    ("image", "registry.example/moepipe:1.0", True),
])
def test_kubernetes_names_are_checked_when_the_config_is_read(key, value, ok):
    data = config_with(f"deploy.k8s.{key}", value)
    if ok:
        assert getattr(parse_config(data).deploy.k8s, key) == value
    else:
        assert "deploy.k8s." + key in refused(f"deploy.k8s.{key}", value)


def test_the_schema_carries_the_bounds():
    """Editors check the bounds too: every numeric property of `moepipe schema` has them."""
    from moepipe.commands.init import config_schema

    schema = config_schema()
    defs = schema.get("$defs", {})

    def resolve(node):
        return defs[node["$ref"].split("/")[-1]] if "$ref" in node else node

    def prop(key):
        node = schema
        for part in key.split("."):
            node = resolve(node)
            node = node["properties"][part]
            if "anyOf" in node:
                node = next(n for n in node["anyOf"] if n.get("type") != "null")
            node = resolve(node)
        return node.get("items", node) if node.get("type") == "array" else node

    for key, *_ in LEAVES:
        p = prop(key)
        assert {"maximum", "exclusiveMaximum"} & p.keys(), key
        assert {"minimum", "exclusiveMinimum"} & p.keys(), key
