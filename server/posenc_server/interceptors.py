"""The one place around every call: authentication, per-call metrics, and status codes.

Handlers raise domain errors (``posenc_server.errors``); here each becomes its status code,
with ``google.rpc`` details (BadRequest field violations, RetryInfo). Anything else is a bug
and becomes INTERNAL, logged with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from posenc_server import metrics
from posenc_server.auth import BearerToken
from posenc_server.errors import (
    MAX_MESSAGE_CHARS,
    InvalidRequestError,
    LimitExceededError,
    OverloadedError,
    RequestTimeoutError,
    ShuttingDownError,
    bounded,
)

log = logging.getLogger("posenc_server")

if TYPE_CHECKING:  # grpc-stubs makes these generic; the real classes are not
    _Handler = grpc.RpcMethodHandler[Any, Any]
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Handler = grpc.RpcMethodHandler
    _Interceptor = grpc.aio.ServerInterceptor
_Context = grpc.aio.ServicerContext[bytes, bytes]
_Behaviour = Callable[[AsyncIterator[bytes], _Context], AsyncIterator[bytes]]

UNKNOWN_METHOD = "unknown"
"""The ``method`` label of every call to a method the server does not serve."""


class ServingInterceptor(_Interceptor):
    """Authenticates every call (with a token), and serves the methods of ``services``
    through ``serve``: metrics and status codes. Other streaming methods (reflection) get
    each request message within ``read_timeout`` seconds, as ``services`` read theirs.

    Metric labels come from a fixed set, ``methods`` (the short names of every method the
    server serves) and ``UNKNOWN_METHOD``: a caller cannot grow the metrics by inventing
    method names.
    """

    def __init__(
        self,
        services: tuple[str, ...],
        methods: frozenset[str],
        streaming: frozenset[str],
        read_timeout: float,
        token: BearerToken | None = None,
    ) -> None:
        self._prefixes = tuple(f"/{service}/" for service in services)
        self._read_timeout = read_timeout
        self._token = token
        self._streaming = streaming
        self._metrics = {name: metrics.MethodMetrics(name) for name in methods}
        self._unknown = metrics.MethodMetrics(UNKNOWN_METHOD)
        # Wrapped handlers by method: the generic handler returns the same one every time.
        self._wrapped: dict[str, tuple[_Handler, _Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> _Handler:
        """Refuse an unauthenticated call, or serve the call through the wrapper."""
        method: str = details.method
        if self._token is not None and not self._token.allows(details):
            self._method_metrics(method).record("UNAUTHENTICATED", None)
            return _DENY
        handler = await continuation(details)
        if handler is None:
            return handler  # type: ignore[return-value]  # None: gRPC answers UNIMPLEMENTED
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        if not method.startswith(self._prefixes):
            if handler.stream_stream is None:
                return handler
            wrapped = grpc.stream_stream_rpc_method_handler(
                _reads_within(handler.stream_stream, self._read_timeout),  # type: ignore[arg-type]
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
            self._wrapped[method] = (handler, wrapped)
            return wrapped
        assert handler.stream_stream is not None, "add_to_server registers streams"
        name = method.rsplit("/", 1)[-1]
        behaviour: _Behaviour = handler.stream_stream  # type: ignore[assignment]  # async
        wrapped = grpc.stream_stream_rpc_method_handler(
            _serve(behaviour, self._method_metrics(method), name in self._streaming)
        )
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _method_metrics(self, method: str) -> metrics.MethodMetrics:
        return self._metrics.get(method.rsplit("/", 1)[-1], self._unknown)


async def _refuse(requests: AsyncIterator[bytes], context: _Context) -> AsyncIterator[bytes]:
    # Ends the call at once, without reading its request: an unauthenticated caller holds
    # nothing, whatever kind of call it makes and whether it sends a message or not.
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
    yield b""  # never reached: makes this an async generator, as stream handlers are


_DENY: _Handler = grpc.stream_stream_rpc_method_handler(_refuse)


def _serve(
    behaviour: _Behaviour, method_metrics: metrics.MethodMetrics, streaming: bool
) -> _Behaviour:
    async def serve(requests: AsyncIterator[bytes], context: _Context) -> AsyncIterator[bytes]:
        started = time.perf_counter()
        failure: grpc.Status | None = None
        if streaming:
            metrics.STREAMS_IN_FLIGHT.inc()
        try:
            # Closed here, not whenever it is collected: its cleanup (admission) runs now.
            async with contextlib.aclosing(behaviour(requests, context)) as messages:  # type: ignore[type-var]
                async for message in messages:
                    method_metrics.payload_bytes.inc(len(message))
                    yield message
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled, its deadline passed, or the connection closed.
            method_metrics.record("CANCELLED", time.perf_counter() - started)
            raise
        except grpc.aio.AbortError:
            raise  # already answered
        except Exception as error:
            failure = _failure(error, method_metrics, started)
        else:
            method_metrics.record("OK", time.perf_counter() - started)
        finally:
            if streaming:
                metrics.STREAMS_IN_FLIGHT.dec()
        if failure is not None:
            # Answered once the error is gone: its traceback holds the handler's frames, the
            # request among their locals, and gRPC keeps the abort's exception (and so any
            # exception it was raised during) in a reference cycle with the call, which only
            # the cyclic collector frees. Raised in the except clause, every refused request
            # would stay in memory until that collector ran, outside the in-flight budget.
            await context.abort_with_status(failure)  # type: ignore[attr-defined]  # no stubs

    return serve


def _reads_within(behaviour: _Behaviour, timeout: float) -> _Behaviour:
    """``behaviour`` with each request message due within ``timeout`` seconds of the call's
    start or of the previous message: a call whose request does not come ends with
    DEADLINE_EXCEEDED instead of lasting as long as its connection."""

    async def serve(requests: AsyncIterator[Any], context: _Context) -> AsyncIterator[Any]:
        async def timed() -> AsyncIterator[Any]:
            iterator = aiter(requests)
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        request = await anext(iterator)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no request message within {timeout:g} s (--read-timeout-seconds)",
                    )
                yield request

        async for response in behaviour(timed(), context):
            yield response

    return serve


def _failure(
    error: Exception, method_metrics: metrics.MethodMetrics, started: float
) -> grpc.Status:
    """Record the failed call; the status that answers it."""
    if isinstance(error, InvalidRequestError):
        code, status = "INVALID_ARGUMENT", _bad_request_status(error)
    elif isinstance(error, OverloadedError):
        code, status = "RESOURCE_EXHAUSTED", _overloaded_status(error)
        method_metrics.overload_refusals.inc()
    elif isinstance(error, LimitExceededError):
        code, status = "RESOURCE_EXHAUSTED", _status(code_pb2.RESOURCE_EXHAUSTED, error)
    elif isinstance(error, ShuttingDownError):
        code, status = "UNAVAILABLE", _status(code_pb2.UNAVAILABLE, error)
    elif isinstance(error, RequestTimeoutError):
        code, status = "DEADLINE_EXCEEDED", _status(code_pb2.DEADLINE_EXCEEDED, error)
    else:
        code = "INTERNAL"
        log.error("unexpected error while serving a request", exc_info=error)
        status = _status(code_pb2.INTERNAL, "internal error; see the server log")
    method_metrics.record(code, time.perf_counter() - started)
    return status


def _message(error: object) -> str:
    """The status message of ``error``, bounded whatever the request held."""
    return bounded(str(error), MAX_MESSAGE_CHARS)


def _status(code: int, message: object) -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(code=code, message=_message(message)))


def _overloaded_status(error: OverloadedError) -> grpc.Status:
    # google.rpc.RetryInfo tells clients this RESOURCE_EXHAUSTED is worth retrying (unlike
    # a request over a size limit) and when.
    details = any_pb2.Any()
    details.Pack(
        error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(
                nanos=int(error.retry_after_seconds % 1 * 1e9),
                seconds=int(error.retry_after_seconds),
            )
        )
    )
    return rpc_status.to_status(
        status_pb2.Status(
            code=code_pb2.RESOURCE_EXHAUSTED, message=_message(error), details=[details]
        )
    )


def _bad_request_status(error: InvalidRequestError) -> grpc.Status:
    details = any_pb2.Any()
    details.Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=violation.field, description=violation.description
                )
                for violation in error.violations
            ]
        )
    )
    return rpc_status.to_status(
        status_pb2.Status(
            code=code_pb2.INVALID_ARGUMENT, message=_message(error), details=[details]
        )
    )
