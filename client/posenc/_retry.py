"""Failures: gRPC errors into :mod:`posenc.errors`, and which of them are retried (the
budget of retries one call spends is :class:`posenc._core.CallBudget`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from posenc.errors import (
    InvalidArgumentError,
    PosencError,
    UnavailableError,
    error_class_for_code,
)
from posenc.types import DEFAULT, Timeout

DEFAULT_TIMEOUT: Final = 60.0
DEFAULT_MAX_RETRIES: Final = 6
DEFAULT_RETRY_BACKOFF: Final = 0.1
#: Longest sleep between two retries. With the defaults the sleeps are 0.1, 0.2, 0.4, 0.8,
#: 1.6 and 2.0 s: about 5 s, enough for a replica to restart (its imports take 1-3 s).
MAX_RETRY_BACKOFF: Final = 2.0

_DETAILS_KEY: Final = "grpc-status-details-bin"
# What gRPC says of a call cancelled by its own client (cancel(), or the channel's close()).
_LOCAL_CANCELLATIONS: Final = frozenset({"Locally cancelled by application!", "Channel closed!"})
_TRANSPORT_CODES: Final = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
# Why no posenc server answers at a target, by what gRPC says of a call that never reached
# one, and whether that is said at once: each message names the target and the fix. A refused
# connection, or a unix socket with no file, is retried within the call's budget even by a
# client no server answered yet: a new client (every ``posenc fetch``) may start while its
# server restarts. A name that does not resolve, a TLS mismatch or a port that speaks HTTP/1
# is said at once: trying again fails the same way. A closed connection is retried: a server
# at its connection limit closes new ones too.
_NOBODY_THERE: Final = (
    (
        ("connection refused",),
        "no posenc server at {target} (connection refused): is it running?",
        False,
    ),
    (
        ("no such file or directory",),
        "no posenc server at {target} (no socket there): is it running?",
        False,
    ),
    (
        ("errors resolving", "dns resolution failed"),
        "no posenc server at {target}: its name does not resolve",
        True,
    ),
    (
        ("wrong_version_number",),
        "the server at {target} does not speak TLS: connect without TLS credentials "
        "(posenc commands: without --tls-ca)",
        True,
    ),
    (
        ("hostname verification",),
        "the certificate of the server at {target} does not carry the name connected to: "
        "give a name it carries (the channel option grpc.ssl_target_name_override; posenc "
        "commands: --tls-server-name)",
        True,
    ),
    (
        ("certificate_verify_failed",),
        "the certificate of the server at {target} is not signed by a CA this client "
        "trusts: trust its CA (grpc.ssl_channel_credentials(root_certificates=...); posenc "
        "commands: --tls-ca)",
        True,
    ),
    (
        ("failed parsing http/2",),
        "{target} answers, but not with gRPC (an HTTP/1 port, such as the metrics port?): "
        "posenc serves gRPC on --port, 50051 by default",
        True,
    ),
    (
        ("socket closed",),
        "the server at {target} closed every connection: a TLS server, called without TLS "
        "(grpc.ssl_channel_credentials(...); posenc commands: --tls-ca)? Or one at its "
        "--max-connections",
        False,
    ),
)


def _rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    try:
        return rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:
        # from_call insists the rich status repeats code and message exactly; the field
        # violations are worth having even from a server that gets that wrong.
        pass
    except (AttributeError, TypeError):
        return None  # not a call (e.g. a bare RpcError): no metadata to read
    metadata: Iterable[tuple[str, str | bytes]] = error.trailing_metadata() or ()  # type: ignore[assignment]
    for key, value in metadata:
        if key == _DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:
                return None
    return None


def _field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    status = _rich_status(error)
    if status is None:
        return []
    violations: list[tuple[str, str]] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            violations.extend((v.field, v.description) for v in bad_request.field_violations)
    return violations


def map_rpc_error(error: grpc.RpcError) -> PosencError:
    """The SDK exception for a failed call (sync and aio errors alike)."""
    try:
        code = error.code()
        details = error.details() or ""
    except (AttributeError, TypeError):
        return PosencError(str(error) or type(error).__name__)
    cls = error_class_for_code(code)
    if issubclass(cls, InvalidArgumentError):
        return cls(details, code=code, field_violations=_field_violations(error))
    return cls(details, code=code, retry_after=_retry_after(error))


def _retry_after(error: grpc.RpcError) -> float | None:
    """The delay of a ``google.rpc.RetryInfo`` detail, if the status carries one."""
    status = _rich_status(error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return float(info.retry_delay.ToTimedelta().total_seconds())
    return None


def is_transient(error: PosencError) -> bool:
    """Whether the same request may succeed when tried again.

    UNAVAILABLE; RESOURCE_EXHAUSTED when the server says when to retry (RetryInfo: it is at
    a concurrency limit, unlike a request over a size limit); the INTERNAL or UNKNOWN
    "Stream removed" that gRPC reports when an HTTP/2 stream is reset or ended without a
    status under it (a proxy such as nginx does either to a client's stream when its
    upstream replica dies); and a CANCELLED this client did not cause: a gRPC server that
    stops cancels the calls that reached it in that instant, before any handler saw them (a
    replica stopping behind a balancer does it too). The server's own INTERNAL or UNKNOWN
    is a bug and is not retried. Every posenc call only reads, so repeating one is safe.
    """
    if error.code == grpc.StatusCode.UNAVAILABLE:
        return True
    if error.code == grpc.StatusCode.CANCELLED:
        return error.details not in _LOCAL_CANCELLATIONS
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return error.retry_after is not None
    # gRPC's words for a stream its transport ended under it: reset (INTERNAL), or ended by
    # the peer without a status (UNKNOWN: a proxy whose upstream replica was killed).
    return error.code in _TRANSPORT_CODES and error.details.startswith("Stream removed")


def nobody_there(
    mapped: PosencError, target: str, failures: int
) -> tuple[UnavailableError | None, bool]:
    """The error that says no server was ever at ``target``, when ``mapped`` (the failure of
    a client that no server answered yet, after ``failures`` earlier failed attempts) says
    why (see ``_NOBODY_THERE``), and whether it is said at once; else None."""
    if mapped.code != grpc.StatusCode.UNAVAILABLE:
        return None, False
    details = mapped.details.lower()
    for signs, why, at_once in _NOBODY_THERE:
        if any(sign in details for sign in signs):
            attempts = f" (after {failures + 1} attempts)" if failures else ""
            message = f"{why.format(target=target)} ({mapped.details})"
            return UnavailableError(message + attempts, code=mapped.code), at_once
    return None, False


def resolve_timeout(timeout: Timeout, default: float | None) -> float | None:
    """A per-call ``timeout=`` argument, with ``DEFAULT`` meaning the client's default."""
    if timeout is DEFAULT:
        return default
    if timeout is not None and (not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return timeout
