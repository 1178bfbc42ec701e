"""Strict rendering of Triton model-repository templates.

Unlike ``fill_template.py`` / ``string.Template.safe_substitute``: a placeholder without a value is
an error, a value without a placeholder is an error, no ``${`` survives, and every rendered
``config.pbtxt`` is parsed with Triton's own schema (``model_config_pb2.ModelConfig``).
"""

from __future__ import annotations

import re
import shutil
from importlib import resources
from pathlib import Path

from moepipe.errors import MoepipeError

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TEMPLATE_SUFFIXES = (".pbtxt", ".yaml", ".sh", ".md")


class RenderError(MoepipeError):
    """A template and its values disagree (a moepipe bug unless templates were edited)."""


def templates_root() -> Path:
    return Path(str(resources.files("moepipe.model_repo")))


def placeholders(text: str) -> set[str]:
    return set(PLACEHOLDER.findall(text))


def render_text(text: str, values: dict[str, str], where: str) -> str:
    missing = sorted(placeholders(text) - values.keys())
    if missing:
        raise RenderError(f"{where}: no value for placeholder(s) {', '.join(missing)}")
    out = PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
    if "${" in out:
        raise RenderError(f"{where}: '${{' left after rendering")
    return out


def render_tree(sources: list[Path], values: dict[str, str], out: Path) -> list[Path]:
    """Copy ``sources`` (folders, merged in order) into ``out``, rendering template files.
    Every value must be used by some template."""
    used: set[str] = set()
    written = []
    for src in sources:
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src)
            if path.is_dir() or "__pycache__" in rel.parts or path.name == "__init__.py" \
                    and path.parent == src:
                continue
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix in TEMPLATE_SUFFIXES:
                text = path.read_text()
                used |= placeholders(text)
                dst.write_text(render_text(text, values, str(rel)))
                shutil.copymode(path, dst)
            else:
                shutil.copy2(path, dst)
            written.append(dst)
    unused = sorted(values.keys() - used)
    if unused:
        raise RenderError(f"value(s) {', '.join(unused)} match no placeholder in the templates")
    return written


def parse_model_config(path: Path):
    """Parse a config.pbtxt with Triton's schema; raises RenderError with the parser's message."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise RenderError(f"{path}: not a valid Triton model config: {e}") from None


def check_repository(repo: Path) -> dict[str, object]:
    """Parse every config.pbtxt under ``repo``; returns name -> ModelConfig. Also checks that no
    ``${`` survives anywhere and that each model's name matches its folder."""
    configs = {}
    for path in sorted(repo.rglob("*")):
        if path.is_file() and path.suffix in (*TEMPLATE_SUFFIXES, ".py", ".json") \
                and "${" in path.read_text(errors="replace"):
            raise RenderError(f"{path}: unrendered '${{' placeholder")
    for path in sorted(repo.glob("*/config.pbtxt")):
        cfg = parse_model_config(path)
        if cfg.name != path.parent.name:
            raise RenderError(f"{path}: model name '{cfg.name}' differs from its folder")
        configs[cfg.name] = cfg
    return configs
