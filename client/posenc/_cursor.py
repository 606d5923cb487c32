"""A query on the wire: the unary decode, and the stream cursor that resumes a stream (the
requests themselves are written by :mod:`posenc._query`, with the plan of a call).

Responses are parsed by :mod:`posenc_protocol.wire`, which hands out the payload as a view of the
received message, so each chunk is copied once: into the result array. The width of a
table is whatever the server's ``columns`` say (the same in every response of a query).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from posenc._query import Query, request_selection, request_stop
from posenc.errors import InternalError
from posenc.spec import enum_name
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.wire import TensorView

# A unary result this large or smaller goes into a plain new array (see decode_unary).
_SMALL_BYTES = 64 << 20


def _copy_tensor(
    tensor: TensorView, query: Query, columns: int | None, out: np.ndarray[Any, Any] | None
) -> np.ndarray[Any, Any]:
    """Validates ``tensor`` (``columns``: the width it must have, when known) and copies its
    rows into ``out``, or into a new array when ``out`` is None."""
    rows = tensor.rows if out is None else out.shape[0]
    dtype = query.dtype
    if (
        tensor.dtype != query.spec.dtype
        or tensor.rows != rows
        or columns not in (None, tensor.columns)
    ):
        expected = f"{rows}x{'?' if columns is None else columns} {dtype.name}"
        raise InternalError(
            f"server sent a {tensor.rows}x{tensor.columns} "
            f"{enum_name(pb.Dtype.DESCRIPTOR, tensor.dtype)} tensor, expected {expected}"
        )
    row_bytes = tensor.columns * dtype.itemsize
    if len(tensor.data) != rows * row_bytes:
        raise InternalError(
            f"server sent {len(tensor.data)} data bytes for {rows} rows of {row_bytes}"
        )
    if out is None:
        out = np.empty((rows, tensor.columns), dtype=dtype)
    # One copy, straight from the message bytes into the destination rows. Through unsigned
    # integers of the element size, which handles byte order for every dtype (bfloat16
    # included) in one place.
    source = np.frombuffer(tensor.data, dtype=f"<u{dtype.itemsize}")
    out.view(f"=u{dtype.itemsize}")[...] = source.reshape(rows, tensor.columns)
    return out


def decode_unary(tensor: TensorView, query: Query) -> np.ndarray[Any, Any]:
    """The result array of a GetEncoding response (writable: the caller's ``out=`` buffer,
    or a new array)."""
    if tensor.row_offset != 0:
        raise InternalError(f"server sent row_offset {tensor.row_offset} in a unary response")
    if tensor.rows != query.rows:
        raise InternalError(f"server sent {tensor.rows} rows, expected {query.rows}")
    if query.columns not in (None, tensor.columns):
        return _copy_tensor(tensor, query, query.columns, None)  # raises: a width changed
    shape = (tensor.rows, tensor.columns)
    if query.out is not None and query.out.shape == shape:
        out = query.out
    elif len(tensor.data) <= _SMALL_BYTES:
        # Already in memory once (the message): no memory check, no pooled allocation.
        out = np.empty(shape, dtype=query.dtype)
    else:
        out = query.allocate(tensor.columns)
    return _copy_tensor(tensor, query, query.columns, out)


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
        self.columns = query.columns  # the width, once known: every chunk must have it
        self._base = 0  # first row of the current call's selection
        self._stop = 0  # the row after the current call's selection
        self._max_rows: int | None = None  # rows per call, once a call was over the limit
        self.collect = collect
        #: Where collected rows go, given the width: the query's result (or a part of a
        #: larger one).
        self.into: Callable[[int], np.ndarray[Any, Any]] = query.allocate
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
        self._stop = request_stop(self.query, self.received)
        if self._max_rows is not None:
            self._stop = min(self._stop, self.received + self._max_rows)
        return pb.StreamEncodingRequest(
            spec=self.query.spec,
            max_chunk_bytes=self.max_chunk_bytes or 0,
            **request_selection(self.query, self.received, self._stop),
        )

    def split(self) -> bool:
        """After the server refused the current call as over its stream limit: whether
        smaller calls can carry the rest (then half as many rows per call from now on).

        Only for iterators, which hold a chunk at a time; a whole table (``get_range``)
        over the limit would not fit in memory either, and stays refused.
        """
        rows = self._stop - self._base
        if self.collect or rows <= 1:
            return False
        self._max_rows = (rows + 1) // 2
        return True

    @property
    def more(self) -> bool:
        """The current call brought all its rows, and a long list has more: the next call
        asks for them (see ``MAX_POSITIONS_PER_REQUEST``)."""
        return self.received == self._stop < self.query.rows

    def accept(self, chunk: TensorView) -> tuple[int, np.ndarray[Any, Any]]:
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
        target = None
        if self.collect:
            if self._out is None:
                # Allocated at the first chunk rather than before the call: a request the
                # server refuses (over its limits, invalid) fails without first reserving
                # memory for the whole result; and the chunk tells the width.
                self._out = self.into(chunk.columns)
            target = self._out[first : first + chunk.rows]
        rows = _copy_tensor(chunk, self.query, self.columns, target)
        self.columns = chunk.columns
        self.received += chunk.rows
        return self.query.label(first), rows

    def result(self) -> np.ndarray[Any, Any]:
        """The collected table, once every row arrived."""
        if self._out is not None:
            return self._out
        return self.query.allocate(self.columns or 0)

    def check_complete(self) -> None:
        """Called when a call ended without error: every row must have arrived."""
        if self.received != self.query.rows:
            raise InternalError(
                f"stream ended after {self.received} of {self.query.rows} rows without an error"
            )
