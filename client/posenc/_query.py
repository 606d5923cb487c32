"""One table request, as the SDK's methods were called: argument checks, the ``Query``, the
``Output`` its rows are handed back in, its wire requests, and the ``Plan`` of a call.

A call's plan is a value built once, here, before any I/O: every argument checked and
normalised (the spec, the dtype, the output's shape and form, the timeout and deadline), and
how the rows travel (one GetEncoding call, whose request the plan holds, or the core's
steps). The driver makes the plan's call and hands its outcome to :mod:`posenc._core`, which
turns it into the result; nothing is asked of this module again (``tests/test_layering.py``).

Values are the server's to judge (its limits are configurable, and its messages name them);
the checks here refuse only what the wire types cannot carry, and what would be a bug.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from posenc._checks import INT64_MAX, INT64_MIN, bad_argument
from posenc._memory import memory_limit, new_array
from posenc._output import Output, is_tensor, is_torch_dtype, positions_of, torch_dtype_name
from posenc._retry import resolve_timeout
from posenc.errors import ClientClosedError, ResourceExhaustedError
from posenc.spec import Spec, enum_names, position_axes
from posenc.types import DEFAULT, DTypeArg, Timeout
from posenc_protocol.v1 import posenc_pb2 as pb

#: The ``dtype=`` names, from the ``Dtype`` enum; numpy knows each by that name.
DTYPE_NAMES: Final = tuple(enum_names(pb.Dtype.DESCRIPTOR))
_DTYPE_ENUMS: Final[Mapping[str, int]] = enum_names(pb.Dtype.DESCRIPTOR)
_DTYPE_NAMES_BY_ENUM: Final = {number: name for name, number in _DTYPE_ENUMS.items()}
# The numpy dtype of each name, bfloat16 once ml_dtypes is loaded (see load_dtypes).
_NUMPY_DTYPES: Final = {name: np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"}
# The classic table: what an int ``table`` is.
_CLASSIC: Final = "sinusoidal"
#: Widths learned from responses, per spec: more than any process uses at once.
WIDTHS_KEPT: Final = 256
# Specs and dtype names worked out from table and dtype arguments, kept so that a table
# asked for again is not converted again: more than any process uses at once.
_SPECS_KEPT: Final = 256
#: Positions one request carries at most (a coordinate is one position of its row): longer
#: lists travel in several calls. A request of this many positions is at most 640 KiB, so a
#: server holds little for each call while reading it (gRPC reads a request whole before
#: admitting it against its memory budget), and the calls of many clients at once stay small.
MAX_POSITIONS_PER_REQUEST: Final = 1 << 16
# Calls with more positions than this are batch work, not decode steps (see posenc._rows).
MAX_CACHED_CALL_ROWS: Final = 4096


def as_int(value: object, field: str) -> int:
    """``value`` as an int; bools are refused (passing True as a position is a bug)."""
    if isinstance(value, bool | np.bool_):
        raise bad_argument(field, f"must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise bad_argument(field, f"must be an integer, got {type(value).__name__}") from None


def as_int64(value: object, field: str) -> int:
    """``value`` as an int that an int64 field can carry."""
    number = as_int(value, field)
    if not INT64_MIN <= number <= INT64_MAX:
        raise bad_argument(field, f"must fit in int64, got {number}")
    return number


def choice(value: object, choices: Mapping[str, Any], field: str) -> str:
    """``value`` as one of the names in ``choices`` (case-insensitive)."""
    if not isinstance(value, str) or value.lower() not in choices:
        raise bad_argument(field, f"{value!r} is not one of {', '.join(choices)}")
    return value.lower()


def dtype_name(dtype: DTypeArg) -> str:
    """Normalizes a ``dtype=`` argument: a name, a numpy dtype such as ``np.float16``, or a
    torch dtype such as ``torch.bfloat16`` (each one worked out once)."""
    try:
        return _DTYPE_ARGUMENTS[dtype]
    except (KeyError, TypeError):  # not seen yet, or not hashable (the checks say why)
        pass
    name = _dtype_name(dtype)
    if len(_DTYPE_ARGUMENTS) < _SPECS_KEPT:
        _DTYPE_ARGUMENTS[dtype] = name
    return name


# What each dtype argument seen was worked out to be.
_DTYPE_ARGUMENTS: dict[object, str] = {}


def _dtype_name(dtype: DTypeArg) -> str:
    if isinstance(dtype, str):
        return choice(dtype, _DTYPE_ENUMS, "spec.dtype")
    if is_torch_dtype(dtype):
        return choice(torch_dtype_name(dtype), _DTYPE_ENUMS, "spec.dtype")
    try:
        name = np.dtype(dtype).name  # type: ignore[arg-type]  # a torch dtype was handled
    except TypeError:
        raise bad_argument("spec.dtype", f"{dtype!r} is not a dtype") from None
    return choice(name, _DTYPE_ENUMS, "spec.dtype")


def numpy_dtype(dtype: DTypeArg) -> np.dtype[Any]:
    """The numpy dtype of results for a ``dtype=`` argument (bfloat16: ml_dtypes)."""
    return named_dtype(dtype_name(dtype))


def named_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a ``Dtype`` name (bfloat16: ml_dtypes', see :func:`load_dtypes`)."""
    dtype = _NUMPY_DTYPES.get(name)
    if dtype is None:
        load_dtypes()
        dtype = _NUMPY_DTYPES[name]
    return dtype


