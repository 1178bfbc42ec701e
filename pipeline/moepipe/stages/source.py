"""Stage ``source``: the user's checkpoint used in place, or the built-in example written once
(a trained example is trained once per machine and copied from the machine's cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moepipe.config import MoepipeConfig
from moepipe.errors import MoepipeError
from moepipe.stages.base import BuildContext, Stage


def _settings(cfg: MoepipeConfig) -> dict[str, Any]:
    if cfg.model.example is not None:
        return {"example": cfg.model.example}
    return {"path": str(cfg.model.path)}


def _run(ctx: BuildContext, out: Path) -> dict[str, Any]:
    from moepipe.examples import write_example
    from moepipe.examples.trained import TRAINING_FILE
    from moepipe.utils.fs import read_json

    example = ctx.cfg.model.example
    if example is None:  # a user's folder is used in place; this stage never runs for it
        raise MoepipeError("the source stage writes built-in examples only")
    out.rmdir()  # write_example creates the folder itself (atomically)
    # A trained example is trained once per machine (its steps are the progress), then copied.
    write_example(example, out, progress=ctx.step)
    details: dict[str, Any] = {"example": example}
    if (out / TRAINING_FILE).is_file():
        training = read_json(out / TRAINING_FILE, "the example's training record")
        details["training"] = {k: training[k] for k in ("steps", "tokens", "loss_last",
                                                         "aux_loss_last")}
    return details


def _in_place(cfg: MoepipeConfig) -> Path | None:
    return cfg.model.path


def _files(cfg: MoepipeConfig) -> dict[str, Any]:
    """BLAKE3 of every file of a user's checkpoint folder (remembered by stat signature)."""
    if cfg.model.path is None:
        return {}
    from moepipe.checkpoints.hashcache import cached_digest

    path = cfg.model.path
    if not path.is_dir():
        raise MoepipeError(f"{path}: no such directory",
                           "model.path must be a Hugging Face checkpoint folder")
    return {"blake3": {p.name: cached_digest(p) for p in sorted(path.iterdir()) if p.is_file()}}


def source_spec(ctx: BuildContext):
    """The source model's spec (None at dry-run time when the example is not written yet)."""
    from moepipe.arch.hf import open_hf_checkpoint

    src = ctx.source_dir
    if src is None or not (src / "config.json").is_file():
        if ctx.cfg.model.example is None:
            return None
        from moepipe.examples import example_spec

        return example_spec(ctx.cfg.model.example)
    return open_hf_checkpoint(src).spec


STAGE = Stage("source", 1, applies=lambda cfg: True, settings=_settings, inputs=(),
              tools=("torch", "transformers", "tokenizers"), run=_run, link="model",
              hf_checkpoint=True, in_place=_in_place, external=_files)
