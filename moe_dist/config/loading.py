"""Loading a JobConfig strictly from JSON, dotted overrides, and the round trip through a plain dict.

Unknown keys and wrong types are errors naming the dotted path (with a close match when there is one);
`--set a.b.c=VALUE` overrides use the same paths. Everything loaded is validated (checks.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from moe_dist.config.checks import validate
from moe_dist.config.schema import ConfigError, JobConfig


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`, returning it (ints widened to float where a float is asked)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or type(value) is not type(choices[0]):
            raise ConfigError(f"{path}: expected one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected an object, got {type(value).__name__} {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected an object, got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {type(value).__name__} {value!r}")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def _unknown_key(cls: type, key: str, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid keys: {', '.join(names)})"
    return ConfigError(f"{prefix}{key}: unknown config key{hint}")


def _build(cls: type, raw: dict, path: str = "") -> Any:
    prefix = f"{path}." if path else ""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise _unknown_key(cls, key, prefix)
        kwargs[key] = _convert(value, hints[key], prefix + key)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=VALUE` → ("a.b", VALUE parsed as JSON where it parses, else the raw string)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted KEY")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _apply_override(raw: dict, cls: type, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node, node_cls = raw, cls
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        prefix = f"{prefix}." if prefix else ""
        if not dataclasses.is_dataclass(node_cls):
            raise ConfigError(f"{prefix}{part}: '{prefix[:-1]}' is not a section")
        names = {f.name for f in dataclasses.fields(node_cls)}
        if part not in names:
            raise _unknown_key(node_cls, part, prefix)
        if depth == len(parts) - 1:
            node[part] = value
            return
        node_cls = typing.get_type_hints(node_cls)[part]
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{prefix}{part}: expected an object")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    """Load a JSON file (or the defaults when `path` is None), apply dotted overrides, validate."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a JSON object")
    for text in overrides or []:
        key, value = parse_override(text)
        _apply_override(raw, JobConfig, key, value)
    cfg = _build(JobConfig, raw)
    validate(cfg)
    return cfg


def config_to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(raw: dict) -> JobConfig:
    cfg = _build(JobConfig, raw)
    validate(cfg)
    return cfg
