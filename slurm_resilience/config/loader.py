"""Strict YAML → frozen dataclass loading.

The YAML is composed into nodes first, so every error can name the file, the
line, the dotted key path, and what would have been valid. Constraints live in
field metadata (see :func:`setting`); cross-field rules in a ``validate()``
method that raises :class:`ValueError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


class ByteSize(int):
    """A size in bytes; YAML may give an int or a string such as ``16GiB``."""


class ConfigError(Exception):
    """A configuration file that cannot be loaded, with where and why."""

    def __init__(self, source: str, line: int | None, path: str, message: str):
        self.source = source
        self.line = line
        self.path = path
        self.message = message
        where = f"{source}:{line}" if line is not None else source
        key = f": {path}" if path else ""
        super().__init__(f"config: {where}{key}: {message}")


def setting(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    help: str = "",
    min: float | None = None,
    max: float | None = None,
    choices: tuple[Any, ...] | None = None,
) -> Any:
    """A dataclass field with its documentation and range."""
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def parse_size(text: str) -> int:
    """``"16GiB"`` → 17179869184. Raises ValueError with the valid units."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", text.strip().lower().replace(" ", ""))
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a size; use bytes or a number with one of "
                         "KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is ByteSize:
        return "a size (bytes, or e.g. 16GiB)"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp) if a is not type(None)) + " or null"
    if origin in (list, tuple):
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_describe(get_args(tp)[1])}"
    if is_dataclass(tp):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


class _Builder:
    def __init__(self, source: str):
        self.source = source
        self._constructor = yaml.SafeLoader("")

    def error(self, node: yaml.Node | None, path: str, message: str) -> ConfigError:
        line = node.start_mark.line + 1 if node is not None else None
        return ConfigError(self.source, line, path, message)

    def scalar(self, node: yaml.Node) -> Any:
        return self._constructor.construct_object(node, deep=True)

    def build(self, tp: Any, node: yaml.Node, path: str) -> Any:
        origin = get_origin(tp)
        if is_dataclass(tp) and isinstance(tp, type):
            return self.build_dataclass(tp, node, path)
        if origin in (Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            nullable = len(args) < len(get_args(tp))
            if nullable and isinstance(node, yaml.ScalarNode) and self.scalar(node) is None:
                return None
            if len(args) == 1:
                return self.build(args[0], node, path)
            for arg in args:
                try:
                    return self.build(arg, node, path)
                except ConfigError:
                    continue
            raise self.error(node, path, f"expected {_describe(tp)}")
        if origin in (list, tuple):
            if not isinstance(node, yaml.SequenceNode):
                raise self.error(node, path, f"expected {_describe(tp)}")
            item = get_args(tp)[0]
            items = [self.build(item, n, f"{path}[{i}]") for i, n in enumerate(node.value)]
            return tuple(items)
        if origin is dict:
            if not isinstance(node, yaml.MappingNode):
                raise self.error(node, path, f"expected {_describe(tp)}")
            _, vtype = get_args(tp)
            out: dict[str, object] = {}
            for knode, vnode in node.value:
                key = str(self.scalar(knode))
                out[key] = self.build(vtype, vnode, f"{path}.{key}")
            return types.MappingProxyType(out)
        if not isinstance(node, yaml.ScalarNode):
            kind = "list" if isinstance(node, yaml.SequenceNode) else "mapping"
            raise self.error(node, path, f"expected {_describe(tp)}, got a {kind}")
        value = self.scalar(node)
        if origin is Literal:
            if value not in get_args(tp):
                raise self.error(node, path, f"{value!r} is not valid; expected {_describe(tp)}")
            return value
        if tp is ByteSize:
            if isinstance(value, int) and not isinstance(value, bool):
                return ByteSize(value)
            if isinstance(value, str):
                try:
                    return ByteSize(parse_size(value))
                except ValueError as exc:
                    raise self.error(node, path, str(exc)) from None
            raise self.error(node, path, f"expected {_describe(tp)}, got {value!r}")
        if tp is bool:
            ok = isinstance(value, bool)
        elif tp is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif tp is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif tp is str:
            ok = isinstance(value, str)
        else:
            ok = isinstance(value, tp)
        if not ok:
            raise self.error(node, path, f"expected {_describe(tp)}, got {value!r}")
        return value

    def build_dataclass(self, cls: type[T], node: yaml.Node, path: str) -> T:
        if isinstance(node, yaml.ScalarNode) and self.scalar(node) is None:
            node = yaml.MappingNode("tag:yaml.org,2002:map", [], node.start_mark, node.end_mark)
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, path, "expected a mapping")
        hints = get_type_hints(cls)
        known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        values: dict[str, object] = {}
        seen: set[str] = set()
        for knode, vnode in node.value:
            key = self.scalar(knode)
            sub = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str) or key not in known:
                hint = difflib.get_close_matches(str(key), list(known), n=1)
                did = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise self.error(
                    knode, sub, f"unknown key{did}; valid keys: {', '.join(sorted(known))}"
                )
            if key in seen:
                raise self.error(knode, sub, "key given twice")
            seen.add(key)
            f = known[key]
            value = self.build(hints[key], vnode, sub)
            self.check_range(f, value, vnode, sub)
            values[key] = value
        missing = [
            n for n, f in known.items()
            if n not in values and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise self.error(node, path, f"missing required key(s): {', '.join(missing)}")
        try:
            obj = cls(**values)
            validate = getattr(obj, "validate", None)
            if callable(validate):
                validate()
        except ValueError as exc:
            raise self.error(node, path, str(exc)) from None
        return obj

    def check_range(self, f: Field[Any], value: Any, node: yaml.Node, path: str) -> None:
        meta = f.metadata
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if meta.get("choices") is not None and item not in meta["choices"]:
                valid = ", ".join(repr(c) for c in meta["choices"])
                raise self.error(node, path, f"{item!r} is not valid; valid values: {valid}")
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                lo, hi = meta.get("min"), meta.get("max")
                if (lo is not None and item < lo) or (hi is not None and item > hi):
                    rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
                    why = f" ({meta['help']})" if meta.get("help") else ""
                    raise self.error(node, path, f"{item!r} is out of range {rng}{why}")


def load_text(cls: type[T], text: str, source: str = "<string>") -> T:
    """Load ``text`` into ``cls``; empty text gives all defaults."""
    try:
        # libyaml's parser where PyYAML has it: the same nodes and marks, a fraction of
        # the time (the config is parsed by every hook run).
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(source, line, "", f"not valid YAML: {exc}") from None
    builder = _Builder(source)
    if root is None:
        mark = yaml.Mark(source, 0, 0, 0, "", 0)
        root = yaml.MappingNode("tag:yaml.org,2002:map", [], mark, mark)
    return builder.build_dataclass(cls, root, "")


def to_dict(obj: Any) -> Any:
    """A plain, YAML-friendly view of a loaded config."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, ByteSize):
        return int(obj)
    return obj


def walk_keys(
    cls: type[Any], prefix: str = ""
) -> typing.Iterator[tuple[str, dataclasses.Field[Any]]]:
    """Every dotted key path of a config class, for docs and their tests."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        path = f"{prefix}{f.name}"
        yield path, f
        tp = hints[f.name]
        if is_dataclass(tp) and isinstance(tp, type):
            yield from walk_keys(tp, path + ".")
