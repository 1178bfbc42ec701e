"""One strict config model: errors name the YAML path, line, bad value and valid choices; every
shipped config validates."""

from pathlib import Path

import pytest

from moepipe.config import load_config, render_init
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
    ("model: {example: tiny-gpt}\n", "unknown example 'tiny-gpt'; valid: tiny-mixtral"),
    ("model: {example: tiny-mixtral, path: /x}\n", "exactly one of 'path' or 'example'"),
    ("model: {example: tiny-mixtral}\nworkers: 2\n", "workers: unknown key"),
    ("model: [1, 2\n", "not valid YAML"),
    ("- just\n- a list\n", "expected a mapping"),
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
