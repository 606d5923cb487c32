"""Exact sinusoidal rows, in pure numpy, for any table kind.

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

The engine does only IEEE additions, multiplications and ``rint`` in float64, one numpy
operation each, never numpy's sin, cos or complex multiplication: those dispatch to
CPU-specific SIMD kernels (SVML, FMA) whose last bits differ between machines, while these
give the same bytes on every CPU and numpy build (``NPY_DISABLE_CPU_FEATURES`` included).

Only the first position of each aligned block of rows takes this path; the others are one
complex multiplication away (``wave_rows``, ``wave_blocks``). The float64 result is within
about 2**-51 of the exact value, which rounds to float32, float16 and bfloat16 within one
ulp.

The engine knows no table kind: a kind (``posenc_server.tables``) says its frequencies, how
its positions map to rows of the wave table (``PositionMap``) and how a row of ``v`` becomes
its columns (``Table``); ``encode_range`` and ``encode_positions`` run any of them. The
module imports no gRPC and no protobuf: it is the domain core.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Float64Array = npt.NDArray[np.float64]
Int64Array = npt.NDArray[np.int64]
ComplexRows = npt.NDArray[np.complex128]
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
"""Output dtypes by name (see ``_Dtypes``)."""

TWO_PI: Final = Decimal("6.28318530717958647692528676655900576839433879875021164194989")
"""2pi to 60 significant digits; the engine tests check it against mpmath."""
PRECISION: Final = 50
"""Digits of the frequencies: their relative error stays near 1e-45 even after the 32768
products of the widest table, far under the 2**-97 that position 2**42 needs."""

_TWO_PI_HI: Final = float(TWO_PI)
_TWO_PI_LO: Final = float(TWO_PI - Decimal(_TWO_PI_HI))
# Veltkamp's constant 2**27 + 1 splits a float64 into two halves of at most 26 bits each,
# whose pairwise products are exact.
_SPLITTER: Final = 134217729.0
# Elements per numpy pass of the rotation: its four float64 operands stay in the L2 cache.
_ELEMENTS_PER_PASS: Final = 1 << 15
# Elements per pass of the extended-precision angle, whose two dozen temporaries are many
# more: 32 KiB each (at 32768 elements it ran twice as slow).
_ANGLE_ELEMENTS_PER_PASS: Final = 1 << 12
# Rows per block: 64 amortize a block's extended-precision angle (about 20 numpy passes)
# over the 3 passes of each row's rotation. Narrow tables take longer blocks, so that a block
# (one Python iteration) holds at least _BLOCK_ENTRIES entries (a rotary table of head_dim
# 128: 256 rows, its rotation table 512 KiB; at 4,096 entries its range ran 25-45% slower);
# wide ones shorter, so that the rotation table (2 float64 pairs per entry: 32 bytes) stays
# within _ROTATION_ENTRIES (4 MiB).
_BLOCK_ROWS: Final = 64
_BLOCK_ENTRIES: Final = 1 << 14
_ROTATION_ENTRIES: Final = 1 << 17
# Up to this many rows of a block are rotated by rotations made for them alone, while the
# block's rotation table is not made yet.
_FEW_ROTATIONS: Final = 8
# At most this many block bases (and _BASES_AHEAD_ELEMENTS values) are made ahead of a long
# range's next blocks: two passes of the extended-precision angle.
_MAX_BASES_AHEAD: Final = 64
_BASES_AHEAD_ELEMENTS: Final = 2 * _ANGLE_ELEMENTS_PER_PASS
# Taylor coefficients of sin (x**3 .. x**17) and cos (x**4 .. x**18): on [-pi/4, pi/4] the
# first term left out is below 2**-63.
_SIN_TAYLOR: Final = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(1, 9))
_COS_TAYLOR: Final = tuple((-1) ** k / math.factorial(2 * k) for k in range(2, 10))


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
        """Write ``rows`` of ``v = sin + i cos`` into ``target``'s columns (zeros beforehand).

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
    i cos(p w)``: as complex128 in memory, [sin, cos] pairs, the interleaved layout as it
    is. ``v(b + j) = v(b) * conj(u(j))`` with ``conj(u(j)) = cos(j w) - i sin(j w)`` for the
    ``j < block`` rows of one block, each within about 2**-53 of exact; the product is
    written out in real operations (``_rotate``) over the float64 pairs of the rows and of
    ``rotate_cos = [cos, cos]`` and ``rotate_sin = [sin, -sin]``. Every table kind builds its
    rows from one of these (``wave_rows``, ``wave_blocks``), then scales them by
    ``amplitude``.
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
        # The block's rotation table, made when a range first needs it: a new spec's first
        # rows (a decode step's few) need only their own rotations, not the whole table.
        self._rotation: tuple[Float64Array, Float64Array] | None = None
        self._rotation_lock = threading.Lock()
        # The bases of the next few blocks of a long range, made in one pass (a block's
        # base alone costs as much in numpy calls as a dozen together): (first start, rows).
        ahead_blocks = _BASES_AHEAD_ELEMENTS // max(self.count, 1)
        self._ahead_blocks = max(1, min(_MAX_BASES_AHEAD, ahead_blocks))
        self._ahead: tuple[int, ComplexRows] | None = None

    def rotation(self, first: int, last: int) -> tuple[Float64Array, Float64Array]:
        """``rotate_cos`` and ``rotate_sin`` (see the class) of rows ``first .. last - 1``
        of a block: from the table, which a span of more than a few rows makes first."""
        table = self._rotation
        if table is None and last - first <= _FEW_ROTATIONS:
            return self._rotations(np.arange(first, last, dtype=np.int64))
        if table is None:
            with self._rotation_lock:
                if self._rotation is None:
                    whole = self._rotations(np.arange(self.block, dtype=np.int64))
                    for array in whole:
                        array.flags.writeable = False
                    self._rotation = whole
                table = self._rotation
        return table[0][first:last], table[1][first:last]

    def rotation_rows(self, offsets: Int64Array) -> tuple[Float64Array, Float64Array]:
        """``rotate_cos`` and ``rotate_sin`` of the block rows ``offsets`` (any order)."""
        if self._rotation is None and offsets.size <= _FEW_ROTATIONS:
            return self._rotations(offsets)
        cos, sin = self.rotation(0, self.block)
        return cos[offsets], sin[offsets]

    @property
    def pass_rows(self) -> int:
        """Rows of one pass of the block rotation (``wave_blocks`` yields at most these)."""
        return min(self.block, max(1, _ELEMENTS_PER_PASS // (2 * max(self.count, 1))))

    @property
    def has_rotation_table(self) -> bool:
        """Whether the block's rotation table is made."""
        return self._rotation is not None

    def _rotations(self, offsets: Int64Array) -> tuple[Float64Array, Float64Array]:
        """The rotation rows of ``offsets``: each a function of its offset alone, the same
        bytes whether made for the table or on their own."""
        return rotation_pairs(self.bases(offsets))

    def bases(self, positions: Int64Array) -> npt.NDArray[np.complex128]:
        """``v(p)`` for each position, through the extended-precision angle."""
        out = np.empty((positions.size, self.count), dtype=np.complex128)
        as_float = positions.astype(np.float64)
        # A few rows per pass (or a slice of one wide row), so that the pass's two dozen
        # temporaries stay in the CPU cache.
        columns = min(self.count, _ANGLE_ELEMENTS_PER_PASS) or 1
        rows = max(1, _ANGLE_ELEMENTS_PER_PASS // columns)
        for first in range(0, positions.size, rows):
            for column in range(0, self.count, columns):
                last = column + columns
                sin, cos = _sin_cos_rows(
                    as_float[first : first + rows], self.hi[column:last], self.lo[column:last]
                )
                part = out[first : first + rows, column:last]
                part.real = sin
                part.imag = cos
        return out

    def block_bases(self, first: int, count: int, ahead: int) -> ComplexRows:
        """``bases`` of the ``count`` block starts from ``first`` (aligned); ``ahead``: how
        many rows after these blocks the caller will ask for next, whose block bases are
        made now with these and kept for those calls (``_ahead_blocks`` at most)."""
        kept = self._ahead
        if kept is not None:
            index, misaligned = divmod(first - kept[0], self.block)
            if not misaligned and index >= 0 and index + count <= len(kept[1]):
                return kept[1][index : index + count]
        extra = max(0, min(self._ahead_blocks - count, ahead // self.block))
        starts = first + self.block * np.arange(count + extra, dtype=np.int64)
        rows = self.bases(starts)
        if extra > 0:
            self._ahead = (first, rows)  # one assignment: readers see old or new
        return rows[:count]

    @property
    def nbytes(self) -> int:
        """Bytes held by the frequencies, the rotation table and the bases kept ahead
        (counted whether made yet or not: what a spec may come to hold)."""
        rotation = 2 * self.block * 2 * self.count * 8
        return self.hi.nbytes + self.lo.nbytes + rotation + self._ahead_blocks * self.count * 16


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

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.table.width * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Approximately the memory it holds."""
        return self.waves.nbytes + 512


def rotation_pairs(rotations: ComplexRows) -> tuple[Float64Array, Float64Array]:
    """``rotate_cos`` and ``rotate_sin`` (see ``Waves``) of rows ``v(j)`` of offsets ``j``."""
    sin, cos = rotations.real, rotations.imag
    pairs = (rotations.shape[0], rotations.shape[1], 2)
    rotate_cos = np.empty(pairs, dtype=np.float64)
    rotate_cos[..., 0] = cos
    rotate_cos[..., 1] = cos
    rotate_sin = np.empty(pairs, dtype=np.float64)
    rotate_sin[..., 0] = sin
    rotate_sin[..., 1] = -sin
    shape = (rotations.shape[0], 2 * rotations.shape[1])
    return rotate_cos.reshape(shape), rotate_sin.reshape(shape)


def _split(values: Float64Array) -> tuple[Float64Array, Float64Array]:
    """Veltkamp split: ``values == high + low`` with both halves at most 26 bits wide."""
    scaled = values * _SPLITTER
    high = scaled - (scaled - values)
    return high, values - high


# The two halves of 2pi's high part, for the exact product of the turn fraction with 2pi.
_TWO_PI_SPLIT: Final = tuple(float(half[0]) for half in _split(np.array([_TWO_PI_HI])))


def _sin_cos_rows(
    positions: Float64Array, freq_hi: Float64Array, freq_lo: Float64Array
) -> tuple[Float64Array, Float64Array]:
    """sin and cos of ``2pi * positions[:, None] * (freq_hi + freq_lo)[None, :]`` in float64."""
    pos = positions[:, None]
    pos_high, pos_low = _split(positions)
    freq_high, freq_low = _split(freq_hi)
    ph, pl = pos_high[:, None], pos_low[:, None]

    # Exact two-product pos * freq_hi = product + product_error (Dekker).
    product = pos * freq_hi
    product_error = ph * freq_high - product
    product_error += ph * freq_low
    product_error += pl * freq_high
    product_error += pl * freq_low

    # Dropping whole turns is exact; what is left lies in [-0.5, 0.5].
    turns = product - np.rint(product)
    correction = product_error + pos * freq_lo
    # Two-sum: turns + correction == turns_hi + turns_lo exactly.
    turns_hi = turns + correction
    virtual = turns_hi - turns
    turns_lo = (turns - (turns_hi - virtual)) + (correction - virtual)

    # Less the nearest quarter turn (exact: both are multiples of turns_hi's ulp), within
    # [-1/8, 1/8] turn.
    quarter = np.rint(turns_hi * 4.0)
    turns_hi -= quarter * 0.25

    # angle = (turns_hi + turns_lo) * 2pi as double-double, in [-pi/4, pi/4].
    angle = turns_hi * _TWO_PI_HI
    high, low = _split(turns_hi)
    angle_lo = high * _TWO_PI_SPLIT[0] - angle
    angle_lo += high * _TWO_PI_SPLIT[1]
    angle_lo += low * _TWO_PI_SPLIT[0]
    angle_lo += low * _TWO_PI_SPLIT[1]
    angle_lo += turns_hi * _TWO_PI_LO + turns_lo * _TWO_PI_HI

    sin, cos = _sin_cos_small(angle)
    # First-order correction for the low part of the angle (|angle_lo| < 2**-50).
    sin_exact = sin + cos * angle_lo
    cos_exact = cos - sin * angle_lo
    # Quarter turn q: (sin, cos) becomes (cos, -sin), (-sin, -cos), (-cos, sin) for q = 1..3.
    q = quarter.astype(np.int64) & 3
    swap = (q & 1).astype(bool)
    sin = np.where(swap, cos_exact, sin_exact)
    cos = np.where(swap, sin_exact, cos_exact)
    sin *= 1 - 2 * (q >> 1)
    cos *= 1 - 2 * ((q ^ (q >> 1)) & 1)
    return sin, cos


def _sin_cos_small(x: Float64Array) -> tuple[Float64Array, Float64Array]:
    """sin and cos of ``x`` in [-pi/4, pi/4], each within about 0.7 ulp.

    Taylor polynomials in ``z = x * x``; cos adds ``1 - z / 2`` with its rounding errors
    (and that of ``z``) carried separately, so that its largest term costs no accuracy.
    """
    z = x * x
    x_high, x_low = _split(x)
    z_error = (x_high * x_high - z) + 2.0 * x_high * x_low + x_low * x_low
    sin_tail = _horner(z, _SIN_TAYLOR)
    sin_tail *= z
    sin_tail *= x
    sin = x + sin_tail
    half = 0.5 * z
    head = 1.0 - half
    cos_tail = _horner(z, _COS_TAYLOR)
    cos_tail *= z
    cos_tail *= z
    cos_tail += ((1.0 - head) - half) - 0.5 * z_error
    cos = head + cos_tail
    return sin, cos


def _horner(z: Float64Array, coefficients: Sequence[float]) -> Float64Array:
    """``c0 + c1 z + c2 z**2 + ...``, Horner's way."""
    acc = np.full_like(z, coefficients[-1])
    for coefficient in reversed(coefficients[:-1]):
        acc *= z
        acc += coefficient
    return acc


def _rotate(
    bases: Float64Array,
    swapped: Float64Array,
    rotate_cos: Float64Array,
    rotate_sin: Float64Array,
    out: Float64Array,
    scratch: Float64Array,
) -> None:
    """``out = v(b) * conj(u(j))`` on float64 pairs: ``[s, c] * [C, C] + [c, s] * [S, -S]``.

    ``bases`` are rows of ``[sin, cos]`` pairs, ``swapped`` the same rows as ``[cos, sin]``;
    the four products and two sums of a complex product, rounded one by one as on any CPU.
    """
    np.multiply(bases, rotate_cos, out=out)
    np.multiply(swapped, rotate_sin, out=scratch)
    out += scratch


def _pairs(rows: ComplexRows) -> tuple[Float64Array, Float64Array]:
    """Complex rows as float64 ``[sin, cos]`` pairs, and the same rows as ``[cos, sin]``."""
    flat = rows.view(np.float64)
    swapped = np.empty_like(flat)
    swapped[:, 0::2] = flat[:, 1::2]
    swapped[:, 1::2] = flat[:, 0::2]
    return flat, swapped


def encode_range(
    encoding: Encoding, start: int, stop: int, out: Rows | None = None, ahead: int = 0
) -> Rows:
    """The rows of positions ``start, start + 1, ..., stop - 1``, C-contiguous: ``out``
    when given (C-contiguous, of the encoding's dtype and shape), written in place.
    ``ahead``: rows after ``stop`` the caller will ask for next (a long range block by
    block), for which work may be done now, cheaper in one pass than in several.

    Callers validate the table and the positions; this function trusts them. Each row is a
    function of (table, position) alone: the same bytes as ``encode_positions`` gives.
    """
    if encoding.axis_table is not None:
        rows = encode_coordinates(encoding, np.arange(start, stop, dtype=np.int64))
        if out is None:
            return rows
        out[...] = rows
        return out
    position_map = encoding.table.position_map
    if position_map.keeps_ranges:
        offset = position_map.offset
        out = _range_rows(encoding, start + offset, stop + offset, out, ahead)
    else:
        rows = _rows_at(encoding, position_map.apply(np.arange(start, stop, dtype=np.int64)))
        if out is None:
            out = rows
        else:
            out[...] = rows
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
    out = _rows_at(encoding, position_map.apply(requested))
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


def _range_rows(
    encoding: Encoding, first: int, last: int, out: Rows | None = None, ahead: int = 0
) -> Rows:
    """Wave-table rows ``first .. last - 1`` in the table's columns, block by block (into
    ``out`` when given)."""
    if out is None:
        out = np.zeros((max(last - first, 0), encoding.width), dtype=encoding.dtype)
    else:
        out[...] = 0  # columns a kind leaves unwritten are zeros
    amplitude = encoding.waves.amplitude
    with _columns(encoding, min(last - first, encoding.waves.pass_rows)) as write:
        for offset, rows in wave_blocks(encoding.waves, first, last, ahead):
            if amplitude != 1.0:
                rows *= amplitude
            write(out[offset : offset + len(rows)], rows)
    return out


def _rows_at(encoding: Encoding, mapped: Int64Array) -> Rows:
    """Wave-table rows at ``mapped`` positions, in the table's columns."""
    if mapped.size and (span := int(mapped.max()) - int(mapped.min()) + 1) <= 4 * mapped.size:
        # Clustered positions (a decode window, a shuffled or descending range): the
        # covering range is cheaper than one extended-precision angle per row, and gives
        # the same rows.
        low = int(mapped.min())
        return _range_rows(encoding, low, low + span)[mapped - low]
    out = np.zeros((mapped.size, encoding.width), dtype=encoding.dtype)
    rows = wave_rows(encoding.waves, mapped)
    if encoding.waves.amplitude != 1.0:
        rows *= encoding.waves.amplitude
    with _columns(encoding, min(mapped.size, encoding.waves.pass_rows)) as write:
        write(out, rows)
    return out


@contextlib.contextmanager
def _columns(encoding: Encoding, rows: int) -> Iterator[Callable[[Rows, ComplexRows], None]]:
    """A writer of rows of ``v`` into the table's columns of the encoding's dtype (zeros
    beforehand): the table's own, or for bfloat16 one through float64 columns and
    ``_to_bfloat16``, ``rows`` rows at a time in the engine's scratch buffers.

    ml_dtypes' own conversion from float64 to bfloat16 runs a scalar loop, 4 to 5 times
    slower than the vector passes there, and took most of a cold bfloat16 stream's server
    time. Both give the same bytes.
    """
    write_columns = encoding.table.write_columns
    if encoding.dtype.name != "bfloat16":
        yield write_columns
        return
    rows = max(rows, 1)
    shape, elements = (rows, encoding.width), rows * encoding.width
    with _SCRATCH.buffers(elements) as (wide_buffer, single_buffer, bits_buffer, _):
        wide = wide_buffer[:elements].reshape(shape)
        wide[...] = 0  # columns a kind leaves unwritten stay zeros
        single = single_buffer.view(np.float32)[:elements].reshape(shape)
        bits = bits_buffer.view(np.uint32)[:elements].reshape(shape)

        def write(target: Rows, values: ComplexRows) -> None:
            for first in range(0, len(values), rows):
                count = min(rows, len(values) - first)
                write_columns(wide[:count], values[first : first + count])
                part = target[first : first + count]
                _to_bfloat16(wide[:count], part, single[:count], bits[:count])

        yield write


def _to_bfloat16(
    values: Float64Array,
    out: Rows,
    single: npt.NDArray[np.float32],
    bits: npt.NDArray[np.uint32],
) -> None:
    """``out[...] = values`` rounded to the nearest bfloat16 (ties to even), as ml_dtypes
    rounds; ``single`` and ``bits`` are scratch of the same shape.

    Through float32 (rounded to nearest), then to bfloat16 by rounding its bits: the two
    roundings give the nearest bfloat16 of the float64 value except where the first made
    a tie for the second (low 16 bits exactly 0x8000, one value in 65536), and those few
    are converted from float64 directly.
    """
    np.copyto(single, values, casting="same_kind")
    pattern = single.view(np.uint32)
    np.right_shift(pattern, 16, out=bits)
    np.bitwise_and(bits, 1, out=bits)  # ties to even: + 0x8000 when the kept part is odd
    bits += 0x7FFF
    bits += pattern
    bits >>= 16
    np.copyto(out.view(np.uint16), bits, casting="unsafe")
    np.bitwise_and(pattern, 0xFFFF, out=bits)
    ties = bits == 0x8000
    if ties.any():
        out[ties] = values[ties].astype(out.dtype)


def wave_rows(waves: Waves, positions: Int64Array) -> ComplexRows:
    """``v(p) = sin(p w) + i cos(p w)`` for every position (rows) and frequency (columns).

    Uses the relative-position property of the paper, ``u(b + j) = u(b) * u(j)``: a position
    is its aligned block base ``b = p - p % block`` (one extended-precision angle, shared by
    the positions of that block) times the exact rotation of ``j``. Each factor is within
    2**-53 of exact, so a row is within about 2**-51, and a function of ``p`` alone: the
    same whichever request, range or list, asks for it.
    """
    out = np.empty((positions.size, waves.count), dtype=np.complex128)
    if waves.count == 0 or positions.size == 0:
        return out
    rows_per_pass = max(1, _ELEMENTS_PER_PASS // waves.count)
    scratch = np.empty((min(rows_per_pass, positions.size), 2 * waves.count))
    for first in range(0, positions.size, rows_per_pass):
        chunk = positions[first : first + rows_per_pass]
        offset = chunk % waves.block
        bases, base_of_row = np.unique(chunk - offset, return_inverse=True)
        flat, swapped = _pairs(waves.bases(bases))
        rotate_cos, rotate_sin = waves.rotation_rows(offset)
        _rotate(
            flat[base_of_row],
            swapped[base_of_row],
            rotate_cos,
            rotate_sin,
            out[first : first + chunk.size].view(np.float64),
            scratch[: chunk.size],
        )
    return out


def wave_blocks(
    waves: Waves, start: int, stop: int, ahead: int = 0
) -> Iterator[tuple[int, ComplexRows]]:
    """``wave_rows`` of positions ``start .. stop - 1``, a few rows of one aligned block at
    a time.

    Yields ``(row offset, rows)``; ``rows`` is a scratch buffer reused for the next rows,
    so callers copy it out before asking for more. Passes of at most ``_ELEMENTS_PER_PASS``
    float64 values keep the rotation's operands in the CPU cache, and the buffers outlive
    the call (``_SCRATCH``): a fresh multi-MiB array per call costs more in page faults than
    the multiplication (five times more for a 1 MiB block).
    """
    if waves.count == 0 or stop <= start:
        return
    block = waves.block
    aligned = start - start % block
    block_starts = aligned + block * np.arange(-(-(stop - aligned) // block), dtype=np.int64)
    few: tuple[Float64Array, Float64Array] | None = None
    if block_starts.size == 1 and stop - start <= _FEW_ROTATIONS and not waves.has_rotation_table:
        # A new spec's first few rows: their base and their rotations in one pass.
        offsets = np.arange(start - aligned, stop - aligned, dtype=np.int64)
        base_and_rotations = waves.bases(np.concatenate((block_starts, offsets)))
        flat, swapped = _pairs(base_and_rotations[:1])
        few = rotation_pairs(base_and_rotations[1:])
    else:  # blocks of a long range, whose next blocks come next
        end = aligned + block * block_starts.size
        flat, swapped = _pairs(waves.block_bases(aligned, block_starts.size, ahead + stop - end))
    yield from _rotated_blocks(waves, start, stop, block_starts, flat, swapped, few)


def _rotated_blocks(
    waves: Waves,
    start: int,
    stop: int,
    block_starts: Int64Array,
    flat: Float64Array,
    swapped: Float64Array,
    few: tuple[Float64Array, Float64Array] | None,
) -> Iterator[tuple[int, ComplexRows]]:
    """``wave_blocks``' rows, from its block bases (``few``: the rotations of its rows), a
    pass at a time in scratch buffers lent for the whole range."""
    block, pair_columns = waves.block, 2 * waves.count
    rows_per_pass = waves.pass_rows
    pass_elements = rows_per_pass * pair_columns
    with _SCRATCH.buffers(pass_elements) as (buffer, products, base_rows, swapped_rows):
        for index, block_start in enumerate(block_starts.tolist()):
            first, last = max(start, block_start), min(stop, block_start + block)
            rotate_cos, rotate_sin = few or waves.rotation(first - block_start, last - block_start)
            # The block's base row, repeated over a pass's rows: multiplying by a broadcast
            # row goes through numpy's buffered loop, which copies it for every row and ran
            # two to three times slower (block by block, as the service asks) than these
            # same-shape multiplications plus the one copy per block.
            span = min(rows_per_pass, last - first)
            base = base_rows[: span * pair_columns].reshape(span, pair_columns)
            base[...] = flat[index]
            base_swapped = swapped_rows[: span * pair_columns].reshape(span, pair_columns)
            base_swapped[...] = swapped[index]
            for low in range(first, last, rows_per_pass):
                high = min(low + rows_per_pass, last)
                shape = (high - low, pair_columns)
                rows = buffer[: shape[0] * pair_columns].reshape(shape)
                _rotate(
                    base[: shape[0]],
                    base_swapped[: shape[0]],
                    rotate_cos[low - first : high - first],
                    rotate_sin[low - first : high - first],
                    rows,
                    products[: shape[0] * pair_columns].reshape(shape),
                )
                yield low - start, rows.view(np.complex128)


class _ScratchPool:
    """Groups of four float64 scratch buffers (a pass's worth, or one row of the widest
    table: at most 2 MiB a group) lent to one computation at a time; at most ``keep``
    groups are kept between computations, so idle threads hold none."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[tuple[Float64Array, ...]] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def buffers(self, elements: int) -> Iterator[tuple[Float64Array, ...]]:
        """Four buffers of at least ``elements`` values each, until the block ends."""
        with self._lock:
            group = self._free.pop() if self._free else None
        if group is None or group[0].size < elements:
            size = max(elements, _ELEMENTS_PER_PASS)
            group = tuple(np.empty(size, dtype=np.float64) for _ in range(4))
        try:
            yield group
        finally:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(group)


# Enough for the computations that run at once on a few cores.
_SCRATCH: Final = _ScratchPool(keep=8)


def _block_rows(count: int) -> int:
    """Rows per block for ``count`` frequencies (see ``_BLOCK_ROWS``)."""
    count = max(count, 1)
    return max(1, min(max(_BLOCK_ROWS, _BLOCK_ENTRIES // count), _ROTATION_ENTRIES // count))
