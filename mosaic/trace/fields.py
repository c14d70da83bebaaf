"""Strict decoding of trace record fields: a record read from a file is checked, never coerced
(``1.9`` is not an id, ``"false"`` is not a mask value); errors name the field (and list index)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["TraceError", "MAX_TOKEN_ID", "LOGPROB_TOLERANCE"]


class TraceError(ValueError):
    """A trajectory or session record that breaks the data model; the message names the field."""


MAX_TOKEN_ID = 2**31 - 1
"""Largest token id a record may hold (ids are stored as int32; real vocabularies are far smaller)."""
LOGPROB_TOLERANCE = 1e-3
"""A log-prob may exceed 0 by this much (rounding in low-precision samplers); more is not a log-prob."""


# Strict field decoding: a record read from a file is checked, never coerced (``1.9`` is not an id,
# ``"false"`` is not a mask value). Errors name the field (and the list index).


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _int(v: Any, name: str, *, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"field {name!r}: must be an integer, got {_show(v)}")
    return int(v)


def _str(v: Any, name: str, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise TraceError(f"field {name!r}: must be a string, got {_show(v)}")
    return v


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise TraceError(f"field {name!r}: must be true or false, got {_show(v)}")
    return v


def _number(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"field {name!r}: must be a number, got {_show(v)}")
    return float(v)


def _list(v: Any, name: str) -> list:
    if not isinstance(v, list):
        raise TraceError(f"field {name!r}: must be a list, got {_show(v)}")
    return v


def _int_list(v: Any, name: str) -> list[int]:
    if all(type(t) is int for t in _list(v, name)):
        return list(v)
    return [_int(t, f"{name}[{i}]") for i, t in enumerate(v)]  # type: ignore[misc]


def _bool_list(v: Any, name: str) -> list[bool]:
    if all(type(t) is bool for t in _list(v, name)):
        return list(v)
    return [_bool(t, f"{name}[{i}]") for i, t in enumerate(v)]


def _float_list(v: Any, name: str) -> list[float]:
    if all(type(t) is float for t in _list(v, name)):
        return list(v)
    return [_number(t, f"{name}[{i}]") for i, t in enumerate(v)]


def _dict(v: Any, name: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TraceError(f"field {name!r}: must be an object, got {_show(v)}")
    return dict(v)


def _check_ids(ids: list[int], name: str) -> None:
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t <= MAX_TOKEN_ID)
        raise TraceError(f"field '{name}[{i}]': token id {t} is outside [0, {MAX_TOKEN_ID}]")


def _check_logprobs(lps: list[float], name: str) -> None:
    for i, x in enumerate(lps):
        if not -math.inf < x <= LOGPROB_TOLERANCE:  # also catches NaN
            raise TraceError(f"field '{name}[{i}]': log-prob {x} is not finite and <= 0")
