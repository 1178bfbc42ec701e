"""A rendered deployment names no path of the build machine (issue 25 item 1): the Python
models find their files relative to their model folder, and what a backend reads by absolute
path (the tensorrtllm backend's gpt_model_path, launch.sh, the pods' repository) is rendered
under ``deploy.serve_root``, where the Kubernetes pods mount the workdir. The move itself, served
by a real tritonserver, is tests/e2e/test_relocate.py."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from moepipe.config import parse_config
from moepipe.deploy.render.repository import render_deployment
from moepipe.deploy.render.targets import Artifacts
from moepipe.deploy.render.templates import check_repository
from moepipe.errors import ConfigError

SERVE_ROOT = "/models"
VERSION = "0123456789ab"  # the build's


def build(tmp_path, examples, target, **deploy):
    """A workdir as `moepipe build` leaves it (the model inside it, as the source and
    quantize stages write theirs), rendered for ``target``; returns (config, deploy dir)."""
    work = tmp_path / "build-machine" / "work"
    model = work / "artifacts" / "source-0123"
    shutil.copytree(examples["tiny-mixtral"], model)
    cfg = parse_config({"model": {"path": str(model)}, "target": target, "workdir": str(work),
                        "deploy": deploy}, "moepipe.yaml")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    render_deployment(cfg, Artifacts(version="0123456789ab", model_dir=model, hf_serving_dir=model, vocab_size=vocab,
                                     checkpoint_dir=model))
    return cfg, cfg.deploy_dir


def text_files(deploy: Path) -> dict[str, str]:
    return {p.relative_to(deploy).as_posix(): p.read_text() for p in sorted(deploy.rglob("*"))
            if p.is_file() and p.suffix in (".pbtxt", ".yaml", ".yml", ".sh", ".json", "")
            and "tokenizer" not in p.relative_to(deploy).parts}


def parameters(deploy: Path, model: str) -> dict[str, str]:
    cfg = check_repository(deploy / "model_repo")[model]
    return {k: v.string_value for k, v in cfg.parameters.items()}


def served(relative: str, model: str = "tensorrt_llm", deploy: str = "deploy") -> str:
    """Where a Python model of the served repository finds ``relative``."""
    return str((Path(SERVE_ROOT) / deploy / "model_repo" / model / relative).resolve())


@pytest.mark.parametrize("target", ["trtllm-engine", "trtllm-pytorch", "cpu"])
def test_rendered_files_name_serve_root_paths_and_no_build_machine_path(
        tmp_path, examples, target):
    cfg, deploy = build(tmp_path, examples, target, serve_root=SERVE_ROOT)
    files = text_files(deploy)
    build_paths = [rel for rel, text in files.items() if str(tmp_path) in text]
    assert build_paths == []
    for model in ("preprocessing", "postprocessing"):
        assert served(parameters(deploy, model)["tokenizer_dir"], model) == \
            f"{SERVE_ROOT}/deploy/tokenizer"
    k8s = [d for name, text in files.items() if name.startswith("k8s/") and name.endswith(".yaml")
           for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment"]
    pod = k8s[0]["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "workdir")
    assert mount == {"name": "workdir", "mountPath": SERVE_ROOT, "readOnly": True}
    # the pods serve their release's own copy of the repository, whose paths resolve from there
    release = f"deploy/releases/{VERSION}"
    assert f"--model-repository={SERVE_ROOT}/{release}/model_repo" in \
        pod["containers"][0]["command"]
    own = deploy / "releases" / VERSION
    for model in ("preprocessing", "postprocessing"):
        assert served(parameters(own, model)["tokenizer_dir"], model, release) == \
            f"{SERVE_ROOT}/{release}/tokenizer"
    if target == "cpu":
        assert served(parameters(own, "tensorrt_llm")["checkpoint_dir"], deploy=release) == \
            f"{SERVE_ROOT}/artifacts/source-0123"
    llm = parameters(deploy, "tensorrt_llm")
    if target == "trtllm-engine":
        assert llm["gpt_model_path"] == f"{SERVE_ROOT}/engine"  # where `moepipe build` puts it
        assert llm["tokenizer_dir"] == f"{SERVE_ROOT}/deploy/tokenizer"  # the C++ backend's
        launch = files["launch.sh"]
        assert f'DEPLOY_DIR="{SERVE_ROOT}/deploy"' in launch
        assert f'ENGINE_DIR="{SERVE_ROOT}/engine"' in launch
        assert f"--model-repository={SERVE_ROOT}/deploy/model_repo" in launch
    elif target == "trtllm-pytorch":
        model_yaml = yaml.safe_load(files["model_repo/tensorrt_llm/1/model.yaml"])
        assert served(model_yaml["model"]) == f"{SERVE_ROOT}/artifacts/source-0123"
    else:
        assert served(llm["checkpoint_dir"]) == f"{SERVE_ROOT}/artifacts/source-0123"


def test_without_serve_root_the_workdir_is_served_where_it_is(tmp_path, examples):
    cfg, deploy = build(tmp_path, examples, "trtllm-engine")
    assert parameters(deploy, "tensorrt_llm")["gpt_model_path"] == str(cfg.workdir / "engine")
    # the Python models' paths are relative all the same: the folder can still move
    assert parameters(deploy, "preprocessing")["tokenizer_dir"] == "../../tokenizer"


def test_a_checkpoint_outside_the_workdir_cannot_be_served_elsewhere(tmp_path, examples):
    """A user's checkpoint used in place does not move with the workdir: refused in one line
    when the deployment is to be served from another root, kept as it is otherwise."""
    model = examples["tiny-mixtral"]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    art = Artifacts(version="0123456789ab", model_dir=model, vocab_size=vocab)
    base = {"model": {"path": str(model)}, "target": "trtllm-pytorch",
            "workdir": str(tmp_path / "work")}
    with pytest.raises(ConfigError) as err:
        render_deployment(parse_config({**base, "deploy": {"serve_root": SERVE_ROOT}}), art)
    assert "is outside the workdir" in err.value.message and "\n" not in err.value.message
    assert err.value.hint and not (tmp_path / "work" / "deploy").exists()  # nothing written
    cfg = parse_config(base)
    render_deployment(cfg, art)
    model_yaml = yaml.safe_load((cfg.deploy_dir / "model_repo/tensorrt_llm/1/model.yaml")
                                .read_text())
    assert model_yaml["model"] == str(model.resolve())


@pytest.mark.parametrize("value, says", [
    ("models", "must be an absolute path"),
    ("/", "must be an absolute path below /"),
    ("/srv/../models", "no '..'"),
    ('/models"x', "cannot quote"),
    ("/models/$HOME", "cannot quote"),
    ("/" + "m" * 1100, "at most 1024 characters"),
])
def test_serve_root_is_checked_when_the_config_is_read(value, says):
    with pytest.raises(ConfigError) as err:
        parse_config({"model": {"example": "tiny-mixtral"},
                      "deploy": {"serve_root": value}}, "moepipe.yaml")
    assert err.value.message.startswith("moepipe.yaml: deploy.serve_root")
    assert says in err.value.message and "\n" not in err.value.message


def test_serve_root_is_not_resolved_against_the_config_folder(tmp_path):
    from moepipe.config import load_config

    path = tmp_path / "moepipe.yaml"
    path.write_text("model: {example: tiny-mixtral}\ndeploy: {serve_root: /mnt/models}\n")
    assert str(load_config(path).deploy.serve_root) == "/mnt/models"
