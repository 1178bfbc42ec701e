"""``moepipe build``: the stages a config's target needs (inspect -> convert for now)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moepipe.config import MoepipeConfig, load_config
from moepipe.errors import MoepipeError
from moepipe.mapping import Mapping


def model_dir(cfg: MoepipeConfig, create: bool = True) -> Path:
    """The HF checkpoint folder of the config (writing the built-in example if needed)."""
    if cfg.model.path is not None:
        return cfg.model.path
    from moepipe.examples import write_example

    path = cfg.workdir / "models" / cfg.model.example
    if not (path / "config.json").is_file():
        if not create:
            raise MoepipeError(f"{path}: the example has not been built",
                               "run `moepipe build` first")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_example(cfg.model.example, path, overwrite=path.exists())
    return path


def checkpoint_dir(cfg: MoepipeConfig) -> Path:
    return cfg.workdir / "checkpoint"


def engine_dir(cfg: MoepipeConfig) -> Path:
    return cfg.workdir / "engine"


def run_build(config: Path | None, echo: Callable[[str], None] = print) -> None:
    from moepipe.stages.convert import convert
    from moepipe.stages.inspect import format_inspection, inspect_checkpoint

    cfg = load_config(config)
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    src = model_dir(cfg)
    echo(format_inspection(inspect_checkpoint(src).data))
    p = cfg.parallel
    mapping = Mapping.create(tp=p.tp, pp=p.pp, moe_tp=p.moe_tp, moe_ep=p.moe_ep)
    res = convert(src, checkpoint_dir(cfg), dtype=cfg.model.dtype, tp=mapping.tp, pp=mapping.pp,
                  moe_tp=mapping.moe_tp, moe_ep=mapping.moe_ep, workers=cfg.convert.workers,
                  overwrite=True)
    echo(f"convert: {res.output} ({mapping.describe()}, {res.plan.dtype}) in {res.seconds:.2f}s")
