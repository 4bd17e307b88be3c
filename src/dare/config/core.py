"""Typed configuration: dataclasses built from YAML dictionaries and dotted ``key=value`` overrides.

Every key is checked. An unknown key is an error that names the full dotted path and suggests the
closest valid key; a value of the wrong type is an error naming the key and the expected type.
(The original DARE passes dLLM knobs as ``+key=value`` Hydra overrides that nothing validates.)

Polymorphic sections: a dataclass may define ``resolve_config_type(cls, data) -> type`` (a classmethod).
The loader calls it with the raw mapping before validation, so e.g. an algorithm section can pick the
dataclass of the algorithm named in ``data["name"]``.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union, get_args, get_origin, get_type_hints

import yaml


def clip(text: str, limit: int = 2000) -> str:
    """``text`` cut to about ``limit`` characters, head and tail kept: a message never echoes a 1 MB value."""
    text = str(text)
    if len(text) <= limit:
        return text
    head = limit * 3 // 4
    tail = limit - head
    return f"{text[:head]}...[{len(text) - head - tail} characters cut]...{text[-tail:]}"


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut after ``limit`` characters (saying how long it was)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ConfigError(ValueError):
    """A configuration problem, with the dotted path of the offending key in the message."""

    def __init__(self, message: str):
        super().__init__(clip(message))


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert where the conversion is lossless."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {shown(value)} is not allowed; expected {_type_name(tp)}.{_suggest(str(value), [str(a) for a in allowed])}")
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: null is not allowed; expected {_type_name(tp)}")
        errors = []
        # Try the exact-type members first so that "1" stays a str in Union[str, int].
        for arg in sorted((a for a in args if a is not type(None)), key=lambda a: 0 if isinstance(value, a if isinstance(a, type) else object) else 1):
            try:
                return _convert(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: {shown(value)} does not match {_type_name(tp)}")
    if origin in (list, tuple, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list ({_type_name(tp)}), got {type(value).__name__} {shown(value)}")
        (item_tp, *rest) = get_args(tp) or (Any,)
        if origin is tuple and rest and rest != [Ellipsis]:
            return tuple(_convert(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, get_args(tp))))
        out = [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_convert(k, key_tp, path): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping for section {tp.__name__}, got {type(value).__name__} {shown(value)}")
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected bool, got {type(value).__name__} {shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}: expected int, got {type(value).__name__} {shown(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected float, got {type(value).__name__} {shown(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. model.path=123 from the command line
        raise ConfigError(f"{path}: expected str, got {type(value).__name__} {shown(value)}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {shown(value)}")


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def from_dict(cls: type, data: Mapping[str, Any] | None, path: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, validating every key and type."""
    data = dict(data or {})
    resolver = getattr(cls, "resolve_config_type", None)
    if resolver is not None:
        cls = resolver(data)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            removed = getattr(cls, "REMOVED_KEYS", {}).get(key)  # a key a section no longer has: why, and what now
            if removed:
                raise ConfigError(f"config key '{full}' was removed: {removed}")
            raise ConfigError(f"unknown config key '{full}' in section {cls.__name__}.{_suggest(str(key), list(fields))}"
                              f" Valid keys: {', '.join(sorted(fields))}")
        kwargs[key] = _convert(value, hints[key], full)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{path or cls.__name__}: missing required key(s): {', '.join(missing)}")
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as e:  # __post_init__ validation
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{path or cls.__name__}: {e}") from e
    return obj


def to_dict(obj: Any) -> Any:
    """Plain-data copy of a config (for saving next to checkpoints)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], value); the value is parsed as YAML (so 1e-5, true, [1,2] work)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. train.lr=1e-5)")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = _load_bounded(raw, f"override {key}") if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted overrides to a nested mapping (missing sections are created; validation happens later)."""
    data = dict(data)
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{k}' is not a section")
            else:
                child = dict(child)
            node[k] = child
            node = child
        node[keys[-1]] = value
    return data


def _yaml_float_loader():
    # Accept 1e-5 / 3e4 as floats (YAML 1.1 requires a dot).
    loader = type("DareLoader", (yaml.SafeLoader,), {})
    import re
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?\.[0-9_]+(?:[eE][-+][0-9]+)?$|^[-+]?[0-9][0-9_]*\.[0-9_]*$"),
        list("-+0123456789."),
    )
    return loader


_LOADER = _yaml_float_loader()


MAX_YAML_VALUES = 1_000_000  # values a config may stand for once its aliases are expanded


def _expanded_size(node, sizes: dict) -> int:
    """How many nodes ``node`` (a composed YAML node) stands for with its aliases expanded, each shared node's count
    computed once (an alias bomb's ten levels of ten aliases stand for 10^10 values in a few hundred nodes)."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = 1  # a node inside itself counts once
    if isinstance(node, yaml.MappingNode):
        total = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_size(v, sizes) for v in node.value)
    else:
        total = 1
    sizes[id(node)] = min(total, MAX_YAML_VALUES + 1)
    return sizes[id(node)]


def _duplicate_key(node, path: str = "", checked: Optional[set] = None) -> Optional[str]:
    """``"key 'a.b' appears twice (lines M and N)"`` for the first mapping key given twice under ``node`` (a composed
    YAML node), else None. YAML loaders keep the last value silently, which drops a whole recipe section. A node an
    alias shares is checked once."""
    checked = set() if checked is None else checked
    if id(node) in checked:
        return None
    checked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                name = f"{path}.{key_node.value}" if path else str(key_node.value)
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    return f"key {name!r} appears twice (lines {seen[key_node.value]} and {line})"
                seen[key_node.value] = line
                found = _duplicate_key(value_node, name, checked)
            else:
                found = _duplicate_key(value_node, path, checked)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _duplicate_key(item, f"{path}[{i}]", checked)
            if found:
                return found
    return None


def _bounded_node(text: str, source: str):
    """``text`` composed; one whose aliases stand for more than ``MAX_YAML_VALUES`` values is a ``ConfigError`` (its
    Python data would take minutes to walk)."""
    node = yaml.compose(text, Loader=_LOADER)
    if _expanded_size(node, {}) > MAX_YAML_VALUES:
        raise ConfigError(f"{source}: its aliases expand to more than {MAX_YAML_VALUES:,} values (a YAML alias bomb?)")
    return node


def _load_bounded(text: str, source: str):
    _bounded_node(text, source)
    return yaml.load(text, Loader=_LOADER)


def _load_checked(text: str, source: str):
    """YAML ``text`` as Python data; a key given twice in one mapping is a ``ConfigError`` naming it and both lines."""
    node = _bounded_node(text, source)
    problem = _duplicate_key(node)
    if problem:
        raise ConfigError(f"{source}: {problem}; remove one (YAML would silently keep the last)")
    return yaml.load(text, Loader=_LOADER)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _load_checked(path.read_text(), str(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Load ``cls`` from an optional YAML file plus dotted overrides."""
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(cls, data)
