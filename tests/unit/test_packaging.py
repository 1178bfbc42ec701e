"""The package resolves from its folder: import path = folder path, templates beside it."""

from pathlib import Path

import moepipe
from moepipe.deploy.render.templates import templates_root

ROOT = Path(__file__).parents[2]


def test_import_path_is_the_folder_path():
    assert Path(moepipe.__file__).resolve().parent == (ROOT / "pipeline" / "moepipe").resolve() \
        or "site-packages" in moepipe.__file__  # the non-editable install run-tests.sh makes


def test_installed_package_has_templates_and_data():
    root = templates_root()
    for rel in ["common/model_repo/ensemble/config.pbtxt",
                "common/model_repo/preprocessing/1/model.py",
                "targets/cpu/model_repo/tensorrt_llm/1/model.py",
                "targets/trtllm-engine/launch.sh",
                "targets/trtllm-pytorch/model_repo/tensorrt_llm/1/model.yaml"]:
        assert (root / rel).is_file(), rel
    assert (Path(moepipe.__file__).parent / "examples" / "corpus.txt").is_file()


def test_test_modules_have_unique_names():
    """The test folders are not packages (pytest's default import mode): two test modules of
    the same name in different tiers make the whole suite fail to collect."""
    from collections import Counter

    tests = Path(__file__).parents[1]
    names = Counter(p.name for p in tests.rglob("*.py") if p.name != "conftest.py"
                    and "golden" not in p.parts and "data" not in p.parts)
    assert [n for n, c in names.items() if c > 1] == []
