"""Everything the sync and async clients share: the wire protocol, minus the I/O.

``Client`` and ``AsyncClient`` differ only in how they call gRPC (blocking vs ``await``) and
how they sleep. Everything else lives here, once: option names <-> enums, request building,
client-side argument checks, decoding tensors into numpy, the unary-vs-stream decision, the
bookkeeping that resumes an interrupted stream, the retry policy and the mapping of
``grpc.RpcError`` to :mod:`posenc.errors`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import ipaddress
import logging
import math
import numbers
import operator
import random
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

import grpc
import ml_dtypes
import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status

from posenc import presets, wire as _wire
from posenc._checks import INT64_MAX, INT64_MIN, bad_argument, choice
from posenc.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    PosencError,
    error_class_for_code,
)
from posenc.v1 import posenc_pb2 as pb

log = logging.getLogger("posenc")

# --------------------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------------------

DEFAULT_TARGET: Final = "127.0.0.1:50051"
DEFAULT_TIMEOUT: Final = 60.0
DEFAULT_MAX_RETRIES: Final = 6
DEFAULT_RETRY_BACKOFF: Final = 0.1
#: Longest sleep between two retries. With the defaults the sleeps are 0.1, 0.2, 0.4, 0.8,
#: 1.6 and 2.0 s: about 5 s, enough for a replica to restart (its imports take 1-3 s).
MAX_RETRY_BACKOFF: Final = 2.0
#: Results up to this size use the unary GetEncoding (one round trip, the decode-loop
#: case); larger ones stream. Well under the server's 4 MiB unary limit, so a unary
#: response never makes the caller wait for megabytes before seeing the first row.
DEFAULT_UNARY_MAX_BYTES: Final = 1 << 20

# The largest unary response the server may be configured for, with headroom; chunks are
# at most 4 MiB. gRPC's own 4 MiB default would reject a server with a raised limit.
_MAX_RECEIVE_BYTES: Final = 64 << 20
# 1,048,576 positions at up to 10 varint bytes each (negative int64) is ~10.5 MB.
_MAX_SEND_BYTES: Final = 32 << 20
# gRPC reconnects to a failed server with 1 s initial, 120 s max backoff by default, and
# while it waits, calls fail at once without trying: a replica back after 2 s could stay
# unreachable for the channel well past our retry budget. Reconnecting at least every
# 0.5 s means the channel sees a restarted server within ~0.6 s, so the default budget
# (about 5 s of sleeps) rides out some 4.5 s of downtime.
_RECONNECT_OPTIONS: Final = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


def user_agent() -> str:
    """The SDK's gRPC user agent, so server logs can tell SDK versions apart."""
    from posenc import __version__  # late: posenc/__init__ imports this module

    return f"posenc-python/{__version__}"


class _Default(enum.Enum):
    DEFAULT = "DEFAULT"

    def __repr__(self) -> str:
        return "<client default>"


#: Sentinel of per-call ``timeout=`` arguments: use the client's default timeout.
DEFAULT: Final = _Default.DEFAULT
Timeout: TypeAlias = float | Literal[_Default.DEFAULT] | None


# --------------------------------------------------------------------------------------
# Option names <-> protocol enums
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _DtypeInfo:
    enum: pb.Dtype.ValueType
    numpy: np.dtype[Any]
    # Unsigned integers of the element size: tensors are copied as bit patterns through
    # these, which handles byte order for every dtype (bfloat16 included) in one place.
    wire_bits: np.dtype[Any]
    native_bits: np.dtype[Any]


def _dtype_info(enum_value: pb.Dtype.ValueType, dtype: npt.DTypeLike) -> _DtypeInfo:
    numpy_dtype = np.dtype(dtype)
    size = numpy_dtype.itemsize
    return _DtypeInfo(enum_value, numpy_dtype, np.dtype(f"<u{size}"), np.dtype(f"=u{size}"))


_DTYPES: Final[Mapping[str, _DtypeInfo]] = {
    "float32": _dtype_info(pb.DTYPE_FLOAT32, np.float32),
    "float16": _dtype_info(pb.DTYPE_FLOAT16, np.float16),
    "bfloat16": _dtype_info(pb.DTYPE_BFLOAT16, ml_dtypes.bfloat16),
    "float64": _dtype_info(pb.DTYPE_FLOAT64, np.float64),
}
_LAYOUTS: Final[Mapping[str, pb.Layout.ValueType]] = {
    "interleaved": pb.LAYOUT_INTERLEAVED,
    "split": pb.LAYOUT_SPLIT,
}
_SCHEDULES: Final[Mapping[str, pb.Schedule.ValueType]] = {
    "paper": pb.SCHEDULE_PAPER,
    "tensor2tensor": pb.SCHEDULE_TENSOR2TENSOR,
}

