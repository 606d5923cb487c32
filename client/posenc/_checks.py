"""Argument checks the SDK's modules share: each failure is an InvalidArgumentError naming
the request field, as the server would."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from posenc.errors import InvalidArgumentError

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1


def bad_argument(field: str, description: str) -> InvalidArgumentError:
    """The error for a bad value of request field ``field``."""
    return InvalidArgumentError(f"{field}: {description}", field_violations=[(field, description)])


def choice(value: object, choices: Mapping[str, Any], field: str) -> str:
    """``value`` as one of the names in ``choices`` (case-insensitive)."""
    if not isinstance(value, str) or value.lower() not in choices:
        raise bad_argument(field, f"{value!r} is not one of {', '.join(choices)}")
    return value.lower()


def as_int(value: object, field: str) -> int:
    """``value`` as an int; bools are refused (passing True as a position is a bug)."""
    if isinstance(value, bool | np.bool_):
        raise bad_argument(field, f"must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise bad_argument(field, f"must be an integer, got {type(value).__name__}") from None


def as_int64(value: object, field: str) -> int:
    """``value`` as an int that an int64 field can carry."""
    number = as_int(value, field)
    if not INT64_MIN <= number <= INT64_MAX:
        raise bad_argument(field, f"must fit in int64, got {number}")
    return number
