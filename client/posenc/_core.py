"""Everything a client call does except its I/O, once for ``Client`` and ``AsyncClient``.

Each SDK call is a generator of this module (sans-I/O): it yields operations — make this
unary call, open this stream, read its next chunk, sleep, wait for these read-ahead tokens,
hand this slice to the caller, start this read-ahead — and the client performs each one
its own way (blocking, or awaited), sending the result back in, or throwing the
``grpc.RpcError`` in. Request building, the unary-or-stream choice, stream resume, retries,
error mapping and the read-ahead bookkeeping are written here only; the clients hold a
driver of a few lines and the operations' I/O.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health_pb2

from posenc._channel import Settings
from posenc._checks import bad_argument
from posenc._cursor import StreamCursor, decode_unary
from posenc._output import Output, is_tensor, is_torch_dtype, positions_of, torch_dtype_name
from posenc._query import (
    Query,
    Widths,
    as_spec,
    check_chunk_bytes,
    positions_query,
    range_query,
    table_spec,
)
from posenc._retry import (
    CallBudget,
    Contact,
    map_rpc_error,
    resolve_timeout,
)
from posenc._rows import (
    MAX_CACHED_CALL_ROWS,
    AheadFetch,
    Pending,
    RowCache,
    RowPlan,
)
from posenc.errors import (
    ClientClosedError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from posenc.spec import position_axes
from posenc.types import DEFAULT, DTypeArg, ServerInfo, Timeout, server_info_from_proto
from posenc_protocol.v1 import posenc_pb2 as pb

T = TypeVar("T")
Rows: TypeAlias = npt.NDArray[Any]
#: What a table method returns: a numpy array, a ``torch.Tensor``, or a ``(cos, sin)`` pair of
#: either (see :mod:`posenc._output`).
Result: TypeAlias = Any
#: What iterators yield: the label of the first row (a position, or an index into the
#: positions), and the rows (a numpy array, or a tensor when the call asked for tensors).
Slice: TypeAlias = tuple[int, Any]
# The classic table's keyword options, as a table method received them.
Classic: TypeAlias = Mapping[str, object]


# -- operations: what a call asks its client to do --------------------------------------------


@dataclass(frozen=True, slots=True)
class Unary:
    """Make the unary call ``method`` (an attribute of :class:`posenc._channel.Calls`);
    the response is sent back. Calls of equal ``affinity`` go over one connection (see
    :class:`posenc._channel.Pool`); None: the next one."""

    method: str
    request: Any
    timeout: float | None
    affinity: int | None = None


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Start a StreamEncoding call over the connection ``affinity`` keeps (as for
    :class:`Unary`); a :class:`Stream` is sent back."""

    request: pb.StreamEncodingRequest
    timeout: float | None
    affinity: int | None = None


@dataclass(frozen=True, slots=True)
class Stream:
    """A StreamEncoding call, as the client made it."""

    call: Any

    def cancel(self) -> None:
        self.call.cancel()


