"""The gRPC servicer, on the asyncio server: each call reads its request, is admitted against
the byte budget, and runs its CPU work (parsing, resolving the spec, computing rows) on a
bounded thread pool; a cold range streamed with the process to itself computes its blocks
on the event loop (see ``_computes_here``).

Why asyncio: a call waiting for its request message, or for a client to read its response,
holds no thread, only a coroutine. With the threaded server each such call held one of the
pool's threads, so a few dozen headers-only calls froze a process, health checks included.
Here they cost a few kilobytes each, the pool only ever runs work that is ready, and a
request that does not arrive within ``read_timeout_seconds`` ends the call.

Every method is registered as a bidirectional stream: on the wire a unary call is the same
(one message each way), and it lets the handler read the request with a deadline and await
each response message until gRPC has handed it to the connection, which is when its bytes
leave the admission budget. Status codes, metrics and authentication are ``interceptors``';
limits and the wire format are the service's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any, Final, TypeVar

import grpc
import grpc.aio

from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_server import admission, convert, metrics
from posenc_server.admission import ByteBudget, Reservation
from posenc_server.config import ServerConfig
from posenc_server.errors import (
    FieldViolation,
    InvalidRequestError,
    OverloadedError,
    RequestTimeoutError,
    ShuttingDownError,
)
from posenc_server.requests import PositionRange, Query
from posenc_server.service import SHUTTING_DOWN, EncodingService, ServerInfo, StreamSteps
from posenc_server.shm import SharedPool, rows_of
from posenc_server.specs import Request, SpecTable

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PositionalEncodingService"].full_name
METHOD_NAMES = tuple(pb.DESCRIPTOR.services_by_name["PositionalEncodingService"].methods_by_name)
"""The service's method names; the streaming one is served by ``StreamEncoding``."""
STREAMING_METHODS = frozenset({"StreamEncoding"})

T = TypeVar("T")

# Requests up to this size (a few hundred positions) with results up to this size may be
# answered on the event loop (see _unary_from_cache). 1 MiB: a 64-sequence decode step of
# d_model 4096, whose gather and copy cost less server CPU than the trip to the pool and
# back.
_INLINE_REQUEST_BYTES = 4096
_INLINE_RESULT_BYTES = 1 << 20
# A range's stream step may run on the event loop while each takes at most this long
# (see _computes_here): a block takes at most a few milliseconds in any dtype, less than
# the hand-off to the pool and back adds to it.
_INLINE_STEP_SECONDS = 0.005
_QUIET_SECONDS = 0.1
_GET_ENCODING = convert.tolerant_parser(pb.GetEncodingRequest)
_STREAM_ENCODING = convert.tolerant_parser(pb.StreamEncodingRequest)
_SERVER_INFO = convert.tolerant_parser(pb.GetServerInfoRequest)