def load_dtypes() -> None:
    """Registers numpy's ``"bfloat16"`` (ml_dtypes'), once per process: a client does it when
    it is made, so that no call pays it.

    Importing ml_dtypes takes most of a second of CPU (numpy adds each of its dtypes' loops
    one at a time, each against all those before it), more than ``import grpc, numpy``:
    paid by ``import posenc`` it would triple every import (``posenc --help``, a float32
    server's tests), and paid in the first bfloat16 call it would cost that call several
    times the time its bytes take on the wire. A thread cannot hide it: the extension holds
    the GIL throughout. So it is paid where a process sets up for calls, with its client.
    """
    if "bfloat16" not in _NUMPY_DTYPES:
        import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16")

        _NUMPY_DTYPES["bfloat16"] = np.dtype("bfloat16")


def as_spec(table: object, classic: Mapping[str, object]) -> Spec:
    """The spec of a ``table`` argument: an int is the classic table's ``d_model``, and
    ``classic`` (``base``, ``layout``, ``schedule``) its options."""
    if isinstance(table, Spec):
        if classic:
            name = next(iter(classic))
            raise bad_argument(
                f"spec.{table.kind}.{name}",
                f"{name}= goes with an int table (the classic d_model); "
                "a Spec carries its own parameters",
            )
        return table
    if isinstance(table, bool) or not isinstance(table, int | np.integer):
        raise bad_argument(
            "spec.table",
            f"must be a d_model (int) or a posenc.Spec, got {type(table).__name__}",
        )
    return Spec(_CLASSIC, d_model=table, **classic)


