"""Reading YAML configs strictly: UTF-8 only, no duplicated keys, numbers and booleans as
written, in lists too (YAML ``true`` is not the integer 1, ``2.0`` is not the integer 2, ``1``
is not a boolean, ``"1.5"`` is not a number)."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moepipe.errors import ConfigError
from moepipe.utils import bounded
from moepipe.utils.bounded import MiB

# A moepipe.yaml is read whole; far more than any config (its prompts included).
CONFIG_LIMIT = 16 * MiB


def decode_utf8(path: Path) -> str:
    """The file's text (a regular file of at most CONFIG_LIMIT bytes); a file that is not
    UTF-8 is refused naming the line."""
    try:
        return bounded.read_text(path, CONFIG_LIMIT, "config file")
    except bounded.ReadError as e:
        raise ConfigError(e.message, e.hint) from None


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

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int:
        """An integer of YAML; one of more digits than Python converts (a 5,000-digit port)
        is refused naming its line instead of failing inside PyYAML."""
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise ConfigError(f"{self.source}:{node.start_mark.line + 1}: a number of "
                              f"{len(node.value)} digits is not a value moepipe.yaml takes",
                              "every number in moepipe.yaml has a bound (see `moepipe "
                              "schema`)") from None


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_bounded_int)


def load_yaml(text: str, source: str = "<config>") -> Any:
    """``yaml.safe_load`` that refuses duplicated keys."""
    loader = _UniqueKeyLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of a union (``X | None``, ``Optional[X]``), or the annotation alone."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _show(value: Any) -> str:
    """A value as YAML writes it (true, null, 'text'), for error messages."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


class StrictValueError(ValueError):
    """A value of the wrong kind: ``where`` is its place inside the field (``[0]`` for a
    list's first item, empty for the field itself), ``why`` what was expected."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}" if where else why)
        self.where, self.why = where, why


def _check(annotation: Any, value: Any, where: str = "") -> None:
    """Raise :class:`StrictValueError` where ``value`` does not fit ``annotation`` strictly;
    literals and sections are left to pydantic."""
    members = [a for a in _members(annotation) if a is not type(None)]
    if value is None or len(members) != 1:
        return
    kind = members[0]
    if typing.get_origin(kind) is typing.Annotated:  # a bounded item type: list[Rate]
        kind = typing.get_args(kind)[0]
    if kind is bool and not isinstance(value, bool):
        raise StrictValueError(where, f"expected true or false, not {_show(value)}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise StrictValueError(where, f"expected an integer, not {_show(value)}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise StrictValueError(where, f"expected a number, not {_show(value)}")
    if typing.get_origin(kind) in (list, tuple, set, frozenset) and isinstance(value, list):
        item = typing.get_args(kind)[0] if typing.get_args(kind) else Any
        for i, v in enumerate(value):
            _check(item, v, f"{where}[{i}]")


def check_strict_scalar(annotation: Any, value: Any) -> Any:
    """``value`` unchanged when it fits the field strictly, all the way down (the items of a
    list too); :class:`StrictValueError` otherwise. Pydantic's lax mode would take ``true`` as
    1, ``2.0`` as 2 and ``"1.5"`` as 1.5: YAML that says so is a mistake to point out, not to
    convert."""
    _check(annotation, value)
    return value
