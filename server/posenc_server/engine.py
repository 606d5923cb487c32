"""Exact sinusoidal rows, in numpy and compiled loops (``kernel``), for any table kind.

A table is built from rows ``v(p) = sin(p w) + i cos(p w)`` over its frequencies ``w``.
Computing ``p * w`` in float64 loses the angle at large positions: at ``p = 2**42`` one
float64 ulp of the angle is about 1e-3 radians. So the angle is carried in turns
(``p * w / 2pi``) as a double-double:

1. ``w / 2pi`` is computed once per table with 50 significant digits (``decimal``) and
   split into ``hi + lo`` float64 pairs (~106 bits): a ``Waves``.
2. ``p * hi`` is an exact two-product (Dekker); its integer part is dropped exactly, leaving
   the fractional turn with an absolute error near 2**-64.
3. The fraction, less its nearest quarter turn (exact), times 2pi (again double-double) is
   an angle in [-pi/4, pi/4]; its sin and cos are Taylor polynomials (``_sin_cos_small``),
   ``sin(a + da) = sin(a) + cos(a) * da`` folds in the low part, and the quarter turn swaps
   and negates them.

Only the first position of each aligned block of rows takes this path; the others are one
complex multiplication away, by the exact rotation of their offset in the block (``Waves``),
which ``kernel.rotate_into`` does and writes straight into the table's columns. The float64
result is within about 2**-51 of the exact value, which rounds to float32, float16 and
bfloat16 within one ulp.

The engine does only IEEE additions, multiplications and ``rint`` in float64, each rounded
on its own (numpy operations, and the kernel compiled without FMA or reassociation), never
numpy's sin, cos or complex multiplication: those dispatch to CPU-specific SIMD kernels
(SVML, FMA) whose last bits differ between machines, while these give the same bytes on
every CPU and numpy build (``NPY_DISABLE_CPU_FEATURES`` included).

The engine knows no table kind: a kind (``posenc_server.tables``) says its frequencies, how
its positions map to rows of the wave table (``PositionMap``) and how a row of ``v`` becomes
its columns (``Table``); ``encode_range`` and ``encode_positions`` run any of them. The
module imports no gRPC and no protobuf: it is the domain core.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from posenc_server.numerics import STORE_BFLOAT16, STORE_FLOAT16, STORE_VALUES, TWO_PI

Float64Array = npt.NDArray[np.float64]
Int64Array = npt.NDArray[np.int64]
ComplexRows = npt.NDArray[np.complex128]
Planes = npt.NDArray[np.float64]
"""Rows of ``v`` as the kernel takes them: ``[n, 2, count]``, each row's sines then its
cosines."""
Rows = npt.NDArray[np.generic]


class _Dtypes(Mapping[str, "np.dtype[np.generic]"]):
    """Output dtypes by name; all little-endian, as they travel on the wire. bfloat16 is
    ml_dtypes', imported when first asked for: its import takes most of a second, more
    than the rest of a server process's start."""

    _SPECS: Final = {"float32": "<f4", "float16": "<f2", "bfloat16": "bfloat16", "float64": "<f8"}

    def __getitem__(self, name: str) -> np.dtype[np.generic]:
        spec = self._SPECS[name]
        if name == "bfloat16":
            import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16")
        return np.dtype(spec)

    def __iter__(self) -> Iterator[str]:
        return iter(self._SPECS)

    def __len__(self) -> int:
        return len(self._SPECS)


DTYPES: Final = _Dtypes()
_FLOAT16: Final = np.dtype(np.float16)
"""Output dtypes by name (see ``_Dtypes``)."""

PRECISION: Final = 50
"""Digits of the frequencies: their relative error stays near 1e-45 even after the 32768
products of the widest table, far under the 2**-97 that position 2**42 needs."""

