"""Domain errors: what can be wrong with a request, independent of gRPC.

The servicer maps each class to one status code in one place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldViolation:
    """One invalid request field, named by its protobuf path (e.g. ``spec.d_model``)."""

    field: str
    description: str


class PosencServerError(Exception):
    """Base class of errors a request can cause."""


class InvalidRequestError(PosencServerError):
    """The request is malformed; ``violations`` names every offending field."""

    def __init__(self, violations: list[FieldViolation]) -> None:
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