#: Names accepted by ``dtype=``, ``layout=`` and ``schedule=``.
DTYPE_NAMES: Final = tuple(_DTYPES)
LAYOUT_NAMES: Final = tuple(_LAYOUTS)
SCHEDULE_NAMES: Final = tuple(_SCHEDULES)

DTypeArg: TypeAlias = str | npt.DTypeLike


def dtype_name(dtype: DTypeArg) -> str:
    """Normalizes a ``dtype=`` argument: a name, or a numpy dtype such as ``np.float16``."""
    if isinstance(dtype, str):
        return choice(dtype, _DTYPES, "spec.dtype")
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise bad_argument("spec.dtype", f"{dtype!r} is not a dtype") from None
    return choice(name, _DTYPES, "spec.dtype")


def numpy_dtype(dtype: DTypeArg) -> np.dtype[Any]:
    """The numpy dtype of results for a ``dtype=`` argument (bfloat16: ml_dtypes)."""
    return _DTYPES[dtype_name(dtype)].numpy


def _enum_name(enum_type: Any, value: int) -> str:
    """``DTYPE_FLOAT32`` -> ``float32``; values this SDK does not know stay readable."""
    try:
        name: str = enum_type.Name(value)
    except ValueError:
        return f"unknown({value})"
    return name.split("_", 1)[1].lower()


# --------------------------------------------------------------------------------------
# Client-side argument checks: types, and what the wire types cannot carry. Values are
# the server's to judge: its limits are configurable and its messages name them.
# --------------------------------------------------------------------------------------