def as_positions(positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Converts ``positions`` (of any shape) to a flat int64 array, refusing anything but
    integers; :func:`positions_shape` is the shape the rows take.

    Floats are refused even when integral: ``np.arange(0, 1, 0.1)`` passed by mistake
    should fail loudly rather than be truncated to zeros.
    """
    if isinstance(positions, str | bytes):
        raise bad_argument("positions", "must be a sequence of integers, got a string")
    try:
        array = np.asarray(positions).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise bad_argument("positions", f"must be an array of integers ({e})") from None
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind == "O":
        # Python ints beyond int64 (or mixed objects): check each one.
        values = [as_int(v, "positions") for v in array]
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


def distinct(positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The distinct values of ``positions``, sorted: ``np.unique`` by a sort and a mask.

    numpy 2.4's ``np.unique`` (values only) hashes them first, which is an order of
    magnitude slower on the large position lists of a prefill.
    """
    ordered = np.sort(positions)
    keep = np.empty(ordered.shape, dtype=bool)
    keep[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def join_positions(queries: Sequence[Query]) -> Query:
    """One query of the position lists of ``queries`` (of one spec), one after the other:
    the rows of ``queries[i]`` follow those of ``queries[i - 1]`` in its result."""
    assert all(query.positions is not None for query in queries)
    positions = np.concatenate([query.positions for query in queries])
    return dataclasses.replace(queries[0], rows=positions.size, positions=positions, out=None)


def check_chunk_bytes(chunk_bytes: object) -> int | None:
    """Validates a ``chunk_bytes=`` argument (None: the server's default chunk size)."""
    if chunk_bytes is None:
        return None
    value = as_int(chunk_bytes, "max_chunk_bytes")
    if not 1 <= value < 1 << 32:
        raise bad_argument("max_chunk_bytes", f"must be in 1 .. 2**32 - 1, got {value}")
    return value


@dataclass(frozen=True, eq=False)
class Query:
    """One table request, independent of how it travels (unary, stream, resumed stream).

    Rows are numbered 0 .. ``rows - 1`` within the selection; a range's row ``i`` is
    position ``start + i``, a list's row ``i`` is ``positions[i]``. ``columns`` is the
    table's width once a response has told it (the client knows no table's width by
    itself), else None.
    """

    spec: pb.EncodingSpec
    #: The spec as deterministic bytes: what tells two specs' rows apart.
    spec_key: bytes
    dtype: np.dtype[Any]
    rows: int
    start: int = 0
    positions: npt.NDArray[np.int64] | None = None
    columns: int | None = None
    #: Position axes of the table: above 1, ``positions`` is ``[rows, axes]`` coordinates.
    axes: int = 1
    #: The caller's ``out=`` buffer as a 2-D host array: the rows are decoded into it
    #: when its shape is the result's (see :mod:`posenc._output`).
    out: npt.NDArray[Any] | None = None
    #: Rows that arrive in shared memory are handed back as a read-only view of it
    #: (``copy=False``, a numpy result without ``out=``).
    view: bool = False

    @property
    def row_bytes(self) -> int | None:
        """Bytes of a row, once the width is known."""
        return None if self.columns is None else self.columns * self.dtype.itemsize

    @property
    def nbytes(self) -> int | None:
        """Size of the whole result's data, once the width is known."""
        return None if self.columns is None else self.rows * self.columns * self.dtype.itemsize

    def label(self, row: int) -> int:
        """What iterators yield for a slice starting at ``row``: a range's position, a
        list's index into the positions."""
        return self.start + row if self.positions is None else row

    def check_size(self, columns: int, stream_limit: int | None = None) -> None:
        """Refuses a whole result of ``columns`` columns that this machine's memory cannot
        hold, or over the server's ``stream_limit`` (when known: a result fetched in parts,
        each under the limit, is judged whole, as one stream would be), before any of it is
        allocated: ResourceExhaustedError, as the server refuses a result over its limits."""
        size = max(self.rows, 0) * columns * self.dtype.itemsize
        if stream_limit is not None and size > stream_limit:
            raise ResourceExhaustedError(
                f"the result is {size} bytes, over the stream limit of {stream_limit} bytes: "
                "split the request into smaller ranges (or iterate: iter_range)"
            )
        if self.out is not None and self.out.shape == (max(self.rows, 0), columns):
            return  # the caller's own buffer holds it
        memory = memory_limit()
        if memory is not None and size > memory:
            raise ResourceExhaustedError(
                f"the result is {size} bytes, more than this machine's memory ({memory} "
                "bytes): split the request into smaller ranges (or iterate: iter_range)"
            )

    def allocate(self, columns: int) -> np.ndarray[Any, np.dtype[Any]]:
        """Where the whole result goes: the caller's ``out=`` when it has the result's
        shape, else a new uninitialized array (refused, before any allocation, when
        larger than this machine's memory)."""
        shape = (max(self.rows, 0), columns)
        if self.out is not None and self.out.shape == shape:
            return self.out
        self.check_size(columns)
        return new_array(shape, self.dtype)

    def empty(self) -> np.ndarray[Any, np.dtype[Any]]:
        """:meth:`allocate` at the width a response told."""
        assert self.columns is not None, "the width is known from a response"
        return self.allocate(self.columns)


class Widths(dict[bytes, int]):
    """Table widths learned from responses, by spec key: a table's width is a function of
    its spec, and knowing it lets a call choose unary or stream by size, and the row cache
    plan in bytes. Bounded, the first learned forgotten first. A dict, read with ``get``
    (atomic under the GIL, and no call of this module: a call's core reads it)."""

    def learn(self, key: bytes, width: int) -> None:
        if self.get(key) != width:
            self[key] = width
            self.trim()

    def trim(self) -> None:
        """Forgets the first learned widths beyond the bound."""
        while len(self) > WIDTHS_KEPT:
            try:
                del self[next(iter(self))]
            except (KeyError, RuntimeError, StopIteration):  # another thread's, meanwhile
                break


def _result_dtype(dtype: DTypeArg | None, out: Any) -> DTypeArg:
    """A ``dtype=`` argument, None being ``out``'s dtype (else float32)."""
    if dtype is not None:
        return dtype
    if out is None:
        return "float32"
    return torch_dtype_name(out.dtype) if is_tensor(out) else out.dtype


def table_spec(table: object, dtype: DTypeArg, classic: Mapping[str, object]) -> pb.EncodingSpec:
    """The ``EncodingSpec`` of a table method's ``table``, ``dtype`` and classic options
    (shared by the calls of the same table: not to be changed)."""
    return spec_and_key(table, dtype, classic)[0]


def spec_and_key(
    table: object, dtype: DTypeArg, classic: Mapping[str, object]
) -> tuple[pb.EncodingSpec, bytes]:
    """:func:`table_spec` and its deterministic bytes (what tells two specs' rows apart),
    worked out once per table: the same int, or the same :class:`Spec` object, with the same
    dtype and options, is found again without a conversion."""
    name = dtype_name(dtype)
    try:
        options = tuple(classic.items())
        memo: tuple[Any, ...] = (
            (table, name, options) if type(table) is int else (id(table), name, options, None)
        )
        found = _SPECS.get(memo)
    except TypeError:  # an unhashable option: the checks below say what is wrong with it
        memo, found = (), None
    if found is not None and (type(table) is int or found[0] is table):
        return found[1], found[2]
    spec = as_spec(table, classic).to_proto()
    spec.dtype = _DTYPE_ENUMS[name]  # type: ignore[assignment]
    key = spec.SerializeToString(deterministic=True)
    if memo:
        if len(_SPECS) >= _SPECS_KEPT:
            _SPECS.clear()
        # The table itself is kept: its id names no other object while it is here.
        _SPECS[memo] = (table, spec, key)
    return spec, key


# Specs worked out, by (table, dtype name, options); see spec_and_key.
_SPECS: dict[tuple[Any, ...], tuple[object, pb.EncodingSpec, bytes]] = {}


def range_query(
    start: object,
    stop: object,
    table: object,
    dtype: DTypeArg | None,
    classic: Mapping[str, object],
    widths: Widths,
    **output: Any,
) -> tuple[Query, Output]:
    """The query for positions ``[start, stop)``, and how its rows are handed back
    (``output``: ``out``, ``device``, ``cos_sin``; see :class:`posenc._output.Output`)."""
    first, end = as_int64(start, "range.start"), as_int64(stop, "range.stop")
    spec, key = spec_and_key(table, _result_dtype(dtype, output.get("out")), classic)
    # A negative row count (stop < start) goes to the server, which refuses it with its
    # own field violation; results are only allocated once the server has answered.
    rows = end - first
    return _query(spec, key, widths, (max(rows, 0),), dtype, output, rows=rows, start=first)


def positions_query(
    positions: npt.ArrayLike,
    table: object,
    dtype: DTypeArg | None,
    classic: Mapping[str, object],
    widths: Widths,
    coordinate_axis: int = -1,
    **output: Any,
) -> tuple[Query, Output]:
    """The query for an explicit list of positions of any shape (a tensor's on any device),
    read flat, or of coordinates along ``coordinate_axis`` (``[..., axes]``, read as
    ``[rows, axes]``) for a several-axis table; and how its rows are handed back."""
    array, device = positions_of(positions)
    spec, key = spec_and_key(table, _result_dtype(dtype, output.get("out")), classic)
    kind = spec.WhichOneof("table")
    axes = position_axes(str(kind))
    if coordinate_axis != -1:
        if axes == 1:
            raise bad_argument("coordinate_axis", f"spec.{kind} has one position axis")
        try:
            array = np.moveaxis(np.asarray(array), coordinate_axis, -1)
        except (np.exceptions.AxisError, TypeError) as error:
            raise bad_argument("coordinate_axis", str(error)) from None
    flat = as_positions(array)
    shape = np.shape(array)
    if axes > 1:
        if not shape or shape[-1] != axes:
            raise bad_argument(
                "coordinates.axes",
                f"spec.{kind} rows have {axes} position axes: positions must have a "
                f"trailing axis of {axes}, got shape {tuple(shape)}",
            )
        flat = flat.reshape(-1, axes)
        shape = shape[:-1]
    return _query(
        spec, key, widths, shape, dtype, output, device, rows=len(flat), positions=flat, axes=axes
    )


def grid_query(
    table: object, dtype: DTypeArg | None, widths: Widths, **output: Any
) -> tuple[Query, Output]:
    """The query of a grid kind's whole grid (its rows in row-major order), handed back as
    ``[*grid_shape, width]``."""
    spec = as_spec(table, {})
    shape = spec.grid_shape
    if shape is None:
        raise bad_argument(
            "spec.table",
            f"{spec.kind} is not a grid kind (sincos_grid_2d, sincos_grid_3d): "
            "use get_range or get_positions",
        )
    proto, key = spec_and_key(spec, _result_dtype(dtype, output.get("out")), {})
    return _query(proto, key, widths, shape, dtype, output, rows=math.prod(shape), start=0)


def _query(
    spec: pb.EncodingSpec,
    key: bytes,
    widths: Widths,
    shape: tuple[int, ...],
    dtype: DTypeArg | None,
    output: Mapping[str, Any],
    positions_device: Any = None,
    **selection: Any,
) -> tuple[Query, Output]:
    """The query and its output; a result whose width is known already is judged now,
    before any call (see :meth:`Query.check_size`)."""
    numpy_type = named_dtype(_DTYPE_NAMES_BY_ENUM[spec.dtype])
    output = dict(output)
    copy = output.pop("copy", True)
    if not isinstance(copy, bool):
        raise bad_argument("copy", f"must be true or false, got {copy!r}")
    result = Output.create(
        shape,
        numpy_type,
        positions_device=positions_device,
        # (a name or None is no torch dtype: no call to ask)
        torch_dtype=not (dtype is None or isinstance(dtype, str)) and is_torch_dtype(dtype),
        rotary=spec.WhichOneof("table") in ("rotary", "mrope"),
        **output,
    )
    view = not copy and not result.tensor and result.out is None
    query = Query(
        spec, key, numpy_type, columns=widths.get(key), out=result.host, view=view, **selection
    )
    if query.columns is not None:
        query.check_size(query.columns)
    return query, result


# -- the wire requests ------------------------------------------------------------------------


def _rows_per_request(query: Query) -> int:
    """Rows one request carries at most: ``MAX_POSITIONS_PER_REQUEST`` positions, a
    several-axis table's row being ``axes`` of them."""
    return max(MAX_POSITIONS_PER_REQUEST // query.axes, 1)


def request_stop(query: Query, first_row: int) -> int:
    """The row after the last one a request starting at ``first_row`` asks for."""
    if query.positions is None:
        return query.rows
    return min(query.rows, first_row + _rows_per_request(query))


def request_selection(query: Query, first_row: int, stop_row: int) -> dict[str, Any]:
    # Rows before first_row were already received: ask only for the rest (up to stop_row,
    # when a long selection travels in parts).
    if query.positions is None:
        range_ = pb.PositionRange(start=query.start + first_row, stop=query.start + stop_row)
        return {"range": range_}
    if query.axes > 1:
        coordinates = query.positions[first_row:stop_row].reshape(-1).tolist()
        return {"coordinates": pb.CoordinateList(axes=query.axes, coordinates=coordinates)}
    return {"positions": pb.PositionList(positions=query.positions[first_row:stop_row].tolist())}


def parts(query: Query) -> list[Query]:
    """``query`` as queries that one request each carries (split by rows: a several-axis
    table's ``positions`` are ``[rows, axes]``)."""
    step = _rows_per_request(query)
    if query.positions is None or query.rows <= step:
        return [query]
    return [
        dataclasses.replace(query, rows=len(part), positions=part)
        for part in np.split(query.positions, range(step, query.rows, step))
    ]


def unary_request(query: Query) -> pb.GetEncodingRequest:
    """The GetEncoding request of a query that one request carries (see :func:`parts`)."""
    return pb.GetEncodingRequest(spec=query.spec, **request_selection(query, 0, query.rows))


def affinity(query: Query) -> int | None:
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


# -- the plan of a call -----------------------------------------------------------------------


class Context(Protocol):
    """What a plan is made from besides the call's arguments: the client's core (its
    settings, the widths it learned, whether it is closed)."""

    closed: bool
    widths: Widths

    @property
    def settings(self) -> Any: ...  # posenc._channel.Settings (which imports this module)


@dataclass(frozen=True, eq=False)
class Plan:
    """One table call, built once before any I/O: the query (its spec, dtype, selection,
    known width, destination), the result's form, the whole call's timeout and deadline,
    and ``request``, the GetEncoding request the driver makes first (with ``affinity``), or
    None when the rows travel otherwise (a stream, shared memory): then the core's steps
    run from the start. Nothing in it changes: retries and resumes are the core's."""

    query: Query
    output: Output
    timeout: float | None
    deadline: float | None
    request: pb.GetEncodingRequest | None
    affinity: int | None
    #: An iterator's chunk size (checked; None: the server's), which its stream asks for.
    chunk_bytes: int | None = None


def range_plan(
    context: Context,
    start: object,
    stop: object,
    table: object,
    dtype: DTypeArg | None,
    classic: Mapping[str, object],
    timeout: Timeout,
    **output: Any,
) -> Plan:
    """The plan of ``get_range``: rows ``[start, stop)`` (see :func:`range_query`)."""
    seconds, deadline = _budget(context, timeout)
    query, result = range_query(start, stop, table, dtype, classic, context.widths, **output)
    return _range_plan(context, query, result, seconds, deadline)


def grid_plan(
    context: Context, table: object, dtype: DTypeArg | None, timeout: Timeout, **output: Any
) -> Plan:
    """The plan of ``get_grid``: a grid kind's whole grid (see :func:`grid_query`)."""
    seconds, deadline = _budget(context, timeout)
    query, result = grid_query(table, dtype, context.widths, **output)
    return _range_plan(context, query, result, seconds, deadline)


def positions_plan(
    context: Context,
    positions: npt.ArrayLike,
    table: object,
    dtype: DTypeArg | None,
    classic: Mapping[str, object],
    coordinate_axis: int,
    timeout: Timeout,
    **output: Any,
) -> Plan:
    """The plan of ``get_positions`` (see :func:`positions_query`): no call first, since the
    row cache decides, when the call runs, what it asks for (its steps: posenc._core)."""
    seconds, deadline = _budget(context, timeout)
    query, result = positions_query(
        positions, table, dtype, classic, context.widths, coordinate_axis, **output
    )
    return Plan(query, result, seconds, deadline, None, None)


def stream_plan(
    context: Context,
    made_by: Callable[..., tuple[Query, Output]],
    arguments: tuple[object, ...],
    chunk_bytes: object,
    timeout: Timeout,
    device: Any,
) -> Plan:
    """The plan of an iterator (``iter_range``, ``iter_positions``, ``iter_grid``): its query
    and slices' form made by ``made_by`` (:func:`range_query`, ...) of ``arguments``, then
    its chunk size checked, then its budget started; no call first: the core streams it."""
    query, result = made_by(*arguments, context.widths, device=device)
    chunk = context.settings.chunk_bytes if chunk_bytes is None else check_chunk_bytes(chunk_bytes)
    seconds, deadline = _budget(context, timeout)
    return Plan(query, result, seconds, deadline, None, None, chunk)


def _budget(context: Context, timeout: Timeout) -> tuple[float | None, float | None]:
    """A call's timeout and deadline (monotonic); ClientClosedError once the client is
    closed (every planned call starts here)."""
    if context.closed:
        raise ClientClosedError()
    # (DEFAULT is the client's timeout: no call to ask)
    seconds = context.settings.timeout if timeout is DEFAULT else resolve_timeout(timeout, None)
    return seconds, None if seconds is None else time.monotonic() + seconds


def _range_plan(
    context: Context, query: Query, result: Output, seconds: float | None, deadline: float | None
) -> Plan:
    """The plan of a range ``query``: one GetEncoding call when the result is small (a width
    not known yet counts as one column: the server refuses a unary result over its limit
    before computing anything, and the core then streams), else the core's steps."""
    settings = context.settings
    size = query.rows * (query.columns or 1) * query.dtype.itemsize
    if settings.shared_memory is not None or (query.rows > 0 and size > settings.unary_max_bytes):
        return Plan(query, result, seconds, deadline, None, None)
    return Plan(query, result, seconds, deadline, unary_request(query), affinity(query))
