"""Rendering the deployment folder of a target: Triton model repository + tokenizer + extras.

``<deploy>/model_repo`` is an ensemble (preprocessing -> tensorrt_llm -> postprocessing) plus
``tensorrt_llm_bls``; only ``tensorrt_llm`` differs between targets. Values come from the one
config; the folder is written to a temporary sibling and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from moepipe import __version__
from moepipe.arch.hf import tokenizer_files
from moepipe.config import MoepipeConfig
from moepipe.deploy.cluster.operate import render_operations
from moepipe.deploy.local.ranks import MANIFEST
from moepipe.deploy.render import loadtest
from moepipe.deploy.render.fallback import bls_values, render_fallback
from moepipe.deploy.render.targets import SHIPPED, Artifacts, values_of
from moepipe.deploy.render.targets.base import LOGITS_DATATYPES, flag
from moepipe.deploy.render.templates import check_repository, render_tree, templates_root
from moepipe.deploy.serve_paths import KEEP_RELEASES, RELEASES, ServePaths, release_config
from moepipe.errors import MoepipeError
from moepipe.serving import core
from moepipe.utils.fs import atomic_dir

# The serving core's folder beside each Python model (imported as ``serving_core``).
SERVING_CORE = "serving_core"


def common_values(cfg: MoepipeConfig, tokenizer_dir: str, vocab_size: int) -> dict[str, str]:
    """The values every target's templates share (``tokenizer_dir``: as the Python models
    name it, :meth:`ServePaths.from_model`)."""
    d = cfg.deploy
    return {
        "triton_max_batch_size": str(cfg.build.max_batch_size),
        "max_queue_delay_microseconds": str(d.max_queue_delay_microseconds),
        "max_queue_size": str(d.max_queue_size),
        "queue_timeout_microseconds": str(d.queue_timeout_microseconds),
        "tokenizer_dir": tokenizer_dir,
        "add_special_tokens": flag(d.add_special_tokens),
        "skip_special_tokens": flag(d.skip_special_tokens),
        "vocab_size": str(vocab_size),
        "max_input_len": str(cfg.build.max_input_len),
        "preprocessing_instance_count": str(d.instance_count),
        "postprocessing_instance_count": str(d.instance_count),
        "bls_instance_count": str(d.instance_count),
        "decoupled_mode": flag(d.decoupled),
        "accumulate_tokens": flag(d.accumulate_tokens),
        # context / generation logits (ensemble, BLS, cpu); trtllm-engine reads its engine's
        "logits_datatype": LOGITS_DATATYPES[cfg.build.logits_dtype],
        **bls_values(cfg),
    }


def copy_tokenizer(model_dir: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in tokenizer_files(model_dir):
        shutil.copy2(path, dst / path.name)


def ship_serving_core(repo: Path) -> list[Path]:
    """Copy :mod:`moepipe.serving.core` into the version folder of every Python model of
    ``repo`` (``<model>/1/model.py``) as ``serving_core``: the request/response rules every
    model shares, which must run where moepipe is not installed (NVIDIA's containers).
    Returns the folders written."""
    src = Path(core.__file__).parent
    written = []
    for model_py in sorted(repo.glob("*/1/model.py")):
        dst = model_py.parent / SERVING_CORE
        dst.mkdir(exist_ok=True)
        for path in sorted(src.glob("*.py")):
            shutil.copy2(path, dst / path.name)
        written.append(dst)
    return written


def ship_modules(modules: dict[str, str], out: Path) -> None:
    """Copy each module's source file to its path under ``out``."""
    import importlib

    for rel, name in modules.items():
        source = importlib.import_module(name).__file__
        if source is None:
            raise MoepipeError(f"module {name} has no source file to ship")
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, out / rel)


