"""The standard health service (``grpc.health.v1.Health``: Check, Watch, List), bounded.

Health answers every caller, token or not, and stays out of the encoding calls' admission so
that it always answers; what a caller can make it hold is bounded here instead:

- a request is read only once admitted against a byte budget of its own, one largest request
  at a time (a probe's request is read in microseconds), within the read timeout, and a read
  stalled half a second gives its room up to a call that waits for it, as encoding calls'
  reads do. Read as gRPC reads a unary request, every health call could hold a request of
  the largest size at once, outside any budget. A Check that finds the read slot busy does
  not wait for it: it answers the whole server's status without reading its request (every
  service served shares that status), so that calls which send headers and never their
  request cannot queue the probes, and the supervisor's checks, behind them until they fail;
- a service name is at most ``MAX_SERVICE_NAME`` characters (the names served are a few
  dozen), so a Watch stream, which keeps its name while it is open, keeps little;
- at most ``MAX_WATCHES`` Watch streams are open at once: each holds its stream's state
  for as long as the caller keeps it open.

A Watch writes its status and then each change of it, as the reference servicer does, but
never while holding the lock that setting a status takes: a watcher that does not read
cannot hold up the drain's NOT_SERVING.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Final

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from posenc_server import convert
from posenc_server.admission import READ_COPIES, ByteBudget
from posenc_server.errors import FieldViolation, InvalidRequestError, OverloadedError
from posenc_server.servicer import read_request

SERVICE_NAME: Final = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
METHOD_NAMES: Final = tuple(health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name)
MAX_SERVICE_NAME: Final = 256
"""The longest service name a call may ask about."""
MAX_WATCHES: Final = 1024
"""The most Watch streams open at once in a process."""

SERVING: Final = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN: Final = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
_PARSE: Final = convert.tolerant_parser(health_pb2.HealthCheckRequest)
_PARSE_LIST: Final = convert.tolerant_parser(health_pb2.HealthListRequest)
# Health requests are read when one fits; a waiting probe takes a stalled read's room.
_PREEMPT_AFTER_SECONDS: Final = 0.5
_RETRY_AFTER_SECONDS: Final = 0.2
_WATCH_RETRY_AFTER_SECONDS: Final = 5.0

_Context = grpc.aio.ServicerContext[bytes, bytes]


class Health:
    """The statuses of the served services, and the health methods that report them."""

    def __init__(self, max_request_bytes: int, read_timeout: float, wait_seconds: float) -> None:
        """``max_request_bytes``: the server's receive limit; ``read_timeout``: how long a
        call's request may take to arrive; ``wait_seconds``: how long a call waits to read."""
        largest = READ_COPIES * max_request_bytes
        self._budget = ByteBudget(
            largest, wait_seconds, _RETRY_AFTER_SECONDS, _PREEMPT_AFTER_SECONDS
        )
        self._largest = largest
        self._read_timeout = read_timeout
        self._statuses: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType] = {
            "": SERVING
        }
        self._changed = asyncio.Condition()
        self._shutting_down = False
        self._watches = 0
        self.unread_checks = 0
        """Checks answered without reading their request (the read slot was busy)."""

    async def set(
        self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType
    ) -> None:
        """Set ``service``'s status (ignored once the drain began)."""
        if not self._shutting_down:
            async with self._changed:
                self._statuses[service] = status
                self._changed.notify_all()

    def status(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType | None:
        """``service``'s status; None for a service not served."""
        return self._statuses.get(service)

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good."""
        async with self._changed:
            self._shutting_down = True
            for service in self._statuses:
                self._statuses[service] = NOT_SERVING
            self._changed.notify_all()

    async def Check(
        self, requests: AsyncIterator[bytes], context: _Context
    ) -> AsyncIterator[bytes]:
        """The status of the service asked about; NOT_FOUND for one not served.

        While another call reads its request (one at a time), Check answers without
        reading its own: the status of the whole server, which every service served shares.
        Calls that send headers and never their request would otherwise queue probes behind
        them, however fast they come (see the module's docstring).
        """
        if not self._budget.fits_now(self._largest):
            self.unread_checks += 1
            yield health_pb2.HealthCheckResponse(status=self._statuses[""]).SerializeToString()
            return
        service = await self._service_asked(context)
        status = self._statuses.get(service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {service!r} here")
        yield health_pb2.HealthCheckResponse(status=status).SerializeToString()

    async def Watch(
        self, requests: AsyncIterator[bytes], context: _Context
    ) -> AsyncIterator[bytes]:
        """The status of the service asked about (SERVICE_UNKNOWN for one not served),
        then each change of it."""
        service = await self._service_asked(context)
        if self._watches >= MAX_WATCHES:
            raise OverloadedError(
                f"this server process already serves {MAX_WATCHES} health Watch streams, its "
                "limit: use Check, or retry later",
                retry_after_seconds=_WATCH_RETRY_AFTER_SECONDS,
            )
        self._watches += 1
        try:
            sent = None
            while True:
                async with self._changed:
                    while (status := self._statuses.get(service, _UNKNOWN)) == sent:
                        await self._changed.wait()
                sent = status
                yield health_pb2.HealthCheckResponse(status=status).SerializeToString()
        finally:
            self._watches -= 1

    async def List(self, requests: AsyncIterator[bytes], context: _Context) -> AsyncIterator[bytes]:
        """Every service served, with its status."""
        convert.parsed(_PARSE_LIST(await self._read(context)))
        response = health_pb2.HealthListResponse()
        for service, status in self._statuses.items():
            response.statuses[service].status = status
        yield response.SerializeToString()

    async def _service_asked(self, context: _Context) -> str:
        service: str = convert.parsed(_PARSE(await self._read(context))).service
        if len(service) > MAX_SERVICE_NAME:
            raise InvalidRequestError(
                [
                    FieldViolation(
                        "service",
                        f"must be at most {MAX_SERVICE_NAME} characters, got {len(service)}",
                    )
                ]
            )
        return service

    async def _read(self, context: _Context) -> bytes:
        """The call's request, read once its largest size fits the health budget; the room
        is given back as soon as it is read (the request is small, or refused)."""
        async with self._budget.admitted(
            self._largest, reading=True, peer=context.peer()
        ) as reservation:
            return await read_request(
                context, reservation, self._read_timeout, _RETRY_AFTER_SECONDS
            )


# The private line's requests: a Check naming a service (the supervisor names none).
_PRIVATE_MAX_REQUEST_BYTES: Final = 1024


async def _private_check(
    health: Health, request: health_pb2.HealthCheckRequest, context: _Context
) -> health_pb2.HealthCheckResponse:
    status = health.status(request.service)
    if status is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such service here")
    return health_pb2.HealthCheckResponse(status=status)


async def serve_private(health: Health, address: str) -> grpc.aio.Server:
    """Serve ``health``'s Check alone on ``address`` (a unix socket in a directory only the
    server's user may enter): the supervisor's line to this one worker.

    Nothing else is served there, and its requests are at most
    ``_PRIVATE_MAX_REQUEST_BYTES``: gRPC reads them whole before the handler runs, with
    no admission to wait for, so the supervisor's check never queues behind the callers of
    the public port, however many of them stall.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", _PRIVATE_MAX_REQUEST_BYTES),
            ("grpc.max_concurrent_streams", 4),
        ]
    )

    async def check(
        request: health_pb2.HealthCheckRequest, context: _Context
    ) -> health_pb2.HealthCheckResponse:
        return await _private_check(health, request, context)

    handler = grpc.unary_unary_rpc_method_handler(
        check,
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Check": handler}),)
    )
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server


def add_to_server(health: Health, server: grpc.aio.Server) -> None:
    """Register ``health``'s methods, each as a stream of serialized bytes (as the encoding
    methods are, so that the request is read when the handler asks)."""
    handlers = {
        name: grpc.stream_stream_rpc_method_handler(getattr(health, name)) for name in METHOD_NAMES
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
