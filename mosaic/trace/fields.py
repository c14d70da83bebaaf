"""Strict decoding of trace record fields: a record read from a file is checked, never coerced
(``1.9`` is not an id, ``"false"`` is not a mask value); errors name the field (and list index)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["TraceError", "MAX_TOKEN_ID", "LOGPROB_TOLERANCE", "show_value", "as_int", "as_str", "as_bool", "as_number",
           "as_list", "as_int_list", "as_bool_list", "as_float_list", "as_dict", "check_ids", "check_logprobs"]


class TraceError(ValueError):
    """A trajectory or session record that breaks the data model; the message names the field."""


MAX_TOKEN_ID = 2**31 - 1
"""Largest token id a record may hold (ids are stored as int32; real vocabularies are far smaller)."""
LOGPROB_TOLERANCE = 1e-3
"""A log-prob may exceed 0 by this much (rounding in low-precision samplers); more is not a log-prob."""


# Strict field decoding: a record read from a file is checked, never coerced (``1.9`` is not an id,
# ``"false"`` is not a mask value). Errors name the field (and the list index).


def show_value(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def as_int(v: Any, name: str, *, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"field {name!r}: must be an integer, got {show_value(v)}")
    return int(v)


def as_str(v: Any, name: str, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise TraceError(f"field {name!r}: must be a string, got {show_value(v)}")
    return v


def as_bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise TraceError(f"field {name!r}: must be true or false, got {show_value(v)}")
    return v


def as_number(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"field {name!r}: must be a number, got {show_value(v)}")
    return float(v)


def as_list(v: Any, name: str) -> list:
    if not isinstance(v, list):
        raise TraceError(f"field {name!r}: must be a list, got {show_value(v)}")
    return v


def as_int_list(v: Any, name: str) -> list[int]:
    if all(type(t) is int for t in as_list(v, name)):
        return list(v)
    return [as_int(t, f"{name}[{i}]") for i, t in enumerate(v)]  # type: ignore[misc]


def as_bool_list(v: Any, name: str) -> list[bool]:
    if all(type(t) is bool for t in as_list(v, name)):
        return list(v)
    return [as_bool(t, f"{name}[{i}]") for i, t in enumerate(v)]


def as_float_list(v: Any, name: str) -> list[float]:
    if all(type(t) is float for t in as_list(v, name)):
        return list(v)
    return [as_number(t, f"{name}[{i}]") for i, t in enumerate(v)]


def as_dict(v: Any, name: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TraceError(f"field {name!r}: must be an object, got {show_value(v)}")
    return dict(v)


def check_ids(ids: list[int], name: str) -> None:
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t <= MAX_TOKEN_ID)
        raise TraceError(f"field '{name}[{i}]': token id {t} is outside [0, {MAX_TOKEN_ID}]")


def check_logprobs(lps: list[float], name: str) -> None:
    for i, x in enumerate(lps):
        if not -math.inf < x <= LOGPROB_TOLERANCE:  # also catches NaN
            raise TraceError(f"field '{name}[{i}]': log-prob {x} is not finite and <= 0")