def _as_int(value: object, field: str) -> int:
    # bool is an int to Python, but passing True as a position is a bug, not a request.
    if isinstance(value, bool | np.bool_):
        raise bad_argument(field, f"must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise bad_argument(field, f"must be an integer, got {type(value).__name__}") from None


def _as_int64(value: object, field: str) -> int:
    number = _as_int(value, field)
    if not INT64_MIN <= number <= INT64_MAX:
        raise bad_argument(field, f"must fit in int64, got {number}")
    return number


def _as_base(base: object) -> float:
    if isinstance(base, bool | np.bool_) or not isinstance(base, numbers.Real):
        raise bad_argument("spec.base", f"must be a real number, got {type(base).__name__}")
    return float(base)


def as_positions(positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Converts ``positions`` to a 1-D int64 array, refusing anything but integers.

    Floats are refused even when integral: ``np.arange(0, 1, 0.1)`` passed by mistake
    should fail loudly rather than be truncated to zeros.
    """
    if isinstance(positions, str | bytes):
        raise bad_argument("positions", "must be a sequence of integers, got a string")
    try:
        array = np.asarray(positions)
    except (TypeError, ValueError, OverflowError) as e:
        raise bad_argument("positions", f"must be a sequence of integers ({e})") from None
    if array.ndim != 1:
        raise bad_argument("positions", f"must be 1-D, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind == "O":
        # Python ints beyond int64 (or mixed objects): check each one.
        values = [_as_int(v, "positions") for v in array]
        if any(not INT64_MIN <= v <= INT64_MAX for v in values):
            raise bad_argument("positions", "every position must fit in int64")
        return np.asarray(values, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise bad_argument("positions", f"must be integers, got dtype {array.dtype}")
    if array.dtype.kind == "u" and int(array.max()) > INT64_MAX:
        raise bad_argument("positions", "every position must fit in int64")
    # Always a copy: a resumed stream or a read-ahead plan reads the positions again later,
    # when the caller may have reused its array.
    return np.array(array, dtype=np.int64)


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Query:
    """One table request, independent of how it travels (unary, stream, resumed stream).

    Rows are numbered 0 .. ``rows - 1`` within the selection; a range's row ``i`` is
    position ``start + i``, a list's row ``i`` is ``positions[i]``.
    """

    spec: pb.EncodingSpec
    dtype: _DtypeInfo
    d_model: int
    rows: int
    start: int = 0
    positions: npt.NDArray[np.int64] | None = None

    @functools.cached_property
    def spec_key(self) -> bytes:
        """The spec as deterministic bytes: what tells two specs' rows apart."""
        return self.spec.SerializeToString(deterministic=True)

    @property
    def nbytes(self) -> int:
        """Size of the whole result's data."""
        return self.rows * self.row_bytes

    @property
    def row_bytes(self) -> int:
        return self.d_model * self.dtype.numpy.itemsize

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.d_model)

    def label(self, row: int) -> int:
        """What iterators yield for a slice starting at ``row``: a range's position, a
        list's index into the positions."""
        return self.start + row if self.positions is None else row

    def _selection(self, first_row: int) -> dict[str, Any]:
        # Rows before first_row were already received: ask only for the rest.
        if self.positions is None:
            return {
                "range": pb.PositionRange(start=self.start + first_row, stop=self.start + self.rows)
            }
        return {"positions": pb.PositionList(positions=self.positions[first_row:].tolist())}

    def unary_request(self) -> pb.GetEncodingRequest:
        return pb.GetEncodingRequest(spec=self.spec, **self._selection(0))

    def stream_request(
        self, first_row: int, max_chunk_bytes: int | None
    ) -> pb.StreamEncodingRequest:
        return pb.StreamEncodingRequest(
            spec=self.spec, max_chunk_bytes=max_chunk_bytes or 0, **self._selection(first_row)
        )

    def empty(self) -> np.ndarray[Any, np.dtype[Any]]:
        """An uninitialized result array; every row gets written exactly once."""
        return np.empty(self.shape, dtype=self.dtype.numpy)


def _spec(
    d_model: object,
    base: object,
    dtype: DTypeArg,
    layout: str,
    schedule: str,
    preset: object = None,
) -> tuple[pb.EncodingSpec, _DtypeInfo, int]:
    info = _DTYPES[dtype_name(dtype)]
    layout_enum = _LAYOUTS[choice(layout, _LAYOUTS, "spec.layout")]
    schedule_enum = _SCHEDULES[choice(schedule, _SCHEDULES, "spec.schedule")]
    if preset is None:
        d = _as_d_model(d_model)
        spec = pb.EncodingSpec(
            d_model=d,
            base=_as_base(base),
            dtype=info.enum,
            layout=layout_enum,
            schedule=schedule_enum,
        )
        return spec, info, d
    # A preset (see posenc.presets) sets the layout and schedule itself.
    chosen = presets.as_preset(preset)
    if layout_enum != pb.LAYOUT_INTERLEAVED or schedule_enum != pb.SCHEDULE_PAPER:
        field = "spec.layout" if layout_enum != pb.LAYOUT_INTERLEAVED else "spec.schedule"
        raise bad_argument(field, "a preset sets the layout and schedule: leave them unset")
    if isinstance(chosen, presets.RotaryPreset):
        if _as_base(base) != 10000.0:
            raise bad_argument("spec.base", "a rotary preset carries its own rope_theta")
        d = _as_d_model(chosen.width if d_model is None else d_model)
        return pb.EncodingSpec(d_model=d, dtype=info.enum, rotary=chosen.to_proto()), info, d
    d = _as_d_model(d_model)
    spec = pb.EncodingSpec(
        d_model=d, base=_as_base(base), dtype=info.enum, sinusoidal=chosen.to_proto()
    )
    return spec, info, d


def _as_d_model(d_model: object) -> int:
    d = _as_int(d_model, "spec.d_model")
    if not 0 <= d < 1 << 32:
        # Values the uint32 field cannot carry; the server judges the others (its limits).
        raise bad_argument("spec.d_model", f"must be a positive integer below 2**32, got {d}")
    return d


def range_query(
    start: object,
    stop: object,
    d_model: object,
    *,
    base: object,
    dtype: DTypeArg,
    layout: str,
    schedule: str,
    preset: object = None,
) -> Query:
    """Builds the query for positions ``[start, stop)``."""
    first, end = _as_int64(start, "range.start"), _as_int64(stop, "range.stop")
    spec, info, d = _spec(d_model, base, dtype, layout, schedule, preset)
    # A negative row count (stop < start) goes to the server, which refuses it with its
    # own field violation; results are only allocated once the server has answered.
    return Query(spec, info, d, rows=end - first, start=first)


def positions_query(
    positions: npt.ArrayLike,
    d_model: object,
    *,
    base: object,
    dtype: DTypeArg,
    layout: str,
    schedule: str,
    preset: object = None,
) -> Query:
    """Builds the query for an explicit list of positions."""
    array = as_positions(positions)
    spec, info, d = _spec(d_model, base, dtype, layout, schedule, preset)
    return Query(spec, info, d, rows=len(array), positions=array)


def use_stream(query: Query, unary_max_bytes: int) -> bool:
    """Whether a whole-table request should stream rather than use GetEncoding."""
    return query.nbytes > unary_max_bytes


def check_chunk_bytes(chunk_bytes: object) -> int | None:
    """Validates a ``chunk_bytes=`` argument (None: the server's default chunk size)."""
    if chunk_bytes is None:
        return None
    value = _as_int(chunk_bytes, "max_chunk_bytes")
    if not 1 <= value < 1 << 32:
        raise bad_argument("max_chunk_bytes", f"must be in 1 .. 2**32 - 1, got {value}")
    return value


# --------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------


class TableCalls:
    """GetEncoding and StreamEncoding on a channel, sync or asyncio alike.

    Responses are parsed by :mod:`posenc._wire`, which hands out the payload as a view of
    the received message, so each chunk is copied once: into the result array.
    """

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        service = "/posenc.v1.PositionalEncodingService/"
        self.get_encoding: Any = channel.unary_unary(
            service + "GetEncoding",
            request_serializer=pb.GetEncodingRequest.SerializeToString,
            response_deserializer=_wire.decode_tensor_response,
        )
        self.stream_encoding: Any = channel.unary_stream(
            service + "StreamEncoding",
            request_serializer=pb.StreamEncodingRequest.SerializeToString,
            response_deserializer=_wire.decode_tensor_response,
        )


def _copy_tensor(tensor: _wire.TensorView, query: Query, out: np.ndarray[Any, Any]) -> None:
    """Validates ``tensor`` against the query and copies its rows into ``out``."""
    rows = out.shape[0]
    if tensor.dtype != query.dtype.enum or tensor.columns != query.d_model or tensor.rows != rows:
        raise InternalError(
            f"server sent a {tensor.rows}x{tensor.columns} {_enum_name(pb.Dtype, tensor.dtype)} "
            f"tensor, expected {rows}x{query.d_model} {query.dtype.numpy.name}"
        )
    if len(tensor.data) != rows * query.row_bytes:
        raise InternalError(
            f"server sent {len(tensor.data)} data bytes for {rows} rows of {query.row_bytes}"
        )
    # One copy, straight from the message bytes into the destination rows.
    source = np.frombuffer(tensor.data, dtype=query.dtype.wire_bits).reshape(rows, query.d_model)
    out.view(query.dtype.native_bits)[...] = source


def decode_unary(tensor: _wire.TensorView, query: Query) -> np.ndarray[Any, Any]:
    """The result array of a GetEncoding response (writable, owns its memory)."""
    if tensor.row_offset != 0:
        raise InternalError(f"server sent row_offset {tensor.row_offset} in a unary response")
    out = query.empty()
    _copy_tensor(tensor, query, out)
    return out


class StreamCursor:
    """Progress of one streamed table across however many StreamEncoding calls it takes.

    ``received`` counts rows delivered so far. After an interruption, :meth:`request`
    asks for the remaining rows only; chunk ``row_offset`` values are relative to the
    request's own selection, so they are checked against ``received - base``.
    """

    def __init__(self, query: Query, max_chunk_bytes: int | None, *, collect: bool = False) -> None:
        self.query = query
        self.max_chunk_bytes = max_chunk_bytes
        self.received = 0
        self._base = 0  # first row of the current call's selection
        self._collect = collect
        self._out: np.ndarray[Any, Any] | None = None

    @property
    def done(self) -> bool:
        """Every row arrived, so a failure now (after the last chunk) loses nothing.

        Never true for an empty or negative selection: its errors must be raised.
        """
        return 0 < self.query.rows == self.received

    def request(self) -> pb.StreamEncodingRequest:
        """The request for the rows not yet received."""
        self._base = self.received
        return self.query.stream_request(self.received, self.max_chunk_bytes)

    def accept(self, chunk: _wire.TensorView) -> tuple[int, np.ndarray[Any, Any]]:
        """Takes one chunk: returns ``(label of its first row, its rows)``.

        When collecting, the rows are copied into the one result array (and a view of them
        returned); otherwise into a new array of the chunk's size.
        """
        if chunk.row_offset != self.received - self._base:
            raise InternalError(
                f"server sent row_offset {chunk.row_offset}, expected "
                f"{self.received - self._base}: chunks must arrive in order"
            )
        if chunk.rows == 0 or self.received + chunk.rows > self.query.rows:
            raise InternalError(
                f"server sent {chunk.rows} rows at row {self.received} of {self.query.rows}"
            )
        first = self.received
        if self._collect:
            if self._out is None:
                # Allocated at the first chunk rather than before the call: a request the
                # server refuses (over its limits, invalid) fails without first reserving
                # memory for the whole result.
                self._out = self.query.empty()
            rows = self._out[first : first + chunk.rows]
        else:
            rows = np.empty((chunk.rows, self.query.d_model), dtype=self.query.dtype.numpy)
        _copy_tensor(chunk, self.query, rows)
        self.received += chunk.rows
        return self.query.label(first), rows

    def result(self) -> np.ndarray[Any, Any]:
        """The collected table, once every row arrived."""
        return self._out if self._out is not None else self.query.empty()

    def check_complete(self) -> None:
        """Called when a call ended without error: every row must have arrived."""
        if self.received != self.query.rows:
            raise InternalError(
                f"stream ended after {self.received} of {self.query.rows} rows without an error"
            )


# --------------------------------------------------------------------------------------
# Errors and retries
# --------------------------------------------------------------------------------------

_DETAILS_KEY: Final = "grpc-status-details-bin"


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
    a concurrency limit, unlike a request over a size limit); and the INTERNAL that gRPC
    reports when an HTTP/2 stream is reset under it (a proxy such as nginx resets a
    client's stream when its upstream replica dies). The server's own INTERNAL is a bug and
    is not retried. Every posenc call only reads, so repeating one is safe.
    """
    if error.code == grpc.StatusCode.UNAVAILABLE:
        return True
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return error.retry_after is not None
    return error.code == grpc.StatusCode.INTERNAL and "RST_STREAM" in error.details


class CallBudget:
    """Deadline and retries of one SDK call, shared by all its attempts.

    The timeout bounds the whole call, retries and resumed streams included: each attempt
    gets what remains of it. Only transient failures are retried (see :func:`is_transient`);
    the other codes say retrying the same request would fail the same way (or, for
    DEADLINE_EXCEEDED, too late).
    """

    def __init__(self, timeout: float | None, max_retries: int, backoff: float) -> None:
        self.timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._max_retries = max_retries
        self._backoff = backoff
        self._failures = 0  # consecutive failed attempts without progress

    def attempt_timeout(self) -> float | None:
        """The timeout of the next attempt: what remains of the call's deadline."""
        if self._deadline is None:
            return None
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError(f"deadline of {self.timeout} s exceeded")
        return remaining

    def progress(self) -> None:
        """Rows arrived: a stream that keeps moving gets its full retry budget again."""
        self._failures = 0

    def on_error(self, error: grpc.RpcError) -> float:
        """Returns how long to sleep before retrying, or raises the mapped exception."""
        mapped = map_rpc_error(error)
        if not is_transient(mapped) or self._failures >= self._max_retries:
            if self._failures:
                mapped.details += f" (after {self._failures + 1} attempts)"
            raise mapped from error
        delay = min(MAX_RETRY_BACKOFF, self._backoff * 2.0**self._failures)
        delay = max(delay, mapped.retry_after or 0.0)
        # Jitter upwards only, so the documented budget stays a lower bound, while
        # clients that failed together do not all come back in the same millisecond.
        delay *= 1.0 + 0.2 * random.random()
        if self._deadline is not None and time.monotonic() + delay >= self._deadline:
            raise DeadlineExceededError(
                f"deadline of {self.timeout} s exceeded while retrying: {mapped}"
            ) from error
        self._failures += 1
        log.info(
            "retrying in %.2f s (retry %d of %d): %s",
            delay,
            self._failures,
            self._max_retries,
            mapped,
        )
        return delay


def resolve_timeout(timeout: Timeout, default: float | None) -> float | None:
    """A per-call ``timeout=`` argument, with ``DEFAULT`` meaning the client's default."""
    if timeout is DEFAULT:
        return default
    if timeout is not None and (not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return timeout


# --------------------------------------------------------------------------------------
# Channels
# --------------------------------------------------------------------------------------


def _split_host_port(target: str) -> tuple[str, int]:
    if target.startswith("["):
        host, sep, port = target[1:].partition("]:")
    else:
        host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"target {target!r} is not host:port")
    return host, int(port)


def _resolve(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    # One family per host: IPv4 when it has any (what servers listen on by default).
    v4 = [a for a in addresses if a.version == 4]
    return list(dict.fromkeys(v4 or addresses))


def is_uri(target: str) -> bool:
    """Whether ``target`` is a gRPC URI (``dns:///h:p``, ``ipv4:a:p,b:q``, ...), not host:port."""
    return "://" in target or target.startswith(("ipv4:", "ipv6:", "unix:", "dns:"))


def channel_target(target: str | Sequence[str]) -> str:
    """The gRPC target for one or several server addresses.

    One target is used as given (``host:port`` or any gRPC URI such as ``dns:///host:port``),
    and gRPC resolves it. Several ``host:port`` targets become one static address list,
    ``ipv4:a:p,b:q`` (or ``ipv6:``), which the channel's round_robin policy spreads calls
    over; hostnames are resolved here, once, because those URIs take IP literals only.
    """
    targets = [target] if isinstance(target, str) else list(target)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"target must be a non-empty string or sequence of them, got {target!r}")
    if len(targets) == 1:
        return targets[0]
    addresses: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] = []
    for t in targets:
        if is_uri(t):
            raise ValueError(f"several targets must each be host:port, got {t!r}")
        host, port = _split_host_port(t)
        addresses.extend((address, port) for address in _resolve(host, port))
    if all(a.version == 4 for a, _ in addresses):
        return "ipv4:" + ",".join(f"{a}:{p}" for a, p in addresses)
    # Mixed families: IPv4 addresses become v4-mapped IPv6 ones (dual-stack sockets).
    mapped = [a if a.version == 6 else ipaddress.IPv6Address(f"::ffff:{a}") for a, _ in addresses]
    return "ipv6:" + ",".join(f"[{a}]:{p}" for a, (_, p) in zip(mapped, addresses, strict=True))