@dataclass(frozen=True, slots=True)
class NextChunk:
    """Read the next response of ``call`` (a :class:`Stream`); None is sent back at its
    end."""

    call: Stream


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep before a retry."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait (at most ``timeout``) for read-ahead ``tokens``, the client's futures."""

    tokens: tuple[Any, ...]
    timeout: float | None


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand ``slice``, ``(label, rows)``, to the caller of an iterator."""

    slice: Slice


@dataclass(frozen=True, slots=True)
class ReadAhead:
    """Run :meth:`Core.fetch_ahead` for ``ahead`` in the background (a thread, a task),
    then :meth:`Core.finish_ahead`."""

    ahead: AheadFetch


#: The operations a client performs (all but :class:`Deliver`, which its iterator yields).
Performed: TypeAlias = Unary | OpenStream | NextChunk | Sleep | Wait | ReadAhead
Operation: TypeAlias = Performed | Deliver
Steps: TypeAlias = Generator[Operation, Any, T]


class Stepper(Generic[T]):
    """Runs the steps of one call for a driver: :meth:`next` gives the next operation,
    after :meth:`send` or :meth:`throw` gave the outcome of the last; None once the call
    returned (its value is :attr:`result`). Closing it closes the steps, which cancels a
    stream left open."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self._value: Any = None
        self._error: BaseException | None = None
        self.result: T

    def next(self) -> Operation | None:
        error, self._error = self._error, None
        try:
            if error is not None:
                return self._steps.throw(error)
            return self._steps.send(self._value)
        except StopIteration as stop:
            self.result = stop.value
            return None

    def __iter__(self) -> Iterator[Operation]:
        while (operation := self.next()) is not None:
            yield operation

    def send(self, value: object) -> None:
        self._value = value

    def throw(self, error: BaseException) -> None:
        self._value, self._error = None, error

    def perform(self, perform: Callable[[Performed], Any], operation: Performed) -> None:
        """Performs ``operation``; its outcome goes to the steps at :meth:`next`."""
        try:
            self.send(perform(operation))
        except grpc.RpcError as error:
            self.throw(error)

    async def perform_async(
        self, perform: Callable[[Performed], Awaitable[Any]], operation: Performed
    ) -> None:
        """:meth:`perform`, awaited."""
        try:
            self.send(await perform(operation))
        except grpc.RpcError as error:
            self.throw(error)

    def __enter__(self) -> Stepper[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the steps (a stream left open is cancelled)."""
        self._steps.close()


def _over_a_limit(error: grpc.RpcError) -> bool:
    """RESOURCE_EXHAUSTED without a retry delay: the request is over a size limit (with one,
    the server is busy, and the retry budget handles it)."""
    mapped = map_rpc_error(error)
    return mapped.code == grpc.StatusCode.RESOURCE_EXHAUSTED and mapped.retry_after is None


def _affinity(query: Query) -> int | None:
    """Calls that a server process's cache answers keep to one connection, so to that
    process (the client adds the caller's thread or task): the decode steps (short position
    lists) of one table, whose blocks their sequences share, and a range asked for again
    (the same table and start). Each process caches its own blocks: spread over processes,
    a range fetched twice was computed twice. Other calls spread."""
    if query.positions is None:
        start = query.start.to_bytes(8, "little", signed=True)
        return zlib.crc32(start, zlib.crc32(query.spec_key))
    if query.rows > MAX_CACHED_CALL_ROWS:
        return None
    return zlib.crc32(query.spec_key)


# -- the calls ---------------------------------------------------------------------------------


def result_dtype(dtype: object, out: object) -> Any:
    """A ``dtype=`` argument, None being ``out``'s dtype (else float32)."""
    if dtype is not None:
        return dtype
    if out is None:
        return "float32"
    name = out.dtype  # type: ignore[attr-defined]
    return torch_dtype_name(name) if is_tensor(out) else name


class Core:
    """The steps of every SDK call, on a client's settings, row cache and known widths.

    The public-facing methods check their arguments when called (not at the first step) and
    return the steps; ``new_token`` makes the futures that read-ahead tokens are.
    """

    def __init__(self, settings: Settings, rows: RowCache, new_token: Callable[[], Any]) -> None:
        self.settings = settings
        self.rows = rows
        self.widths = Widths()
        self._new_token = new_token
        self._contact = Contact(settings.target)
        # Set by the clients' close(); every call starts at budget(), so one check refuses all.
        self.closed = False

    def check_open(self) -> None:
        """ClientClosedError once the client is closed (every call starts here)."""
        if self.closed:
            raise ClientClosedError("the client is closed: create a new one")

    def budget(self, timeout: Timeout, *, retry: bool = True) -> CallBudget:
        """The deadline and retry budget of one call (every call starts with it)."""
        self.check_open()
        return CallBudget(
            resolve_timeout(timeout, self.settings.timeout),
            self.settings.max_retries if retry else 0,
            self.settings.retry_backoff,
            self._contact,
        )

    # -- what the public methods run; arguments are checked, and deadlines start, when
    # these are called, not at the first step

    def range_query(
        self,
        start: object,
        stop: object,
        table: object,
        dtype: DTypeArg | None,
        classic: Classic,
        **output: Any,
    ) -> tuple[Query, Output]:
        """The query of a range and how its rows are handed back (``output``: ``out``,
        ``device``, ``cos_sin``; see :class:`posenc._output.Output`)."""
        spec = table_spec(table, result_dtype(dtype, output.get("out")), classic)
        query = range_query(start, stop, spec, self.widths)
        return self._with_output(query, (max(query.rows, 0),), dtype, None, output)

    def positions_query(
        self,
        positions: npt.ArrayLike,
        table: object,
        dtype: DTypeArg | None,
        classic: Classic,
        coordinate_axis: int = -1,
        **output: Any,
    ) -> tuple[Query, Output]:
        """The query of positions of any shape (a tensor's on any device), and how its
        rows are handed back; a several-axis table's coordinates lie along
        ``coordinate_axis``."""
        array, device = positions_of(positions)
        spec = table_spec(table, result_dtype(dtype, output.get("out")), classic)
        axes = position_axes(str(spec.WhichOneof("table")))
        if coordinate_axis != -1:
            if axes == 1:
                raise bad_argument(
                    "coordinate_axis", f"spec.{spec.WhichOneof('table')} has one position axis"
                )
            try:
                array = np.moveaxis(np.asarray(array), coordinate_axis, -1)
            except (np.exceptions.AxisError, TypeError) as error:
                raise bad_argument("coordinate_axis", str(error)) from None
        query = positions_query(array, spec, self.widths, axes)
        shape = np.shape(array)[: -1 if axes > 1 else None]
        return self._with_output(query, shape, dtype, device, output)

    def grid_query(
        self, table: object, dtype: DTypeArg | None, **output: Any
    ) -> tuple[Query, Output]:
        """The query of a grid kind's whole grid (its rows in row-major order), handed back
        as ``[*grid_shape, width]``."""
        spec = as_spec(table, {})
        shape = spec.grid_shape
        if shape is None:
            raise bad_argument(
                "spec.table",
                f"{spec.kind} is not a grid kind (sincos_grid_2d, sincos_grid_3d): "
                "use get_range or get_positions",
            )
        proto = table_spec(spec, result_dtype(dtype, output.get("out")), {})
        query = range_query(0, math.prod(shape), proto, self.widths)
        return self._with_output(query, shape, dtype, None, output)

    @staticmethod
    def _with_output(
        query: Query,
        shape: tuple[int, ...],
        dtype: object,
        positions_device: Any,
        output: Mapping[str, Any],
    ) -> tuple[Query, Output]:
        result = Output.create(
            shape,
            query.dtype,
            positions_device=positions_device,
            torch_dtype=is_torch_dtype(dtype),
            rotary=query.spec.WhichOneof("table") in ("rotary", "mrope"),
            **output,
        )
        return dataclasses.replace(query, out=result.host), result

    def fetch(self, query: Query, output: Output, timeout: Timeout) -> Steps[Result]:
        """A whole table (``get_range``)."""
        return self._finish(self._fetch(query, self.budget(timeout)), output)

    def fetch_positions(self, query: Query, output: Output, timeout: Timeout) -> Steps[Result]:
        """The rows of a positions query, through the row cache (``get_positions``)."""
        if query.axes > 1:  # coordinates: the row cache keys rows by one position
            return self.fetch(query, output, timeout)
        return self._finish(self._through_rows(query, self.budget(timeout)), output)

    def stream(
        self, query: Query, output: Output, chunk_bytes: object, timeout: Timeout
    ) -> Steps[None]:
        """A table slice by slice (``iter_range``, ``iter_positions``)."""
        cursor = self._cursor(query, chunk_bytes)
        return self._stream(cursor, self.budget(timeout), output)

    def server_info(self, timeout: Timeout) -> Steps[ServerInfo]:
        return self._server_info(self.budget(timeout))

    def health(self, service: str, timeout: Timeout) -> Steps[str]:
        if not isinstance(service, str):
            raise TypeError(f"service must be a str, got {type(service).__name__}")
        # A probe reports what it sees now: never retried.
        request = health_pb2.HealthCheckRequest(service=service)
        return self._health(request, self.budget(timeout, retry=False))

    def prefetch(self, query: Query) -> list[AheadFetch]:
        """The background fetches that bring the rows of a positions query into the row
        cache (``prefetch``); the client starts each one as a read-ahead."""
        self.check_open()
        if query.axes > 1:
            return []  # coordinates bypass the row cache
        return self.rows.claim_prefetch(query, self._new_token)

    def fetch_ahead(self, ahead: AheadFetch) -> Steps[Rows | None]:
        """The steps of a background read-ahead: its rows, or None when it failed."""
        budget = self.budget(DEFAULT, retry=False)
        try:
            return (yield from self._fetch(ahead.query, budget, self._readahead_unary_max))
        except Exception:
            # Nothing is lost: the call that needs these rows fetches them itself, and
            # reports its own errors.
            return None

    def finish_ahead(self, ahead: AheadFetch, rows: Rows | None) -> None:
        """A read-ahead ended (``rows`` None: it failed, or never ran): its rows join the
        cache, and whoever waits for its token is woken."""
        self.rows.finish_ahead(ahead, rows)
        ahead.token.set_result(None)

    # -- the steps

    @staticmethod
    def _finish(steps: Steps[Rows], output: Output) -> Steps[Result]:
        rows = yield from steps
        return output.finish(rows)

    def _cursor(
        self, query: Query, chunk_bytes: object = None, *, collect: bool = False
    ) -> StreamCursor:
        chunk = check_chunk_bytes(chunk_bytes) or self.settings.chunk_bytes
        cursor = StreamCursor(query, chunk, collect=collect)

        def into(columns: int) -> Rows:
            # Learnt before the result is judged: a result refused as too large is refused
            # before any call the next time.
            self.widths.learn(query.spec_key, columns)
            return query.allocate(columns)

        cursor.into = into
        return cursor

    @property
    def _readahead_unary_max(self) -> int:
        # One GetEncoding call even above unary_max_bytes: the server answers position
        # lists from its cached blocks there, which the next steps' rows share.
        return max(self.settings.unary_max_bytes, self.rows.readahead_bytes)

    def _call(
        self, method: str, request: object, budget: CallBudget, affinity: int | None = None
    ) -> Steps[Any]:
        """One unary call, retried on transient failures within the budget."""
        while True:
            try:
                response = yield Unary(method, request, budget.attempt_timeout(), affinity)
            except grpc.RpcError as error:
                delay = budget.on_error(error)
            else:
                budget.progress()
                return response
            yield Sleep(delay)

    def _server_info(self, budget: CallBudget) -> Steps[ServerInfo]:
        response = yield from self._call("get_server_info", pb.GetServerInfoRequest(), budget)
        return server_info_from_proto(response)

    def _health(self, request: health_pb2.HealthCheckRequest, budget: CallBudget) -> Steps[str]:
        try:
            response = yield from self._call("health_check", request, budget)
        except NotFoundError:
            return "SERVICE_UNKNOWN"  # an answer: the server knows no such service
        try:
            name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except ValueError:
            return f"UNKNOWN({response.status})"
        return name

    def _fetch(
        self, query: Query, budget: CallBudget, unary_max_bytes: int | None = None
    ) -> Steps[Rows]:
        """A whole table: one unary call when it is small (or empty: the response still
        tells its width), else a stream collected into one array.

        Until a response has told the table's width, a call is small when it would be with
        one column: the server refuses a unary result over its limit before computing
        anything, and the call then streams. A decode loop's first step is one unary call.
        """
        if query.columns is not None:
            query.check_size(query.columns)  # the width is known: refused before any call
        parts = query.parts()
        if len(parts) > 1:
            tables = []
            for part in parts:
                tables.append((yield from self._fetch(part, budget, unary_max_bytes)))
                if len(tables) == 1:
                    query.check_size(tables[0].shape[1])  # the whole, once the width is told
            return np.concatenate(tables)
        unary_max = self.settings.unary_max_bytes if unary_max_bytes is None else unary_max_bytes
        size = query.nbytes
        if size is None:
            size = query.rows * query.dtype.itemsize
        if query.rows <= 0 or size <= unary_max:
            try:
                request = query.unary_request()
                tensor = yield from self._call("get_encoding", request, budget, _affinity(query))
                rows = decode_unary(tensor, query)
                self.widths.learn(query.spec_key, rows.shape[1])
                return rows
            except ResourceExhaustedError:
                if query.rows <= 0:
                    raise
                # The server's unary limit is below ours: stream instead.
        cursor = self._cursor(query, collect=True)
        yield from self._stream(cursor, budget)
        return cursor.result()

    def _stream(
        self,
        cursor: StreamCursor,
        budget: CallBudget,
        output: Output | None = None,
    ) -> Steps[None]:
        """The cursor's chunks (delivered unless it collects them); an interrupted call
        resumes with the missing rows."""
        collect = cursor.collect
        affinity = _affinity(cursor.query)
        while True:
            call = yield OpenStream(cursor.request(), budget.attempt_timeout(), affinity)
            # A stream that resumes takes the next connection: the one that failed may be gone.
            affinity = None
            try:
                while (chunk := (yield NextChunk(call))) is not None:
                    label, rows = cursor.accept(chunk)
                    self.widths.learn(cursor.query.spec_key, rows.shape[1])
                    if not collect:
                        assert output is not None, "an iterator's slices have an output"
                        yield Deliver((label, output.slice(rows)))
                    budget.progress()
                if cursor.more:
                    continue  # the next part of a long position list
                cursor.check_complete()
                return
            except grpc.RpcError as error:
                if cursor.done:
                    return  # the failure came after the last row: nothing is missing
                if _over_a_limit(error) and cursor.split():
                    continue  # the server's stream limit: ask for the rest in smaller calls
                delay = budget.on_error(error)
            finally:
                # A no-op when the call finished; frees the server's stream when the
                # caller abandoned the iterator or a chunk failed validation.
                call.cancel()
            yield Sleep(delay)

    def _through_rows(self, query: Query, budget: CallBudget) -> Steps[Rows]:
        """A positions query, through the row cache (see :mod:`posenc._rows`)."""
        plan = self.rows.plan(query)
        if isinstance(plan, Pending):  # rows on their way: wait, then take them
            yield Wait(plan.tokens, budget.attempt_timeout())
            # The fetch waited for may be the first to tell this table's width.
            query = dataclasses.replace(query, columns=self.widths.get(query.spec_key))
            plan = self.rows.plan(query, wait=False)
        rows = yield from self._rows_of(query, plan, budget)
        for ahead in self.rows.claim_ahead(query, self._new_token):
            yield ReadAhead(ahead)
        return rows

    def _rows_of(
        self, query: Query, plan: RowPlan | Pending | None, budget: CallBudget
    ) -> Steps[Rows]:
        if plan is None:
            return (yield from self._fetch(query, budget))
        assert isinstance(plan, RowPlan)
        if plan.fetch is None:
            return plan.result()
        try:
            fetched = yield from self._fetch(plan.fetch, budget, self._readahead_unary_max)
            return plan.result(fetched)
        except (InvalidArgumentError, ResourceExhaustedError):
            # Read-ahead may pass the server's position limit: the server judges the
            # caller's own request, and its error names the caller's positions.
            return (yield from self._fetch(query, budget))
