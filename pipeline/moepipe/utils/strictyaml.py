"""Reading YAML configs strictly: UTF-8 only, no duplicated keys, integers and booleans
as written (YAML ``true`` is not the integer 1; ``1`` is not a boolean)."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moepipe.errors import ConfigError


def decode_utf8(path: Path) -> str:
    """The file's text; a file that is not UTF-8 is refused naming the line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x})",
                          "save the file as UTF-8") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    source = "<config>"

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(f"{self.source}:{line}: key '{key}' is given twice (first on "
                                  f"line {seen[key]}, again on line {line})",
                                  "keep one of them")
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str = "<config>") -> Any:
    """``yaml.safe_load`` that refuses duplicated keys."""
    loader = _UniqueKeyLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _scalar_kind(annotation: Any) -> type | None:
    """int or bool when a field holds exactly that (optionally or None), else None."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    kinds = {a for a in args if a is not type(None)}
    if kinds == {bool}:
        return bool
    if kinds == {int}:
        return int
    return None


def check_strict_scalar(annotation: Any, value: Any) -> Any:
    """``value`` unchanged when it fits a strict int / bool field; ValueError otherwise."""
    kind = _scalar_kind(annotation)
    if kind is bool and value is not None and not isinstance(value, bool):
        raise ValueError("expected true or false")
    if kind is int and value is not None and (isinstance(value, bool)
                                              or not isinstance(value, int)):
        raise ValueError("expected an integer")
    return value
