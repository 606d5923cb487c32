"""Argument checks the SDK's modules share: each failure is an InvalidArgumentError naming
the request field, as the server would."""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from posenc.errors import InvalidArgumentError

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
# Size suffixes of integers users type: 512MiB, 1GiB, 64KiB (binary), 1MB, 2GB (decimal).
_SIZE_SUFFIXES: Final = {
    "": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE: Final = re.compile(r"^(?P<number>[0-9][0-9_]*)\s*(?P<suffix>[a-z]*)$")


def exact_integer(raw: str) -> int:
    """An integer as a user types it: ``1048576``, ``1_048_576``, ``0x100000``, ``2**20``;
    ValueError otherwise."""
    text = raw.strip().replace("_", "")
    if "**" in text:
        base, exponent = (int(part, 0) for part in text.split("**", 1))
        if not 0 <= exponent <= 64:
            raise ValueError(f"exponent must be in 0..64, got {exponent}")
        return int(base**exponent)
    return int(text, 0)


def integer(raw: str) -> int:
    """An integer setting or size (a server setting, a CLI size): what
    :func:`exact_integer` takes, or a size such as ``1MiB``; ValueError otherwise."""
    text = raw.strip().replace("_", "").lower()
    if (match := _SIZE.match(text)) and match["suffix"] in _SIZE_SUFFIXES:
        return int(match["number"]) * _SIZE_SUFFIXES[match["suffix"]]
    return exact_integer(text)


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
