"""The wheel users install: every module, template and data file of the package, the licence
text and ``py.typed``, metadata that keeps the cpu target's numpy < 2 and its Triton server in
the ``cpu`` extra and the test tools out of every extra; and without that extra, beside
numpy 2, it installs and runs build, convert, plan and render.

Built for real with ``pip wheel`` from this checkout (the source tree links the top-level
``model_repo/`` and ``docker/`` folders into ``pipeline/moepipe/``)."""

import fnmatch
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

import moepipe

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "pipeline" / "moepipe"
DATA = ("*.pbtxt", "*.yaml", "*.sh", "*.md", "*.env", "*.txt")


def _source_files() -> set[str]:
    files = set()
    for folder, dirs, names in os.walk(PACKAGE, followlinks=True):  # through the links
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if any(fnmatch.fnmatch(name, p) for p in ("*.py", "py.typed", *DATA)):
                rel = (Path(folder) / name).relative_to(PACKAGE).as_posix()
                files.add(f"moepipe/{rel}")
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True)
    return next(out.glob("moepipe-*.whl"))


def test_wheel_ships_every_module_template_and_data_file(wheel):
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("moepipe-")}
    expected = _source_files()
    assert "moepipe/model_repo/targets/cpu/model_repo/tensorrt_llm/1/model.py" in expected
    assert "moepipe/docker/versions.env" in expected
    assert "moepipe/py.typed" in expected  # PEP 561: type checkers read the package's hints
    missing = expected - shipped
    assert not missing, f"not in the wheel: {sorted(missing)}"


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        licence = next(n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE"))
        return HeaderParser().parsestr(z.read(name).decode()), z.read(licence).decode()


def test_wheel_metadata_licence_version_extras_and_classifiers(wheel):
    meta, licence = _metadata(wheel)
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta["Version"] == moepipe.__version__
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert "Operating System :: POSIX :: Linux" in meta.get_all("Classifier")
    requires = meta.get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    cpu = [r for r in requires if 'extra == "cpu"' in r]
    numpy = [r for r in core if r.startswith("numpy")]
    assert numpy == ["numpy>=1.24"]  # numpy 2 allowed: only the cpu target's server needs 1.x
    assert not any(r.startswith("nvidia-pytriton") for r in core)
    assert any(r.startswith("numpy<2,>=1.24") or r.startswith("numpy>=1.24,<2") for r in cpu)
    assert any(r.startswith("nvidia-pytriton==0.7.0") for r in cpu)
    assert any(r.startswith("grpcio") for r in core)  # imported by the load driver
    assert any(r.startswith("typer>=0.27.2") for r in core)  # typer.TyperException
    assert not any(r.startswith("safetensors") for r in core)  # only tests use it
    tools = ("pytest", "ruff", "mypy", "hypothesis", "locust", "deptry", "kubernetes-validate")
    assert not [r for r in requires if r.startswith(tools)]  # a dependency group, not an extra
    assert set(meta.get_all("Provides-Extra")) == {"cpu", "quantize", "plugins", "all"}


def _overlay_venv(where: Path, leave_out: tuple[str, ...]) -> Path:
    """A new venv that sees this test venv's packages (torch and the rest, linked, not
    copied) except ``leave_out`` (name prefixes); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    mine = Path(sysconfig.get_paths()["purelib"])
    have = {p.name.lower() for p in site.iterdir()}
    for entry in mine.iterdir():
        low = entry.name.lower().replace("-", "_")
        if entry.name.lower() in have or low.startswith(leave_out) or low.endswith(".pth"):
            continue
        (site / entry.name).symlink_to(entry)
    return python


CHECK_REQUIREMENTS = """
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
bad = []
for text in md.requires("moepipe"):
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        bad.append(f"{req}: missing")
        continue
    if version not in req.specifier:
        bad.append(f"{req}: {version}")
print(json.dumps(bad))
"""


def test_without_the_cpu_extra_build_convert_plan_and_render_run_beside_numpy_2(wheel,
                                                                                tmp_path):
    """Issue 25, item 2: the core installs where numpy 2 is, and the commands that need no
    local Triton server run there; the cpu target's server then says what to install."""
    numpy_2 = "numpy>=2,<3"
    python = _overlay_venv(tmp_path / "venv", ("numpy", "moepipe", "__editable__",
                                              "nvidia_pytriton", "pytriton"))
    # --no-deps: nothing of the linked packages may be replaced (it would be the test venv's)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", numpy_2,
                    str(wheel)], check=True, capture_output=True, timeout=300)
    bad = subprocess.run([str(python), "-c", CHECK_REQUIREMENTS], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(bad) == []  # every core requirement holds with numpy 2 installed
    bin_dir = python.parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "VIRTUAL_ENV": str(tmp_path / "venv")}

    def moepipe_(*args, cwd):
        return subprocess.run([str(bin_dir / "moepipe"), *map(str, args)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600)

    probe = subprocess.run([str(python), "-c", "import numpy, moepipe, importlib.util as u; "
                            "print(numpy.__version__, moepipe.__file__, "
                            "u.find_spec('pytriton') is None)"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert probe[0].startswith("2.") and str(tmp_path / "venv") in probe[1] and probe[2] == "True"

    project = tmp_path / "project"
    project.mkdir()
    for args in (["init", "--example", "tiny-mixtral", "--tp", 2, "--moe-ep", 2],
                 ["build"]):
        done = moepipe_(*args, cwd=project)
        assert done.returncode == 0, done.stderr
    ckpt = project / "moepipe-work" / "checkpoint"
    assert sorted(p.name for p in ckpt.glob("rank*.safetensors")) == \
        ["rank0.safetensors", "rank1.safetensors"]
    converted = moepipe_("convert", "--model", project / "moepipe-work" / "model", "--output",
                         tmp_path / "ckpt", "--moe-ep", 1, "--json", cwd=project)
    assert converted.returncode == 0 and json.loads(converted.stdout)["world_size"] == 1, \
        converted.stderr
    planned = moepipe_("plan", "Mixtral-8x7B", "--cluster", "8xH100", "--json", cwd=project)
    assert planned.returncode == 0 and json.loads(planned.stdout)["plans"], planned.stderr
    # render: the cpu target's repository is written, then its server is what is missing
    deployed = moepipe_("deploy", cwd=project)
    assert deployed.returncode == 2, deployed.stdout + deployed.stderr
    assert "rendered cpu repository" in deployed.stdout
    assert "nvidia-pytriton is not installed (hint: pip install 'moepipe[cpu]'" in \
        deployed.stderr
    assert (project / "moepipe-work" / "deploy" / "model_repo" / "ensemble" /
            "config.pbtxt").is_file()
