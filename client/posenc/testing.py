"""A client without a server, for your own tests: :class:`MockTransport`.

Pass one to :class:`posenc.Client` or :class:`posenc.AsyncClient` as ``transport=``, and every
table call is answered in-process by your ``handler``, which gets the request the client
would have sent (a ``GetEncodingRequest`` or ``StreamEncodingRequest`` of
``posenc_protocol.v1``) and returns its rows::

    import numpy as np
    import posenc
    from posenc.testing import MockTransport, Status, positions

    def handler(request):
        return np.zeros((len(positions(request)), 64), np.float32)

    with posenc.Client(transport=MockTransport(handler)) as client:
        rows = client.get_positions([3, 1_000_000], 64)   # zeros, shape (2, 64)

The rows travel as they would from a server: encoded in the response format, streamed in
chunks when large, and decoded, checked, retried and resumed by the client's own code. To
fail a call, raise :class:`Status` from the handler (``Status(grpc.StatusCode.UNAVAILABLE)``
is retried as a server restart would be). The transport keeps a server's default limits: a
unary result over ``max_unary_bytes`` is refused with RESOURCE_EXHAUSTED, as the server
refuses it, so a client made with a larger ``unary_max_bytes`` takes the same refusal, then
a stream, as against a server. ``GetServerInfo`` answers those limits and health answers
SERVING.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Final, TypeAlias

import grpc
import grpc.aio
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health_pb2

from posenc_protocol import limits, wire
from posenc_protocol.descriptors import value_names
from posenc_protocol.v1 import posenc_pb2 as pb

__all__ = ["Handler", "MockTransport", "Request", "Status", "positions"]

#: What a handler gets: the request the client built.
Request: TypeAlias = pb.GetEncodingRequest | pb.StreamEncodingRequest
#: A function from a request to its rows, ``[rows, width]`` (any dtype: cast to the
#: request's).
Handler: TypeAlias = Callable[[Request], npt.ArrayLike]

#: A server's default chunk size: a stream's chunks hold at most this many bytes.
DEFAULT_CHUNK_BYTES: Final = limits.MAX_CHUNK_BYTES
#: A server's default unary limit: 4 MiB (a default gRPC client's receive limit) less
#: 16 KiB for the message around the rows.
DEFAULT_MAX_UNARY_BYTES: Final = limits.MAX_UNARY_BYTES


class Status(grpc.RpcError, grpc.Call):
    """Raise from a handler to fail the call with ``code``, as a server would."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple[()]:
        return ()

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def positions(request: Request) -> npt.NDArray[np.int64]:
    """The positions a request selects, in order: ``[n]``, or ``[n, axes]`` coordinates for
    the several-axis kinds."""
    match request.WhichOneof("selection"):
        case "range":
            return np.arange(request.range.start, request.range.stop, dtype=np.int64)
        case "positions":
            return np.array(request.positions.positions, dtype=np.int64)
        case "coordinates":
            coordinates = np.array(request.coordinates.coordinates, dtype=np.int64)
            return coordinates.reshape(-1, max(request.coordinates.axes, 1))
        case _:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, "selection: not set")


