"""Domain errors: what can be wrong with a request, independent of gRPC.

The servicer maps each class to one status code in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MAX_FIELD_CHARS: Final = 128
"""The longest field path an error names (the longest real one is a few dozen)."""
MAX_DESCRIPTION_CHARS: Final = 512
"""The longest description of one violation, or message of an error."""
MAX_VIOLATIONS: Final = 16
"""The most violations one error lists (then how many more there were)."""
MAX_MESSAGE_CHARS: Final = 4096
"""The longest status message a call is answered with."""


def bounded(text: str, limit: int = MAX_DESCRIPTION_CHARS) -> str:
    """``text``, cut to at most ``limit`` characters (saying how long it was): nothing a
    request holds is echoed whole, whatever its size."""
    if len(text) <= limit:
        return text
    note = f"... ({len(text)} characters)"
    return text[: max(0, limit - len(note))] + note


@dataclass(frozen=True)
class FieldViolation:
    """One invalid request field, named by its protobuf path (e.g. ``spec.d_model``);
    both are bounded (``bounded``)."""

    field: str
    description: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "field", bounded(self.field, MAX_FIELD_CHARS))
        object.__setattr__(self, "description", bounded(self.description))


class PosencServerError(Exception):
    """Base class of errors a request can cause."""


class InvalidRequestError(PosencServerError):
    """The request is malformed; ``violations`` names the offending fields (the first
    ``MAX_VIOLATIONS``, then how many more there were)."""

    def __init__(self, violations: list[FieldViolation]) -> None:
        if len(violations) > MAX_VIOLATIONS:
            more = len(violations) - MAX_VIOLATIONS + 1
            violations = [
                *violations[: MAX_VIOLATIONS - 1],
                FieldViolation("request", f"and {more} more violations"),
            ]
        self.violations = violations
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in violations))


class LimitExceededError(PosencServerError):
    """The request is well formed but larger than a configured limit allows."""


class OverloadedError(LimitExceededError):
    """The server is at a concurrency limit: the same request may succeed a moment later."""

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class ShuttingDownError(PosencServerError):
    """The server is draining and accepts no new work."""


class RequestTimeoutError(PosencServerError):
    """The call's request message did not arrive within the read timeout."""
