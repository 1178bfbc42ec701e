"""The wheel users install carries every module, template and data file of the package.

Built for real with ``pip wheel`` from this checkout (the source tree links the top-level
``model_repo/`` and ``docker/`` folders into ``pipeline/moepipe/``)."""

import fnmatch
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "pipeline" / "moepipe"
DATA = ("*.pbtxt", "*.yaml", "*.sh", "*.md", "*.env", "*.txt")


def _source_files() -> set[str]:
    files = set()
    for folder, dirs, names in os.walk(PACKAGE, followlinks=True):  # through the links
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if any(fnmatch.fnmatch(name, p) for p in ("*.py", *DATA)):
                rel = (Path(folder) / name).relative_to(PACKAGE).as_posix()
                files.add(f"moepipe/{rel}")
    return files


def test_wheel_ships_every_module_template_and_data_file(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("moepipe-*.whl"))
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("moepipe-")}
    expected = _source_files()
    assert "moepipe/model_repo/targets/cpu/model_repo/tensorrt_llm/1/model.py" in expected
    assert "moepipe/docker/versions.env" in expected
    missing = expected - shipped
    assert not missing, f"not in the wheel: {sorted(missing)}"