class MockTransport:
    """Answers a client's calls with ``handler`` instead of a server (see the module doc).

    ``calls`` lists every request the handler was given, in order. ``max_unary_bytes`` is
    the server's unary limit (its default unless given): a GetEncoding result larger than
    that is refused with RESOURCE_EXHAUSTED, and the client streams it instead.
    """

    def __init__(self, handler: Handler, *, max_unary_bytes: int = DEFAULT_MAX_UNARY_BYTES) -> None:
        self.handler = handler
        self.max_unary_bytes = max_unary_bytes
        self.calls: list[Request] = []

    def _rows(self, request: Request) -> tuple[int, npt.NDArray[Any]]:
        self.calls.append(request)
        number = request.spec.dtype or pb.DTYPE_FLOAT32
        # np.dtype, not the SDK's named_dtype: the transport is the server's side of a call.
        # (bfloat16 is numpy's once a client is made: it loads ml_dtypes.)
        rows = np.ascontiguousarray(self.handler(request), dtype=np.dtype(_DTYPES[number]))
        if rows.ndim != 2:
            raise ValueError(f"a handler returns [rows, width], got shape {rows.shape}")
        return number, rows

    def _unary(self, request: pb.GetEncodingRequest) -> wire.TensorView:
        number, rows = self._rows(request)
        if rows.nbytes > self.max_unary_bytes:
            # The server's words (it refuses before computing; the handler's rows tell the
            # size here). No RetryInfo: over a size limit, not busy.
            raise Status(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the result is {rows.nbytes} bytes, over the unary limit of "
                f"{self.max_unary_bytes} bytes: use StreamEncoding for large results",
            )
        return _response(number, 0, rows)

    def _stream(self, request: pb.StreamEncodingRequest) -> Iterator[wire.TensorView]:
        number, rows = self._rows(request)
        chunk_bytes = min(request.max_chunk_bytes or DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_BYTES)
        step = max(chunk_bytes // max(rows[:1].nbytes, 1), 1)
        for first in range(0, len(rows), step):
            yield _response(number, first, rows[first : first + step])

    def calls_for(self, asynchronous: bool) -> Any:
        """The RPC methods the clients call (``posenc._channel.Calls``), answered here."""
        return _AsyncCalls(self) if asynchronous else _SyncCalls(self)


def _response(dtype: int, row_offset: int, rows: npt.NDArray[Any]) -> wire.TensorView:
    """``rows`` as the client receives a response of them: encoded, then decoded."""
    data = rows.reshape(-1).view(np.uint8).data
    message = wire.encode_tensor_response(dtype, row_offset, rows.shape[0], rows.shape[1], data)
    return wire.decode_tensor_response(message)


def _server_info(max_unary_bytes: int) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(
        version="mock",
        limits=pb.Limits(
            max_d_model=limits.MAX_D_MODEL,
            max_abs_position=limits.MAX_ABS_POSITION,
            max_positions=limits.MAX_POSITIONS,
            max_unary_bytes=max_unary_bytes,
            max_stream_bytes=limits.MAX_STREAM_BYTES,
            max_chunk_bytes=DEFAULT_CHUNK_BYTES,
        ),
        server_id="mock",
    )


_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]
_DTYPES: Final = value_names(pb.Dtype.DESCRIPTOR)
_SERVING: Final = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class _Stream:
    """A streaming call's iterator, as gRPC's: ``next`` and ``cancel``."""

    def __init__(self, chunks: Iterator[wire.TensorView]) -> None:
        self._chunks = chunks

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> wire.TensorView:
        return next(self._chunks)

    def cancel(self) -> bool:
        self._chunks = iter(())
        return True

    async def read(self) -> Any:
        return next(self._chunks, _EOF)


class _Calls:
    """The calls of a channel, as :class:`posenc._channel.Calls` makes them."""

    def __init__(self, transport: MockTransport) -> None:
        self._transport = transport

    def stream_encoding(self, request: pb.StreamEncodingRequest, timeout: Any = None) -> Any:
        # One stream object serves both clients: it iterates and it reads.
        return _Stream(self._transport._stream(request))


class _SyncCalls(_Calls):
    def get_encoding(self, request: pb.GetEncodingRequest, timeout: Any = None) -> Any:
        return self._transport._unary(request)

    def get_server_info(self, request: Any, timeout: Any = None) -> Any:
        return _server_info(self._transport.max_unary_bytes)

    def health_check(self, request: Any, timeout: Any = None) -> Any:
        return _SERVING


class _AsyncCalls(_Calls):
    async def get_encoding(self, request: pb.GetEncodingRequest, timeout: Any = None) -> Any:
        return self._transport._unary(request)

    async def get_server_info(self, request: Any, timeout: Any = None) -> pb.GetServerInfoResponse:
        return _server_info(self._transport.max_unary_bytes)

    async def health_check(self, request: Any, timeout: Any = None) -> Any:
        return _SERVING
