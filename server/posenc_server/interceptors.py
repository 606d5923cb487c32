"""The one place around every call: authentication, per-call metrics, and status codes.

Handlers raise domain errors (``posenc_server.errors``); here each becomes its status code,
with ``google.rpc`` details (BadRequest field violations, RetryInfo). Anything else is a bug
and becomes INTERNAL, logged with its traceback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from posenc_server import metrics
from posenc_server.auth import BearerToken
from posenc_server.errors import (
    InvalidRequestError,
    LimitExceededError,
    OverloadedError,
    ShuttingDownError,
)

log = logging.getLogger("posenc_server")

if TYPE_CHECKING:  # grpc-stubs makes the interceptor generic; the real class is not
    _Interceptor = grpc.ServerInterceptor[Any, Any]
    _Handler = grpc.RpcMethodHandler[Any, Any]
else:
    _Interceptor = grpc.ServerInterceptor
    _Handler = grpc.RpcMethodHandler


class ServingInterceptor(_Interceptor):
    """Authenticates every call (with a token), and serves the methods of ``service``
    through ``serve``: metrics and status codes."""

    def __init__(self, service: str, token: BearerToken | None = None) -> None:
        self._prefix = f"/{service}/"
        self._token = token
        self._metrics: dict[str, metrics.MethodMetrics] = {}
        # Wrapped handlers by method: the generic handler returns the same one every time.
        self._wrapped: dict[str, tuple[_Handler, _Handler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], _Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        """Refuse an unauthenticated call, or serve the call through the wrapper."""
        method: str = details.method
        if self._token is not None and not self._token.allows(details):
            self._method_metrics(method).record("UNAUTHENTICATED", None)
            return _DENY
        handler = continuation(details)
        if handler is None or not method.startswith(self._prefix):
            return handler
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(handler, self._method_metrics(method))
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _method_metrics(self, method: str) -> metrics.MethodMetrics:
        name = method.rsplit("/", 1)[-1]
        found = self._metrics.get(name)
        if found is None:
            found = self._metrics[name] = metrics.MethodMetrics(name)
        return found

    @staticmethod
    def _wrap(handler: _Handler, method_metrics: metrics.MethodMetrics) -> _Handler:
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _serve_stream(handler.unary_stream, method_metrics),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        assert handler.unary_unary is not None, "the service has unary and stream methods only"
        return grpc.unary_unary_rpc_method_handler(
            _serve_unary(handler.unary_unary, method_metrics),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _refuse(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


# Aborting before any response works for every kind of call, streams included.
_DENY: _Handler = grpc.unary_unary_rpc_method_handler(_refuse)


def _serve_unary(
    behaviour: Callable[[Any, grpc.ServicerContext], Any], method_metrics: metrics.MethodMetrics
) -> Callable[[Any, grpc.ServicerContext], Any]:
    def serve(request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            response = behaviour(request, context)
        except BaseException as error:
            _fail(error, context, method_metrics, started)
            raise
        if isinstance(response, bytes):
            method_metrics.payload_bytes.inc(len(response))
        method_metrics.record("OK", time.perf_counter() - started)
        return response

    return serve


def _serve_stream(
    behaviour: Callable[[Any, grpc.ServicerContext], Iterator[bytes]],
    method_metrics: metrics.MethodMetrics,
) -> Callable[[Any, grpc.ServicerContext], Iterator[bytes]]:
    def serve(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        started = time.perf_counter()
        metrics.STREAMS_IN_FLIGHT.inc()
        responses: Iterator[bytes] | None = None
        try:
            responses = behaviour(request, context)
            for message in responses:
                method_metrics.payload_bytes.inc(len(message))
                yield message
        except BaseException as error:
            _fail(error, context, method_metrics, started)
            raise
        else:
            method_metrics.record("OK", time.perf_counter() - started)
        finally:
            metrics.STREAMS_IN_FLIGHT.dec()
            close = getattr(responses, "close", None)
            if close is not None:  # a generator: run its cleanup (admission) now
                close()

    return serve


def _fail(
    error: BaseException,
    context: grpc.ServicerContext,
    method_metrics: metrics.MethodMetrics,
    started: float,
) -> None:
    """Record the failed call and answer its status; returns only for errors to re-raise."""
    status: grpc.Status | None = None
    if isinstance(error, InvalidRequestError):
        code, status = "INVALID_ARGUMENT", _bad_request_status(error)
    elif isinstance(error, OverloadedError):
        code, status = "RESOURCE_EXHAUSTED", _overloaded_status(error)
    elif isinstance(error, LimitExceededError):
        code, status = "RESOURCE_EXHAUSTED", _status(code_pb2.RESOURCE_EXHAUSTED, error)
    elif isinstance(error, ShuttingDownError):
        code, status = "UNAVAILABLE", _status(code_pb2.UNAVAILABLE, error)
    elif isinstance(error, GeneratorExit):
        # gRPC closes a stream's generator when the client cancels or its deadline passes.
        code = "CANCELLED"
    elif not isinstance(error, Exception):
        code = "INTERNAL"  # KeyboardInterrupt and the like: let them through
    elif not context.is_active():
        code = "CANCELLED"  # the client went away: nothing to answer
    else:
        code = "INTERNAL"
        log.error("unexpected error while serving a request", exc_info=error)
        status = _status(code_pb2.INTERNAL, "internal error; see the server log")
    method_metrics.record(code, time.perf_counter() - started)
    if status is not None:
        context.abort_with_status(status)  # raises
    if code == "CANCELLED" and isinstance(error, Exception):
        # Nowhere to send it: end the call quietly rather than log a traceback.
        context.abort(grpc.StatusCode.CANCELLED, "the client went away")


def _status(code: int, message: object) -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(code=code, message=str(message)))


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
        status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(error), details=[details])
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
        status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(error), details=[details])
    )