class PositionalEncodingServicer:
    """Implements posenc.v1.PositionalEncodingService over an EncodingService."""

    def __init__(
        self,
        config: ServerConfig,
        specs: SpecTable,
        service: EncodingService,
        version: str,
        pool: Executor,
        budget: ByteBudget,
        shared: SharedPool | None = None,
    ) -> None:
        self._config = config
        self._shared = shared
        self._specs = specs
        self._service = service
        self._version = version
        self._pool = pool
        self._budget = budget
        self._last_call = 0.0  # monotonic time the latest call started (_computes_here)

    async def GetEncoding(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        """A small table in one (serialized GetEncodingResponse) message."""
        # Admitted for the largest unary response at once, so that parsing and computing
        # take one trip to the pool (a decode step's latency); then only the message's
        # bytes stay held until gRPC has handed them to the connection.
        largest = admission.unary_cost(self._config.max_unary_bytes)
        async with self._admitted(context, largest) as (reservation, raw):
            query = self._small_query(_GET_ENCODING, raw)
            # Over the unix socket only: its peers may map the rows (see shm).
            shared = self._shared
            if (
                shared is not None
                and (query is None or query.shared_session)
                and context.peer().startswith("unix:")
            ):
                placed = await self._run(self._place, shared, raw, query)
                await reservation.settle(len(placed))
                yield placed
                return
            message = None if query is None else self._unary_from_cache(query)
            if message is None:  # parsed once: a new spec's step pays the parse once
                message = await self._run(self._unary, raw, query)
            await reservation.settle(len(message))
            yield message

    async def StreamEncoding(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        """A table of any size as row-aligned chunks (serialized responses)."""
        async with self._admitted(context, 0) as (reservation, raw):
            started = self._last_call  # this call's, before any other can come (no await)
            # A known spec's small request is parsed here: a warm stream then needs no
            # worker at all, however busy they are.
            query = self._small_query(_STREAM_ENCODING, raw)
            request = None if query is None else self._specs.known(query)
            if request is None:
                request = await self._run(self._resolve, _STREAM_ENCODING, raw, query)
            chunk_bytes = request.max_chunk_bytes or self._config.max_chunk_bytes
            await reservation.grow(_response_cost(request, chunk_bytes))
            loop = asyncio.get_running_loop()
            steps = self._service.stream(request)
            ahead: asyncio.Future[tuple[bytes | None, float]] | None = None
            try:
                # Cached blocks' messages are taken here, on the loop. Steps that compute
                # run on the pool, each started before the message in hand is sent (the
                # engine releases the GIL), unless cheap enough to run here (_computes_here).
                message: bytes | None = None
                cost: float | None = None  # seconds the last step that computed took
                while True:
                    following = _step(steps, may_compute=False)
                    if following is None and self._computes_here(request, cost, started):
                        following, cost = _timed_step(steps)
                    if following is None:
                        ahead = loop.run_in_executor(self._pool, _timed_step, steps)
                        if message is not None:
                            yield message
                        following, cost = await ahead
                        ahead = None
                    elif message is not None:
                        yield message
                    if following is _END:
                        return
                    message = following
            finally:
                if ahead is not None:
                    ahead.cancel()  # a step still running is not awaited: its outcome is moot
                # Runs the generator's cleanup (the stream count) on the pool: it may still
                # be computing a chunk for a call cancelled meanwhile.
                self._pool.submit(_close_when_idle, steps)

    async def GetServerInfo(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        """Describe this server: the process that answers (``server_id``), and the cache
        and computation counters of the whole server, all its processes summed."""
        async with self._admitted(context, 0) as (_, raw):
            convert.parsed(_SERVER_INFO(raw))
            info = await self._run(self._server_info)
        yield convert.server_info_response(info).SerializeToString()

    def _server_info(self) -> ServerInfo:
        info = self._service.info(self._version)
        cache, rows_computed = metrics.server_totals(info.cache, info.rows_computed)
        return dataclasses.replace(info, cache=cache, rows_computed=rows_computed)

    # Plumbing -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _admitted(
        self, context: grpc.aio.ServicerContext[bytes, bytes], extra: int
    ) -> AsyncIterator[tuple[Reservation, bytes]]:
        """Admit the call for the largest request allowed, read its request, then hold what
        that request costs (see ``admission``) and ``extra`` until the block ends.

        Reading is admitted first because gRPC takes a request message whole, whatever its
        size, once the handler asks for it; until then a call holds at most the 64 KiB
        flow-control window.
        """
        # A draining server says so (UNAVAILABLE: try another replica), whatever its memory.
        if self._service.draining:
            raise ShuttingDownError(SHUTTING_DOWN)
        self._last_call = time.monotonic()
        largest = admission.READ_COPIES * self._config.max_receive_message_bytes
        async with self._budget.admitted(largest, reading=True, peer=context.peer()) as reservation:
            raw = await read_request(
                context,
                reservation,
                self._config.read_timeout_seconds,
                self._budget.retry_after_seconds,
            )
            await reservation.settle(admission.request_cost(raw) + extra)
            yield reservation, raw

    def _small_query(self, parse: Callable[[bytes], Any], raw: bytes) -> Query | None:
        """The query of a small request, parsed on the event loop; None for a large one."""
        if len(raw) > _INLINE_REQUEST_BYTES:
            return None
        return convert.encoding_query(parse(raw), self._config)

    def _unary_from_cache(self, query: Query) -> bytes | None:
        """A decode step's answer on the event loop, or None for the pool to answer.

        A small request for a known spec whose rows are all cached costs tens of
        microseconds, less than the trip to the pool and back (about half a millisecond of a
        decode step's latency); anything that may compute (a new spec, a missing block) or
        copy more than a MiB goes to the pool, so the loop stays free for health checks and
        I/O.
        """
        request = self._specs.known(query)
        if (
            request is None
            or request.selection.rows * request.spec.row_bytes > _INLINE_RESULT_BYTES
        ):
            return None
        if not self._service.cached(request):
            return None
        return self._service.unary(request)

    def _computes_here(self, request: Request, cost: float | None, started: float) -> bool:
        """Whether the next step of a stream (``started`` at that monotonic time) that
        computes runs on the event loop: a range's (a step computes at most one block),
        after a first step on the pool (which also prepares a new spec) and while each
        takes at most ``_INLINE_STEP_SECONDS``, while the stream has the process to
        itself: no other stream in flight, no other call for ``_QUIET_SECONDS``.

        Computing on the pool costs a cold stream more than the computing itself: the trip
        there and back, and rows written on one core then sent from another. But a call
        that comes meanwhile waits for a step at each of its turns on the loop: so other
        calls send the stream's steps back to the pool, whose threads also compute several
        streams on several cores.
        """
        last_call = self._last_call
        return (
            cost is not None
            and cost <= _INLINE_STEP_SECONDS
            and isinstance(request.selection, PositionRange)
            and self._service.streams == 1
            and (last_call <= started or time.monotonic() - last_call > _QUIET_SECONDS)
        )

    def _place(self, shared: SharedPool, raw: bytes, query: Query | None) -> bytes:
        """GetEncoding over the unix socket: a range's rows placed in shared memory for the
        request's session when it has one and they fit there, else the response as without
        shared memory."""
        if query is None:
            query = convert.encoding_query(_GET_ENCODING(raw), self._config)
        request = self._specs.resolve(query)
        spec, selection = request.spec, request.selection
        nbytes = selection.rows * spec.row_bytes
        if (
            query.shared_session
            and isinstance(selection, PositionRange)
            and 0 < nbytes <= self._config.max_stream_bytes
        ):

            def fill(view: memoryview) -> None:
                self._service.fill(request, rows_of(view, spec.encoding.dtype, spec.width))

            key = (query.spec_key, selection.start, selection.stop)
            placed = shared.place(query.shared_session, key, nbytes, fill)
            if placed is not None:
                offset, lease = placed
                return convert.shared_response(
                    spec.dtype_code, selection.rows, spec.width, offset, lease
                )
        return self._service.unary(request)

    def _unary(self, raw: bytes, query: Query | None) -> bytes:
        return self._service.unary(self._resolve(_GET_ENCODING, raw, query))

    def _resolve(self, parse: Callable[[bytes], Any], raw: bytes, query: Query | None) -> Request:
        """The request of ``raw`` (``query``: its query, when parsed already)."""
        if query is None:
            query = convert.encoding_query(parse(raw), self._config)
        return self._specs.resolve(query)

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the pool: CPU work never runs on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(function, *args))


async def read_request(
    context: grpc.aio.ServicerContext[bytes, bytes],
    reservation: Reservation,
    timeout: float,
    retry_after: float,
) -> bytes:
    """The call's one request message; RequestTimeoutError once ``timeout`` has passed, or
    OverloadedError (retry after ``retry_after`` s) when another call took over the
    reservation (see ``admission``)."""
    reservation.reader = asyncio.current_task()
    try:
        async with asyncio.timeout(timeout):
            if reservation.preempted:  # before it could start: cancelled nothing
                raise asyncio.CancelledError
            message = await context.read()
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request message did not arrive within {timeout:g} s of the call's "
            "headers (--read-timeout-seconds)"
        ) from None
    except asyncio.CancelledError:
        if not reservation.preempted or (task := asyncio.current_task()) is None:
            raise
        task.uncancel()  # cancelled by the preemption, not by gRPC
        raise OverloadedError(
            "the request message did not arrive while other calls waited for memory to "
            "read theirs: retry",
            retry_after_seconds=retry_after,
        ) from None
    finally:
        reservation.reader = None
    if message is grpc.aio.EOF:  # type: ignore[attr-defined]  # not in the stubs
        raise InvalidRequestError([FieldViolation("request", "the call sent no request")])
    assert isinstance(message, bytes)
    return message


