"""``deploy.fallback``: a second, smaller model served from the same repository.

The fallback is another moepipe pipeline (its own ``moepipe.yaml``, built with ``moepipe
build``) for the same target and the same tokenizer (pre/postprocessing are shared). Its
``tensorrt_llm`` model is rendered from the target's template as ``tensorrt_llm_fallback``; the
BLS model (``tensorrt_llm_bls``) sends requests there while the primary is over its queue limit
or its circuit breaker is open (``tensorrt_llm_bls/1/overload.py``), names the model that
served each response, and counts the diversions in ``moepipe_fallback_requests_total``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moepipe.deploy.render.targets import Artifacts, values_of
from moepipe.deploy.render.templates import placeholders, render_tree, templates_root
from moepipe.deploy.serve_paths import ServePaths
from moepipe.errors import ConfigError

if TYPE_CHECKING:
    from moepipe.config import MoepipeConfig

FALLBACK_MODEL = "tensorrt_llm_fallback"


def bls_values(cfg: MoepipeConfig) -> dict[str, str]:
    """The BLS model's fallback parameters (an empty model name: no fallback)."""
    fb = cfg.deploy.fallback
    if fb is None:
        return {"fallback_model_name": "", "fallback_max_queue": "0",
                "fallback_failures": "1", "fallback_window_s": "1", "fallback_cooldown_s": "0"}
    return {"fallback_model_name": FALLBACK_MODEL, "fallback_max_queue": str(fb.max_queue),
            "fallback_failures": str(fb.failures), "fallback_window_s": f"{fb.window_s:g}",
            "fallback_cooldown_s": f"{fb.cooldown_s:g}"}


def _tokenizer_bytes(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.glob("tokenizer*")) if p.is_file()}


def render_fallback(cfg: MoepipeConfig, art: Artifacts, fb_cfg: MoepipeConfig,
                    fb_art: Artifacts, common: dict[str, str], repo: Path,
                    paths: ServePaths) -> None:
    """Write ``repo/tensorrt_llm_fallback`` from the fallback pipeline's build.
    ``common`` are the primary's shared values (batching, queue, decoupled mode); ``paths``
    the primary's (the fallback's files are named from the primary's repository)."""
    fb = cfg.deploy.fallback
    if fb is None:
        raise ConfigError("no deploy.fallback to render")
    where = f"deploy.fallback.config ({fb.config})"
    if fb_cfg.target != cfg.target:
        raise ConfigError(f"{where} is for target {fb_cfg.target}, the primary for {cfg.target}",
                          "the fallback is served by the same server: use the same target")
    if _tokenizer_bytes(fb_art.model_dir) != _tokenizer_bytes(art.model_dir) \
            or fb_art.vocab_size != art.vocab_size:
        raise ConfigError(f"{where}: its tokenizer differs from the primary model's",
                          "pre- and postprocessing are shared: the fallback needs the same "
                          "tokenizer")
    src = templates_root() / "targets" / cfg.target / "model_repo" / "tensorrt_llm"
    used: set[str] = set()
    for path in src.rglob("*"):
        if path.is_file() and path.suffix in (".pbtxt", ".yaml", ".sh", ".md"):
            used |= placeholders(path.read_text())
    values = {**common, **values_of(cfg.target)(fb_cfg, fb_art, paths)}
    if "world_size" in values:  # the small fallback runs in one process, every rank summed
        values["world_size"] = "1"
    dst = repo / FALLBACK_MODEL
    render_tree([src], {k: v for k, v in values.items() if k in used}, dst)
    pbtxt = dst / "config.pbtxt"
    text = pbtxt.read_text()
    if 'name: "tensorrt_llm"' not in text:
        raise ConfigError(f"{src}/config.pbtxt does not name its model tensorrt_llm")
    pbtxt.write_text(text.replace('name: "tensorrt_llm"', f'name: "{FALLBACK_MODEL}"', 1))