def deployment_values(cfg: MoepipeConfig, art: Artifacts) -> dict[str, str]:
    """Every template value of ``cfg.target``'s deployment of ``art`` (what the deployment's
    manifest records; a live update compares them with the running deployment's)."""
    # Paths inside the files point at the final location, not the temporary one, and
    # where it is served: relative, or under deploy.serve_root (moepipe.deploy.serve_paths)
    paths = ServePaths.of(cfg)
    tokenizer = paths.from_model(cfg.deploy_dir / "tokenizer", "the tokenizer")
    values = common_values(cfg, tokenizer, art.vocab_size)
    values.update(values_of(cfg.target)(cfg, art, paths))
    return values


def _render_repository(cfg: MoepipeConfig, art: Artifacts, tmp: Path,
                       fallback: tuple[MoepipeConfig, Artifacts] | None) -> tuple[dict, dict]:
    """Write ``cfg``'s repository, tokenizer and launch files into ``tmp`` (which becomes
    ``cfg.deploy_dir``); returns (the template values, model -> config)."""
    values = deployment_values(cfg, art)
    paths = ServePaths.of(cfg)
    copy_tokenizer(art.model_dir, tmp / "tokenizer")
    root = templates_root()
    render_tree([root / "common", root / "targets" / cfg.target], values, tmp)
    ship_modules(SHIPPED.get(cfg.target, {}), tmp)
    repo = tmp / "model_repo"
    if fallback is not None:
        fb_cfg, fb_art = fallback
        render_fallback(cfg, art, fb_cfg, fb_art,
                        common_values(fb_cfg, values["tokenizer_dir"], fb_art.vocab_size),
                        repo, paths)
    for model in repo.iterdir():
        (model / "1").mkdir(exist_ok=True)  # Triton needs a version folder, even empty
    ship_serving_core(repo)
    configs = check_repository(repo)
    missing = {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing",
               "tensorrt_llm_bls"} - configs.keys()
    if missing:
        raise MoepipeError(f"rendered repository lacks {', '.join(sorted(missing))}")
    return values, configs


def _keep_releases(old: Path, new: Path, current: str) -> None:
    """Carry the newest earlier releases' folders (``old``: ``<deploy>/releases`` as it is)
    into ``new`` (the one being written), as hard links: their pods may still read them, and a
    rollback rolls out one of them again."""
    if not old.is_dir():
        return
    earlier = sorted((p for p in old.iterdir() if p.is_dir() and p.name != current),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for folder in earlier[:KEEP_RELEASES - 1]:
        shutil.copytree(folder, new / folder.name, symlinks=True, copy_function=_link)


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links refused: copy
        shutil.copy2(src, dst)


def render_deployment(cfg: MoepipeConfig, art: Artifacts, overwrite: bool = True,
                      fallback: tuple[MoepipeConfig, Artifacts] | None = None) -> Path:
    """Write ``cfg.deploy_dir`` for ``cfg.target``; returns the model repository path.
    ``fallback``: the ``deploy.fallback`` pipeline's config and build (see
    :mod:`moepipe.deploy.render.fallback`). ``releases/<version>`` holds the same
    repository again as the Kubernetes pods of that version read it, beside the folders of
    the newest earlier versions (:mod:`moepipe.deploy.cluster.rollout`)."""
    if not art.version:
        raise MoepipeError("the build to deploy has no version", "run `moepipe build` first")
    out = cfg.deploy_dir
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        values, configs = _render_repository(cfg, art, tmp, fallback)
        own = tmp / RELEASES / art.version
        own.mkdir(parents=True)
        _render_repository(release_config(cfg, art.version), art, own, fallback)
        render_operations(cfg, tmp, version=art.version, model_dir=art.model_dir)
        shutil.copytree(tmp / "k8s", own / "k8s")  # the rollout of this release, to go back
        _keep_releases(out / RELEASES, tmp / RELEASES, art.version)
        loadtest.write(tmp / "locust", cfg)  # a load test in the users' own tool
        (tmp / MANIFEST).write_text(json.dumps(
            {"target": cfg.target, "moepipe": __version__, "values": values,
             "version": art.version, "models": sorted(configs)}, indent=2,
            sort_keys=True) + "\n")
    return out / "model_repo"
