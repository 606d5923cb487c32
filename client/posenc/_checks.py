"""What the SDK's modules share to refuse an argument: an InvalidArgumentError naming the
request field, as the server would (the checks themselves are where each argument is read:
a call's in :mod:`posenc._query`, a spec's in :mod:`posenc.spec`)."""

from __future__ import annotations

from typing import Final

from posenc.errors import InvalidArgumentError

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1


def bad_argument(field: str, description: str) -> InvalidArgumentError:
    """The error for a bad value of request field ``field``."""
    return InvalidArgumentError(f"{field}: {description}", field_violations=[(field, description)])
