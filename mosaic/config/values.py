"""Typed config values: :class:`ConfigError` (what every bad value raises, naming its dotted key) and
:func:`coerce`, which checks a value against a field's annotation (``Literal``, ``X | None``, tuples,
numbers, strings) and converts what is safe to convert (an int for a float field, a list for a tuple)."""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

__all__ = ["ConfigError", "coerce"]


class ConfigError(ValueError):
    """An invalid configuration; the message names the dotted key and says why."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against / converted to annotation ``tp``; ConfigError naming ``key`` otherwise."""
    origin, args = get_origin(tp), get_args(tp)

    def bad(why: str) -> ConfigError:
        return ConfigError(f"config key '{key}': {why} (got {value!r})")

    if origin is Literal:
        if value not in args:
            raise bad(f"must be one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        errors = []
        for a in rest:
            try:
                return coerce(value, a, key)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0] if len(rest) == 1 else bad(f"must be {' or '.join(_type_name(a) for a in args)}")
    if origin is tuple:
        if isinstance(value, str) and args == (str, Ellipsis):  # `train.logger=console`, as verl takes it
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad("must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise bad(f"must be a list of {len(args)} items")
        return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                value = float(value)
            except ValueError:
                raise bad("must be a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("must be a number")
        if not math.isfinite(value):
            raise bad("must be a finite number")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
            raise bad("must be a string")
        return str(value)
    raise bad(f"unsupported field type {_type_name(tp)}")