def _response_cost(request: Request, chunk_bytes: int | None) -> int:
    spec = request.spec
    return admission.response_cost(request.selection.rows, spec.width, spec.row_bytes, chunk_bytes)


_END: Final = b""
"""``_step``'s mark of a stream's end (no message is empty: each holds a header)."""


def _step(steps: StreamSteps, may_compute: bool) -> bytes | None:
    """The stream's next message, or ``_END``; None when it must be computed and
    ``may_compute`` is false."""
    try:
        return steps.send(True if may_compute else None)
    except StopIteration:
        return _END


def _timed_step(steps: StreamSteps) -> tuple[bytes | None, float]:
    """The stream's next message, computed if need be, and the seconds it took: wall time,
    which is the CPU's on the loop and no less on the pool (a thread's CPU clock is a system
    call, an order of magnitude dearer than the wall clock)."""
    started = time.perf_counter()
    message = _step(steps, may_compute=True)
    return message, time.perf_counter() - started


def _close_when_idle(steps: StreamSteps) -> None:
    # A call cancelled while its next chunk was being computed leaves that step running on
    # another thread: close the generator (running its cleanup) once the step is over.
    close: Callable[[], None] | None = getattr(steps, "close", None)
    while close is not None:
        try:
            close()
            return
        except ValueError:  # "generator already executing"
            time.sleep(0.001)


def add_to_server(servicer: PositionalEncodingServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer``'s methods, each as a bidirectional stream of serialized bytes
    (see the module's docstring); requests are parsed by tolerant parsers (malformed bytes
    become INVALID_ARGUMENT) on the pool."""
    handlers = {
        name: grpc.stream_stream_rpc_method_handler(getattr(servicer, name))
        for name in METHOD_NAMES
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
