"""One table request, as the SDK's methods were called: argument checks, the ``Query``, and
the ``Output`` its rows are handed back in.

Values are the server's to judge (its limits are configurable, and its messages name them);
the checks here refuse only what the wire types cannot carry, and what would be a bug.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from posenc._checks import INT64_MAX, INT64_MIN, as_int, as_int64, bad_argument, choice
from posenc._memory import memory_limit, new_array
from posenc._output import Output, is_tensor, is_torch_dtype, positions_of, torch_dtype_name
from posenc.errors import ResourceExhaustedError
from posenc.spec import Spec, enum_names, position_axes
from posenc.types import DTypeArg
from posenc_protocol.v1 import posenc_pb2 as pb

#: The ``dtype=`` names, from the ``Dtype`` enum; numpy knows each by that name.
DTYPE_NAMES: Final = tuple(enum_names(pb.Dtype.DESCRIPTOR))
_DTYPE_ENUMS: Final[Mapping[str, int]] = enum_names(pb.Dtype.DESCRIPTOR)
_DTYPE_NAMES_BY_ENUM: Final = {number: name for name, number in _DTYPE_ENUMS.items()}
# The numpy dtype of each name, bfloat16 once ml_dtypes is loaded (see load_dtypes).
_NUMPY_DTYPES: Final = {name: np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"}
# The classic table: what an int ``table`` is.
_CLASSIC: Final = "sinusoidal"
# Widths learned from responses, per spec: more than any process uses at once.
_WIDTHS_KEPT: Final = 256


def dtype_name(dtype: DTypeArg) -> str:
    """Normalizes a ``dtype=`` argument: a name, a numpy dtype such as ``np.float16``, or a
    torch dtype such as ``torch.bfloat16``."""
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


class Widths:
    """Table widths learned from responses, by spec key: a table's width is a function of
    its spec, and knowing it lets a call choose unary or stream by size, and the row cache
    plan in bytes. Bounded, least recently used forgotten first; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._widths: OrderedDict[bytes, int] = OrderedDict()

    def get(self, key: bytes) -> int | None:
        with self._lock:
            width = self._widths.get(key)
            if width is not None:
                self._widths.move_to_end(key)
            return width

    def learn(self, key: bytes, width: int) -> None:
        with self._lock:
            self._widths[key] = width
            self._widths.move_to_end(key)
            if len(self._widths) > _WIDTHS_KEPT:
                self._widths.popitem(last=False)


def _result_dtype(dtype: DTypeArg | None, out: Any) -> DTypeArg:
    """A ``dtype=`` argument, None being ``out``'s dtype (else float32)."""
    if dtype is not None:
        return dtype
    if out is None:
        return "float32"
    return torch_dtype_name(out.dtype) if is_tensor(out) else out.dtype


def table_spec(table: object, dtype: DTypeArg, classic: Mapping[str, object]) -> pb.EncodingSpec:
    """The ``EncodingSpec`` of a table method's ``table``, ``dtype`` and classic options."""
    name = dtype_name(dtype)
    spec = as_spec(table, classic).to_proto()
    spec.dtype = _DTYPE_ENUMS[name]  # type: ignore[assignment]
    return spec


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
    spec = table_spec(table, _result_dtype(dtype, output.get("out")), classic)
    # A negative row count (stop < start) goes to the server, which refuses it with its
    # own field violation; results are only allocated once the server has answered.
    rows = end - first
    return _query(spec, widths, (max(rows, 0),), dtype, output, rows=rows, start=first)


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
    spec = table_spec(table, _result_dtype(dtype, output.get("out")), classic)
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
        spec, widths, shape, dtype, output, device, rows=len(flat), positions=flat, axes=axes
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
    proto = table_spec(spec, _result_dtype(dtype, output.get("out")), {})
    return _query(proto, widths, shape, dtype, output, rows=math.prod(shape), start=0)


def _query(
    spec: pb.EncodingSpec,
    widths: Widths,
    shape: tuple[int, ...],
    dtype: DTypeArg | None,
    output: Mapping[str, Any],
    positions_device: Any = None,
    **selection: Any,
) -> tuple[Query, Output]:
    """The query and its output; a result whose width is known already is judged now,
    before any call (see :meth:`Query.check_size`)."""
    key = spec.SerializeToString(deterministic=True)
    numpy_type = named_dtype(_DTYPE_NAMES_BY_ENUM[spec.dtype])
    output = dict(output)
    copy = output.pop("copy", True)
    if not isinstance(copy, bool):
        raise bad_argument("copy", f"must be true or false, got {copy!r}")
    result = Output.create(
        shape,
        numpy_type,
        positions_device=positions_device,
        torch_dtype=is_torch_dtype(dtype),
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