# Rows per block: 64 amortize a block's extended-precision angle (some 60 float64 operations
# an element) over its rows' rotations (6). Narrow tables take longer blocks, so that a block
# holds at least _BLOCK_ENTRIES entries (a rotary table of head_dim 128: 256 rows, its
# rotation table 256 KiB); wide ones shorter, so that the rotation table (16 bytes an
# entry) stays within _ROTATION_ENTRIES (2 MiB).
_BLOCK_ROWS: Final = 64
_BLOCK_ENTRIES: Final = 1 << 14
_ROTATION_ENTRIES: Final = 1 << 17
# Up to this many distinct rows of a block are rotated by rotations made for them alone,
# while the block's rotation table is not made yet.
_FEW_ROTATIONS: Final = 8
# Rows and elements of out per kernel call: its positions and index arrays take about 40
# bytes a row, its bases up to 8 a column (a narrow table's 1 MiB block, 262,144 rows, in
# one call would hold 10 MiB of them).
_KERNEL_ROWS: Final = 1 << 14
_KERNEL_ELEMENTS: Final = 1 << 20


@dataclass(frozen=True)
class PositionMap:
    """Which row of the wave table a requested position ``p`` is.

    ``offset - p`` when ``descending``, else ``p + offset``; then clamped to at most
    ``clamp`` (when set). The row of the requested position ``zero_row`` is all zeros.
    """

    offset: int = 0
    descending: bool = False
    clamp: int | None = None
    zero_row: int | None = None

    @property
    def keeps_ranges(self) -> bool:
        """Whether a range of positions maps to a range (a plain shift)."""
        return not self.descending and self.clamp is None

    def apply(self, positions: Int64Array) -> Int64Array:
        """The wave-table positions of ``positions``."""
        mapped = self.offset - positions if self.descending else positions + self.offset
        if self.clamp is not None:
            mapped = np.minimum(mapped, self.clamp)
        return mapped


class Table(Protocol):
    """What the engine needs of a table kind (``posenc_server.tables``)."""

    @property
    def width(self) -> int:
        """Columns of a row."""
        ...

    @property
    def position_map(self) -> PositionMap:
        """How requested positions map to wave-table positions."""
        ...

    def waves(self) -> Waves:
        """The table's exact frequencies (computed once per spec, by the caller's choice)."""
        ...

    def write_columns(self, target: Rows, rows: ComplexRows) -> None:
        """Write ``rows`` of ``v = sin + i cos`` into ``target``'s columns (zeros beforehand),
        copying values only: the engine reads the layout off it (``Encoding.columns``).

        ``rows`` may be a scratch buffer: the method must not keep it.
        """
        ...


@runtime_checkable
class AxisTable(Table, Protocol):
    """A table whose rows are indexed by several position axes (coordinates): it composes
    its rows itself, from per-axis ``wave_rows`` (``posenc_server.tables.multiaxis``)."""

    def coordinates(self, positions: Int64Array) -> Int64Array:
        """The ``[n, axes]`` coordinates of one-axis positions (range and list selections)."""
        ...

    def encode(self, encoding: Encoding, coordinates: Int64Array) -> Rows:
        """The rows of ``[n, axes]`` coordinates, each a function of its coordinates alone."""
        ...


