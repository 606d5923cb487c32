"""The gRPC servicer, on the asyncio server: each call reads its request, is admitted against
the byte budget, and runs its CPU work (parsing, resolving the spec, computing rows) on a
bounded thread pool.

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
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc
import grpc.aio

from posenc.v1 import posenc_pb2 as pb
from posenc_server import admission, convert
from posenc_server.admission import ByteBudget
from posenc_server.config import ServerConfig
from posenc_server.errors import FieldViolation, InvalidRequestError, RequestTimeoutError
from posenc_server.service import EncodingService
from posenc_server.specs import Request, SpecTable

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PositionalEncodingService"].full_name
METHOD_NAMES = tuple(pb.DESCRIPTOR.services_by_name["PositionalEncodingService"].methods_by_name)
"""The service's method names; the streaming one is served by ``StreamEncoding``."""
STREAMING_METHODS = frozenset({"StreamEncoding"})

T = TypeVar("T")

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
    ) -> None:
        self._config = config
        self._specs = specs
        self._service = service
        self._version = version
        self._pool = pool
        self._budget = budget

    async def GetEncoding(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        """A small table in one (serialized GetEncodingResponse) message."""
        raw = await self._read(context)
        async with self._budget.admitted(admission.request_cost(raw)) as reservation:
            request = await self._run(self._request, _GET_ENCODING, raw)
            await reservation.grow(admission.response_cost(self._result_bytes(request), None))
            yield await self._run(self._service.unary, request)

    async def StreamEncoding(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        """A table of any size as row-aligned chunks (serialized responses)."""
        raw = await self._read(context)
        async with self._budget.admitted(admission.request_cost(raw)) as reservation:
            request = await self._run(self._request, _STREAM_ENCODING, raw)
            chunk_bytes = request.max_chunk_bytes or self._config.max_chunk_bytes
            await reservation.grow(
                admission.response_cost(self._result_bytes(request), chunk_bytes)
            )
            chunks = self._service.stream(request)
            try:
                while (message := await self._run(next, chunks, None)) is not None:
                    yield message
            finally:
                # Runs the generator's cleanup (the stream count) on the pool: it may still
                # be computing a chunk for a call cancelled meanwhile.
                self._pool.submit(_close_when_idle, chunks)

    async def GetServerInfo(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        """Describe this server."""
        raw = await self._read(context)
        convert.parsed(_SERVER_INFO(raw))
        info = convert.server_info_response(self._service.info(self._version))
        yield info.SerializeToString()

    # Plumbing -------------------------------------------------------------------------------

    async def _read(self, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        """The call's one request message, or RequestTimeoutError once the wait is over."""
        timeout = self._config.read_timeout_seconds
        try:
            message = await asyncio.wait_for(context.read(), timeout)
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request message did not arrive within {timeout:g} s of the call's "
                "headers (--read-timeout-seconds)"
            ) from None
        if message is grpc.aio.EOF:
            raise InvalidRequestError([FieldViolation("request", "the call sent no request")])
        assert isinstance(message, bytes)
        return message

    def _request(self, parse: Callable[[bytes], Any], raw: bytes) -> Request:
        return self._specs.resolve(convert.encoding_query(parse(raw), self._config))

    @staticmethod
    def _result_bytes(request: Request) -> int:
        return request.selection.rows * request.spec.row_bytes

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the pool: CPU work never runs on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(function, *args))


def _close_when_idle(chunks: Iterator[bytes]) -> None:
    # A call cancelled while its next chunk was being computed leaves that step running on
    # another thread: close the generator (running its cleanup) once the step is over.
    close: Callable[[], None] | None = getattr(chunks, "close", None)
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
