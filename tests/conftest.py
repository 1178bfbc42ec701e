"""Shared fixtures. Tiny models are generated from code with fixed seeds; nothing is downloaded."""

import os
import shutil

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: thread pools only add overhead
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Without a GPU, OpenAI Triton kernels run in its interpreter (read when triton is imported;
# the routing-kernel tests need it, the AOT compile tests run in a subprocess without it).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from moepipe.examples import family_examples  # noqa: E402

FAMILIES = list(family_examples().values())  # one example per registered family


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    """Everything under tests/gpu (or marked `gpu`) needs a GPU: skipped, visibly (pytest -ra
    lists the reason), on machines without one."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")
                 or "gpu" in item.path.relative_to(config.rootpath).parts[:2]]
    if not gpu_tests or _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none on this machine)")
    for item in gpu_tests:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def examples(tmp_path_factory):
    """name -> folder of each built-in tiny example (written once per test run)."""
    from moepipe.examples import write_example

    root = tmp_path_factory.mktemp("examples")
    return {name: write_example(name, root / name) for name in FAMILIES}


@pytest.fixture(scope="session")
def hf_models(examples):
    """name -> the transformers model of each example (float32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in examples.items()}


@pytest.fixture(autouse=True, scope="session")
def _private_hash_cache(tmp_path_factory):
    """Tests never touch the user's ~/.cache/moepipe."""
    import os

    os.environ["MOEPIPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("moepipe-cache"))
