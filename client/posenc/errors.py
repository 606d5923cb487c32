"""Exceptions raised by the posenc SDK.

Every error the SDK raises is a :class:`PosencError`, with the gRPC status ``code`` and the
server's ``details`` message. Each status code the service uses has its own subclass, so
callers can catch exactly what they can handle::

    try:
        table = client.get_range(0, 4096, 512)
    except posenc.InvalidArgumentError as e:
        print(e.field_violations)  # [("spec.d_model", "...")]
    except posenc.UnavailableError:
        ...  # retries were exhausted

Some subclasses also derive from the matching built-in exception (``ValueError``,
``TimeoutError``, ``ConnectionError``, ``PermissionError``) so generic code that knows
nothing about gRPC still does the right thing.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

__all__ = [
    "CancelledError",
    "DeadlineExceededError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PermissionDeniedError",
    "PosencError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "error_class_for_code",
]


class PosencError(Exception):
    """Base class of every error raised by the posenc SDK.

    Attributes:
        code: The gRPC status code of the failure. Errors detected on the client before
            any call (for example a non-integer position) carry the code the server would
            have answered with.
        details: The human-readable message, as sent by the server when there is one.
        retry_after: Seconds the server asked the client to wait before trying again
            (``google.rpc.RetryInfo``, e.g. at its stream cap), else None.
    """

    #: Status code used when the error is raised without an explicit one.
    default_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details: str,
        *,
        code: grpc.StatusCode | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.code: grpc.StatusCode = code if code is not None else self.default_code
        self.details: str = details
        self.retry_after = retry_after
        super().__init__(details)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class ClientClosedError(PosencError, RuntimeError):
    """A call on a client that was closed (CANCELLED, as gRPC says of calls it cut)."""

    default_code = grpc.StatusCode.CANCELLED

    def __init__(self, details: str = "the client is closed: create a new one") -> None:
        super().__init__(details)


class InvalidArgumentError(PosencError, ValueError):
    """The request was malformed (INVALID_ARGUMENT).

    Attributes:
        field_violations: ``(field, description)`` pairs from the ``google.rpc.BadRequest``
            details of the status, e.g. ``[("spec.d_model", "must be in 1..65536")]``.
            Empty when the server sent none.
    """

    default_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(
        self,
        details: str,
        *,
        code: grpc.StatusCode | None = None,
        field_violations: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(details, code=code)
        self.field_violations: list[tuple[str, str]] = list(field_violations)

    def __str__(self) -> str:
        text = super().__str__()
        # Name the fields in the message too: it is often all a log line shows.
        extra = "; ".join(f"{f}: {d}" for f, d in self.field_violations if f not in text)
        return f"{text} ({extra})" if extra else text


class ResourceExhaustedError(PosencError):
    """The request exceeds a server limit, or the server is out of capacity."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(PosencError, ConnectionError):
    """The server could not be reached or is shutting down, and retries were exhausted."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(PosencError, TimeoutError):
    """The call did not finish within its timeout (also a built-in ``TimeoutError``)."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnauthenticatedError(PosencError):
    """The call lacks valid credentials."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(PosencError, PermissionError):
    """The caller is not allowed to make this call."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class CancelledError(PosencError):
    """The call was cancelled (by the server, or by closing the client).

    Not to be confused with :class:`asyncio.CancelledError`, which the async client lets
    through untouched when the awaiting task itself is cancelled.
    """

    default_code = grpc.StatusCode.CANCELLED


class NotFoundError(PosencError):
    """The requested entity (for example a health-checked service name) does not exist."""

    default_code = grpc.StatusCode.NOT_FOUND


class UnimplementedError(PosencError):
    """The server does not implement this method (an older or different server)."""

    default_code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(PosencError):
    """The server failed, or sent a response that breaks the protocol."""

    default_code = grpc.StatusCode.INTERNAL


_CLASS_BY_CODE: dict[grpc.StatusCode, type[PosencError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgumentError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        UnauthenticatedError,
        PermissionDeniedError,
        CancelledError,
        NotFoundError,
        UnimplementedError,
        InternalError,
    )
}
# DATA_LOSS is the server failing too; the remaining codes keep the generic base class.
_CLASS_BY_CODE[grpc.StatusCode.DATA_LOSS] = InternalError


def error_class_for_code(code: grpc.StatusCode) -> type[PosencError]:
    """Returns the exception class raised for a gRPC status code."""
    return _CLASS_BY_CODE.get(code, PosencError)