def channel_options(
    user_options: Iterable[tuple[str, Any]] | None, user_agent: str
) -> list[tuple[str, Any]]:
    """Channel options: the SDK's, overridden by any the caller passes."""
    options: dict[str, Any] = {
        "grpc.lb_policy_name": "round_robin",
        "grpc.max_receive_message_length": _MAX_RECEIVE_BYTES,
        "grpc.max_send_message_length": _MAX_SEND_BYTES,
        "grpc.primary_user_agent": user_agent,
        **dict(_RECONNECT_OPTIONS),
    }
    options.update(dict(user_options or ()))
    return list(options.items())


# --------------------------------------------------------------------------------------
# Server info
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Limits a server enforces; requests beyond them are refused."""

    max_d_model: int
    max_abs_position: int
    max_positions: int
    max_unary_bytes: int
    max_stream_bytes: int
    max_chunk_bytes: int
    max_receive_message_bytes: int


@dataclass(frozen=True)
class CacheStats:
    """Server cache statistics since it started."""

    hits: int
    misses: int
    evictions: int
    bytes: int
    entries: int
    budget_bytes: int


@dataclass(frozen=True)
class PresetParameter:
    """A parameter of a preset: its request field, meaning and default (empty: required)."""

    field: str
    description: str
    default: str


@dataclass(frozen=True)
class PresetInfo:
    """A preset a server serves (``"whisper"``, ``"rotary:yarn"``, ...) and its parameters."""

    name: str
    description: str
    parameters: tuple[PresetParameter, ...]


@dataclass(frozen=True)
class ServerInfo:
    """What :meth:`Client.server_info` returns: one server's description and counters."""

    version: str
    server_id: str
    limits: Limits
    dtypes: tuple[str, ...]
    layouts: tuple[str, ...]
    schedules: tuple[str, ...]
    cache: CacheStats
    rows_computed: int
    presets: tuple[PresetInfo, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (nested dataclasses become dictionaries)."""
        return dataclasses.asdict(self)


def server_info_from_proto(response: pb.GetServerInfoResponse) -> ServerInfo:
    limits, cache = response.limits, response.cache
    return ServerInfo(
        version=response.version,
        server_id=response.server_id,
        limits=Limits(
            max_d_model=limits.max_d_model,
            max_abs_position=limits.max_abs_position,
            max_positions=limits.max_positions,
            max_unary_bytes=limits.max_unary_bytes,
            max_stream_bytes=limits.max_stream_bytes,
            max_chunk_bytes=limits.max_chunk_bytes,
            max_receive_message_bytes=limits.max_receive_message_bytes,
        ),
        dtypes=tuple(_enum_name(pb.Dtype, v) for v in response.dtypes),
        layouts=tuple(_enum_name(pb.Layout, v) for v in response.layouts),
        schedules=tuple(_enum_name(pb.Schedule, v) for v in response.schedules),
        cache=CacheStats(
            hits=cache.hits,
            misses=cache.misses,
            evictions=cache.evictions,
            bytes=cache.bytes,
            entries=cache.entries,
            budget_bytes=cache.budget_bytes,
        ),
        rows_computed=response.rows_computed,
        presets=tuple(
            PresetInfo(
                name=preset.name,
                description=preset.description,
                parameters=tuple(
                    PresetParameter(p.field, p.description, p.default) for p in preset.parameters
                ),
            )
            for preset in response.presets
        ),
    )


def health_request(service: str) -> health_pb2.HealthCheckRequest:
    if not isinstance(service, str):
        raise TypeError(f"service must be a str, got {type(service).__name__}")
    return health_pb2.HealthCheckRequest(service=service)


def health_status(response: health_pb2.HealthCheckResponse) -> str:
    """The serving status name of a health check, e.g. ``"SERVING"``."""
    try:
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    except ValueError:
        return f"UNKNOWN({response.status})"
    return name


def health_status_from_error(error: grpc.RpcError) -> str:
    """A failed health check: NOT_FOUND is an answer (the service name is unknown to the
    server, ``"SERVICE_UNKNOWN"``); anything else raises the mapped exception."""
    mapped = map_rpc_error(error)
    if mapped.code == grpc.StatusCode.NOT_FOUND:
        return "SERVICE_UNKNOWN"
    raise mapped from error


# --------------------------------------------------------------------------------------
# Client settings
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """A client's validated constructor arguments, shared by Client and AsyncClient."""

    target: str
    timeout: float | None
    max_retries: int
    retry_backoff: float
    chunk_bytes: int | None
    unary_max_bytes: int
    options: list[tuple[str, Any]]
    # Sent with every call: the bearer token, when there is one.
    metadata: tuple[tuple[str, str], ...]

    @classmethod
    def create(
        cls,
        target: str | Sequence[str],
        *,
        timeout: float | None,
        max_retries: int,
        retry_backoff: float,
        chunk_bytes: int | None,
        unary_max_bytes: int,
        options: Iterable[tuple[str, Any]] | None,
        user_agent: str,
        token: str | None = None,
    ) -> Settings:
        retries = operator.index(max_retries)
        if retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if not (math.isfinite(retry_backoff) and retry_backoff >= 0):
            raise ValueError(f"retry_backoff must be >= 0, got {retry_backoff}")
        unary_max = operator.index(unary_max_bytes)
        if unary_max < 0:
            raise ValueError(f"unary_max_bytes must be >= 0, got {unary_max_bytes}")
        return cls(
            target=channel_target(target),
            timeout=resolve_timeout(timeout, None),
            max_retries=retries,
            retry_backoff=float(retry_backoff),
            chunk_bytes=check_chunk_bytes(chunk_bytes),
            unary_max_bytes=unary_max,
            options=channel_options(options, user_agent),
            metadata=(("authorization", f"Bearer {token}"),) if token else (),
        )

    def budget(self, timeout: Timeout, *, retry: bool = True) -> CallBudget:
        """The deadline and retry budget of one call."""
        return CallBudget(
            resolve_timeout(timeout, self.timeout),
            self.max_retries if retry else 0,
            self.retry_backoff,
        )

    def cursor(
        self, query: Query, chunk_bytes: int | None = None, *, collect: bool = False
    ) -> StreamCursor:
        """A stream cursor with the call's chunk size, else the client's."""
        chunk = check_chunk_bytes(chunk_bytes) or self.chunk_bytes
        return StreamCursor(query, chunk, collect=collect)
