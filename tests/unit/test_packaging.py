"""The wheel carries every subpackage and every template (a plain `pip install .` works)."""

from pathlib import Path

import tomllib

import moepipe
from moepipe.deploy.render import templates_root

ROOT = Path(__file__).parents[2]


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {"moepipe" + ("." + ".".join(p.parent.relative_to(ROOT / "pipeline").parts)
                          if p.parent != ROOT / "pipeline" else "")
             for p in (ROOT / "pipeline").rglob("__init__.py")}
    assert found | {"moepipe.model_repo", "moepipe.docker"} == listed


def test_installed_package_has_templates_and_data():
    root = templates_root()
    for rel in ["common/model_repo/ensemble/config.pbtxt",
                "common/model_repo/preprocessing/1/model.py",
                "targets/cpu/model_repo/tensorrt_llm/1/model.py",
                "targets/trtllm-engine/launch.sh",
                "targets/trtllm-pytorch/model_repo/tensorrt_llm/1/model.yaml"]:
        assert (root / rel).is_file(), rel
    assert (Path(moepipe.__file__).parent / "examples" / "corpus.txt").is_file()
