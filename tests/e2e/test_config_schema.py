"""`moepipe schema`: the JSON Schema of moepipe.yaml from the config model; `init` writes it
beside the config and names it in a yaml-language-server modeline, so an editor checks and
completes the file offline. Checked with jsonschema and with check-jsonschema, as CI would."""

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from moepipe import cli
from moepipe.commands.init import MODELINE, SCHEMA_FILE, config_schema, render_init

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def _validator():
    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_pass_the_schema(path):
    errors = list(_validator().iter_errors(yaml.safe_load(path.read_text())))
    assert errors == []


def test_what_init_writes_passes_the_schema():
    for target in ("cpu", "trtllm-engine", "trtllm-pytorch"):
        text = render_init(model_path=None, example="tiny-mixtral", target=target, tp=2, pp=1,
                           moe_tp=None, moe_ep=2)
        assert text.splitlines()[0] == MODELINE
        assert list(_validator().iter_errors(yaml.safe_load(text))) == []


@pytest.mark.parametrize("data,where", [
    ({"model": {"example": "tiny-mixtral"}, "parallel": {"tpp": 2}}, "parallel"),
    ({"model": {"example": "tiny-gpt"}}, "model.example"),
    ({"model": {"example": "tiny-mixtral"}, "target": "gpu"}, "target"),
    ({"model": {"example": "tiny-mixtral"}, "parallel": {"tp": True}}, "parallel.tp"),
    ({"model": {"example": "tiny-mixtral"}, "validate": {"perf": {"rates": ["1.5"]}}},
     "validate.perf.rates.0"),
    ({"model": {"example": "tiny-mixtral"}, "deploy": {"http_port": 0}}, "deploy.http_port"),
])
def test_the_schema_refuses_what_the_model_refuses(data, where):
    errors = list(_validator().iter_errors(data))
    assert errors and any(".".join(map(str, e.absolute_path)) == where for e in errors), \
        [(list(e.absolute_path), e.message) for e in errors]


def test_schema_command_and_init_write_the_same_schema(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        cli.main(["schema"])
        raise SystemExit(0)
    assert done.value.code in (0, None)
    printed = json.loads(capsys.readouterr().out)
    assert printed == config_schema()
    (tmp_path / "sub").mkdir()
    with pytest.raises(SystemExit):
        cli.main(["init", "--example", "tiny-mixtral", "-c", "sub/moepipe.yaml"])
        raise SystemExit(0)
    written = tmp_path / "sub" / SCHEMA_FILE
    assert json.loads(written.read_text()) == printed
    # the modeline's path is relative: yaml-language-server resolves it from the YAML's folder
    first = (tmp_path / "sub" / "moepipe.yaml").read_text().splitlines()[0]
    assert first == f"# yaml-language-server: $schema={SCHEMA_FILE}"


def test_check_jsonschema_accepts_an_init_config_and_refuses_a_broken_one(tmp_path):
    """What a CI job would run on a user's moepipe.yaml."""
    tool = Path(sys.executable).parent / "check-jsonschema"
    config = tmp_path / "moepipe.yaml"
    (tmp_path / SCHEMA_FILE).write_text(json.dumps(config_schema()))
    config.write_text(render_init(model_path=None, example="tiny-mixtral", target="cpu", tp=1,
                                  pp=1, moe_tp=None, moe_ep=None))
    ok = subprocess.run([str(tool), "--schemafile", str(tmp_path / SCHEMA_FILE), str(config)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    config.write_text(config.read_text().replace("  tp: 1", "  tp: true"))
    bad = subprocess.run([str(tool), "--schemafile", str(tmp_path / SCHEMA_FILE), str(config)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "parallel.tp" in bad.stdout + bad.stderr
