"""The package resolves from its folder: import path = folder path, templates beside it."""

from pathlib import Path

import pytest

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


def test_declared_dependencies_are_the_imported_ones():
    """deptry: every third-party import of the package (and of plugins/ and model_repo/,
    linked into it) is declared, nothing declared goes unused, no import leans on a
    dependency's dependency (grpc was imported through tritonclient's)."""
    import subprocess
    import sys

    deptry = Path(sys.executable).parent / "deptry"
    done = subprocess.run([str(deptry), "pipeline", "plugins", "model_repo"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_version_is_written_once():
    import importlib.metadata

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert importlib.metadata.version("moepipe") == moepipe.__version__


def test_the_cpu_targets_bundled_server_refuses_numpy_2():
    """nvidia-pytriton's Triton 2.51 Python backend stub returns empty tensors with numpy 2
    (the reason numpy < 2 lives in the `cpu` extra): starting it there is one clear error."""
    from moepipe.deploy.local.binary import check_stub_numpy
    from moepipe.errors import EnvironmentMissing

    check_stub_numpy("1.26.4")
    with pytest.raises(EnvironmentMissing) as err:
        check_stub_numpy("2.4.6")
    assert "numpy 2.4.6 is installed" in err.value.message
    assert "pip install 'moepipe[cpu]'" in err.value.hint
