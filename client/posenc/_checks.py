"""Argument checks the SDK's modules share: each failure is an InvalidArgumentError naming
the request field, as the server would."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from posenc.errors import InvalidArgumentError

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1


def bad_argument(field: str, description: str) -> InvalidArgumentError:
    """The error for a bad value of request field ``field``."""
    return InvalidArgumentError(
        f"invalid {field}: {description}", field_violations=[(field, description)]
    )


def choice(value: object, choices: Mapping[str, Any], field: str) -> str:
    """``value`` as one of the names in ``choices`` (case-insensitive)."""
    if not isinstance(value, str) or value.lower() not in choices:
        raise bad_argument(field, f"{value!r} is not one of {', '.join(choices)}")
    return value.lower()
