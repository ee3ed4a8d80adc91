"""Typed JSON: parsed JSON checked and converted into dataclasses by their type hints (`_convert`, every mismatch
a 'where: expected T, found V' problem, all reported at once), dataclasses back to plain JSON (`_plain`), and the
canonical-JSON hash that seals a manifest (`content_sha256`). Knows nothing about manifests: the schema is the
dataclasses (dflash2.manifest.records / schema)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from typing import Any, Union


def _type_name(tp) -> str:
    if dataclasses.is_dataclass(tp):
        return f"an object ({tp.__name__})"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"an object of {_type_name(typing.get_args(tp)[1])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false", type(None): "null",
            Any: "anything"}.get(tp, str(tp))


def _found(value) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
    text = json.dumps(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _convert(tp, value, where: str, problems: list[str]):
    """value (parsed JSON) as type `tp`; appends 'where: expected T, found V' on mismatch."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{where or 'manifest'}: expected {_type_name(tp)}, found {_found(value)}")
            return None
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            problems.append(f"{where or 'manifest'}: unknown field(s) {unknown} (expected only {sorted(fields)}; "
                            f"made by a newer dflash2?)")
        kw = {}
        for name, f in fields.items():
            key = f"{where}.{name}" if where else name
            if name in value:
                kw[name] = _convert(hints[name], value[name], key, problems)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"{key}: expected {_type_name(hints[name])}, found nothing (missing)")
                kw[name] = None  # reported; None lets the remaining checks run and report too
        return tp(**kw)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        # an object / list for an optional record or list: its own problems ("bits: expected an integer"),
        # not "expected an object or null, found an object"
        shaped = [a for a in typing.get_args(tp) if isinstance(value, dict) and
                  (dataclasses.is_dataclass(a) or typing.get_origin(a) is dict) or
                  isinstance(value, list) and typing.get_origin(a) is list]
        if len(shaped) == 1:
            return _convert(shaped[0], value, where, problems)
        for arm in typing.get_args(tp):
            trial: list[str] = []
            out = _convert(arm, value, where, trial)
            if not trial:
                return out
        problems.append(f"{where}: expected {_type_name(tp)}, found {_found(value)}")
        return None
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where}: expected {_type_name(tp)}, found {_found(value)}")
            return None
        (arg,) = typing.get_args(tp)
        return [_convert(arg, v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where}: expected {_type_name(tp)}, found {_found(value)}")
            return None
        arg = typing.get_args(tp)[1]
        return {k: _convert(arg, v, f"{where}.{k}", problems) for k, v in value.items()}
    ok = (value is None if tp is type(None) else
          isinstance(value, (int, float)) and not isinstance(value, bool) if tp is float else
          isinstance(value, int) and not isinstance(value, bool) if tp is int else isinstance(value, tp))
    if not ok:
        problems.append(f"{where}: expected {_type_name(tp)}, found {_found(value)}")
        return None
    return float(value) if tp is float else value


def _plain(value):
    """A record as JSON-able data; optional fields left at their None default are omitted (readers
    fill the default back in), so e.g. a graph without a TensorRT flavour has no `tensorrt` key."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (getattr(value, f.name) is None and f.default is None)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def content_sha256(data: dict) -> str:
    """sha256 of the canonical JSON of a manifest without its own `manifest_sha256` field."""
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