class Waves:
    """Exact frequencies, as the block rotation needs them.

    ``hi + lo`` is ``inv_freq / 2pi`` in double-double. Rows are ``v(p) = sin(p w) +
    i cos(p w)``, as ``Planes``. A position ``p`` is its aligned block base ``b = p - j``
    (``j = p % block``) rotated back by ``j``: ``v(b + j) = v(b) * conj(u(j))`` with
    ``conj(u(j)) = cos(j w) - i sin(j w)``, both factors through the extended-precision
    angle, each within about 2**-53 of exact (``kernel.rotate_into`` multiplies them). Every
    table kind builds its rows from one of these, then scales them by ``amplitude``.
    """

    def __init__(self, frequencies: Sequence[Decimal], amplitude: float = 1.0) -> None:
        """``frequencies`` are the angular frequencies ``inv_freq[i]``, to ``PRECISION``;
        every row is multiplied by ``amplitude`` (rotary's attention factor)."""
        self.count = len(frequencies)
        self.amplitude = amplitude
        self.hi = np.empty(self.count, dtype=np.float64)
        self.lo = np.empty(self.count, dtype=np.float64)
        with localcontext() as context:
            context.prec = PRECISION
            per_turn = 1 / TWO_PI
            for i, frequency in enumerate(frequencies):
                # Through exact integer ratios: int / int is correctly rounded, and twice as
                # fast as float(Decimal), which formats and parses the digits.
                numerator, denominator = (frequency * per_turn).as_integer_ratio()
                high = numerator / denominator
                high_numerator, high_denominator = high.as_integer_ratio()
                self.hi[i] = high
                self.lo[i] = (numerator * high_denominator - high_numerator * denominator) / (
                    denominator * high_denominator
                )
        self.block = _block_rows(self.count)
        for array in (self.hi, self.lo):
            array.flags.writeable = False
        # The rotation table (``v(j)`` for every row ``j`` of a block), made when a range
        # first needs it: a new spec's first rows (a decode step's few) need only their own.
        self._rotation: Planes | None = None
        self._rotation_lock = threading.Lock()

    def factors(self, positions: Int64Array) -> tuple[Planes, Int64Array, Planes, Int64Array]:
        """The two factors of each position's row, as ``kernel.rotate_into`` takes them:
        block bases and the index of each position's, rotations and each position's."""
        offsets = positions % self.block
        distinct, base_index = np.unique(positions - offsets, return_inverse=True)
        if not self.rotates(positions.size):
            # A new spec's first rows: their bases and their rotations in one call.
            wanted, rotation_index = np.unique(offsets, return_inverse=True)
            both = self.bases(np.concatenate((distinct, wanted)))
            return both[: distinct.size], base_index, both[distinct.size :], rotation_index
        return self.bases(distinct), base_index, self.rotation_table(), offsets

    def rotates(self, rows: int) -> bool:
        """Whether ``rows`` rows are rotated by the rotation table (which the first such
        rows make), rather than by rotations made for them alone (see ``factors``)."""
        return self._rotation is not None or rows > _FEW_ROTATIONS

    def rotation_table(self) -> Planes:
        """``v(j)`` for every row ``j < block`` of a block (made once, on first use)."""
        table = self._rotation
        if table is None:
            with self._rotation_lock:
                if self._rotation is None:
                    self._rotation = self.bases(np.arange(self.block, dtype=np.int64))
                table = self._rotation
        return table

    def bases(self, positions: Int64Array) -> Planes:
        """``v(p)`` for each position, through the extended-precision angle."""
        out = np.empty((positions.size, 2, self.count), dtype=np.float64)
        _kernels().angles_into(positions.astype(np.int64, copy=False), self.hi, self.lo, out)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held by the frequencies and the rotation table (counted whether made yet
        or not: what a spec may come to hold)."""
        return self.hi.nbytes + self.lo.nbytes + self.block * self.count * 16


@dataclass(frozen=True, eq=False)
class Encoding:
    """A table kind ready to run: its waves (computed once) and its element type."""

    table: Table
    dtype: np.dtype[np.generic]
    waves: Waves

    @classmethod
    def prepare(cls, table: Table, dtype: str) -> Encoding:
        """Compute ``table``'s waves; ``dtype`` is a key of ``DTYPES``."""
        return cls(table, DTYPES[dtype], table.waves())

    @property
    def width(self) -> int:
        """Columns of a row."""
        return self.table.width

    @functools.cached_property
    def axis_table(self) -> AxisTable | None:
        """The table when it has several position axes, else None (checked once: a
        protocol check costs tens of microseconds, as much as a small block's rows)."""
        return self.table if isinstance(self.table, AxisTable) else None

    @functools.cached_property
    def columns(self) -> Int64Array:
        """For each column of the table, which value of a row of ``v``'s ``[sin, cos]``
        pairs it holds (``2 * count``: a zero column), read off the kind's own
        ``write_columns`` (its one statement of its layout) by writing rows whose values
        are their indices."""
        count = self.waves.count
        indices = np.arange(2 * count, dtype=np.float64) + 1.0
        probe = indices.view(np.complex128)[None, :]
        written = np.zeros((2, self.table.width))
        self.table.write_columns(written[:1], probe)
        self.table.write_columns(written[1:], -probe)
        # A writer that copies gives each index (negated with the probe), or zero.
        sources = written[0]
        copied = np.isin(sources, indices) | (sources == 0.0)
        if not (copied.all() and np.array_equal(written[1], -sources)):
            raise ValueError(f"{type(self.table).__name__}.write_columns must only copy values")
        columns: Int64Array = np.where(sources == 0.0, 2 * count + 1, sources).astype(np.int64)
        return columns - 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.table.width * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Approximately the memory it holds."""
        return self.waves.nbytes + 512


def encode_range(encoding: Encoding, start: int, stop: int, out: Rows | None = None) -> Rows:
    """The rows of positions ``start, start + 1, ..., stop - 1``, C-contiguous: ``out``
    when given (C-contiguous, of the encoding's dtype and shape), written in place.

    Callers validate the table and the positions; this function trusts them. Each row is a
    function of (table, position) alone: the same bytes as ``encode_positions`` gives.
    """
    if encoding.axis_table is not None:
        rows = encode_coordinates(encoding, np.arange(start, stop, dtype=np.int64))
        if out is None:
            return rows
        out[...] = rows
        return out
    if out is None:
        out = np.empty((max(stop - start, 0), encoding.width), dtype=encoding.dtype)
    position_map = encoding.table.position_map
    for first in range(start, stop, _KERNEL_ROWS):
        positions = np.arange(first, min(first + _KERNEL_ROWS, stop), dtype=np.int64)
        target = out[first - start : first - start + positions.size]
        if position_map.keeps_ranges:
            _write_rows(encoding, positions + position_map.offset, target, consecutive=True)
        else:
            _write_rows(encoding, position_map.apply(positions), target)
    zero_row = position_map.zero_row
    if zero_row is not None and start <= zero_row < stop:
        out[zero_row - start] = 0
    return out


def encode_positions(encoding: Encoding, positions: npt.ArrayLike) -> Rows:
    """The rows of ``positions`` (any int64 values the table's validation accepts)."""
    requested = np.asarray(positions, dtype=np.int64).reshape(-1)
    if encoding.axis_table is not None:
        return encode_coordinates(encoding, requested)
    position_map = encoding.table.position_map
    out = np.empty((requested.size, encoding.width), dtype=encoding.dtype)
    _write_rows(encoding, position_map.apply(requested), out)
    if position_map.zero_row is not None:
        out[requested == position_map.zero_row] = 0
    return out


def encode_coordinates(encoding: Encoding, coordinates: Int64Array) -> Rows:
    """The rows of a several-axis table at ``[n, axes]`` coordinates, or at one-axis
    positions (``[n]``: the table's ``coordinates`` of them)."""
    table = encoding.axis_table
    assert table is not None, "a table with several position axes"
    if coordinates.ndim == 1:
        coordinates = table.coordinates(coordinates)
    return table.encode(encoding, coordinates)


def wave_rows(waves: Waves, positions: Int64Array) -> ComplexRows:
    """``v(p) = sin(p w) + i cos(p w)`` for every position (rows) and frequency (columns),
    each a function of ``p`` alone (see ``Waves``), not scaled by the amplitude."""
    out = np.empty((positions.size, waves.count), dtype=np.complex128)
    identity = np.arange(2 * waves.count, dtype=np.int64)
    _rotate(waves, positions, identity, 1.0, out.view(np.float64), consecutive=False)
    return out


def _write_rows(
    encoding: Encoding, positions: Int64Array, out: Rows, *, consecutive: bool = False
) -> None:
    """``out[r]`` = the row of wave-table position ``positions[r]`` in the table's columns
    (``consecutive``: the positions are a range), every dtype by the kernels: float32 and
    float64 rows cast as they are stored, bfloat16 and float16 ones rounded by the kernel
    and stored as their bits."""
    waves, columns, amplitude = encoding.waves, encoding.columns, encoding.waves.amplitude
    # By kind and object, not by name: a dtype's name is built anew each time, which costs
    # as much as a good part of a block's rows. bfloat16 is the one void-kind dtype of DTYPES.
    stored, target = STORE_VALUES, out
    if out.dtype.kind == "V":
        stored, target = STORE_BFLOAT16, out.view(np.uint16)
    elif out.dtype == _FLOAT16:
        stored, target = STORE_FLOAT16, out.view(np.uint16)
    _rotate(waves, positions, columns, amplitude, target, consecutive, stored)


def _rotate(
    waves: Waves,
    positions: Int64Array,
    columns: Int64Array,
    amplitude: float,
    out: Rows,
    consecutive: bool,
    stored: int = STORE_VALUES,
) -> None:
    """The rows of ``positions`` into ``out``, stored as ``stored`` says (``STORE_*``: a
    half-precision format's bits in a uint16 ``out``, by that format's kernels): a range
    (``consecutive``) in one ``kernel.range_into`` call, which makes its blocks' bases
    itself; other positions, or a new spec's first few rows, by ``kernel.rotate_into``,
    ``_KERNEL_ROWS`` and ``_KERNEL_ELEMENTS`` of ``out`` at most a call (the factors numpy
    makes for each call take memory in proportion)."""
    kernels = _kernels()
    if consecutive and positions.size and waves.rotates(positions.size):
        rotations = waves.rotation_table()
        range_into = kernels.RANGE_INTO[stored]
        range_into(int(positions[0]), waves.hi, waves.lo, rotations, columns, amplitude, out)
        return
    rotate_into = kernels.ROTATE_INTO[stored]
    step = max(1, min(_KERNEL_ROWS, _KERNEL_ELEMENTS // max(out.shape[1], 1)))
    for first in range(0, positions.size, step):
        part = positions[first : first + step]
        factors = waves.factors(part)
        rotate_into(*factors, columns, amplitude, out[first : first + part.size])


@functools.cache
def _kernels() -> types.ModuleType:
    """``posenc_server.kernel``, imported (its loops compiled, or loaded from numba's cache)
    on first use: numba's import alone takes a third of a second."""
    from posenc_server import kernel

    return kernel


def prepare_kernel() -> None:
    """Compile (or load from numba's cache) the kernels for every array type the engine
    gives them, on a tiny table: a server calls this before it listens, so that no request
    waits for a compilation."""
    waves = Waves([Decimal(1)])
    waves.rotation_table()
    positions, columns = np.arange(2, dtype=np.int64), np.arange(2, dtype=np.int64)
    for dtype, stored in (
        (np.float32, STORE_VALUES),
        (np.float64, STORE_VALUES),
        (np.uint16, STORE_BFLOAT16),
        (np.uint16, STORE_FLOAT16),
    ):
        out = np.empty((2, 2), dtype)
        for consecutive in (False, True):  # rotate_into, range_into
            _rotate(waves, positions, columns, 1.0, out, consecutive, stored)


def _block_rows(count: int) -> int:
    """Rows per block for ``count`` frequencies (see ``_BLOCK_ROWS``)."""
    count = max(count, 1)
    return max(1, min(max(_BLOCK_ROWS, _BLOCK_ENTRIES // count), _ROTATION_ENTRIES // count))
