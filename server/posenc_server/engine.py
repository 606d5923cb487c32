"""Exact sinusoidal positional-encoding tables, in pure numpy.

The table is ``PE[pos, 2i] = sin(pos * inv_freq[i])``, ``PE[pos, 2i+1] = cos(pos * inv_freq[i])``
(see ``Layout`` and ``Schedule`` for the variants). Computing ``pos * inv_freq`` in float64
loses the angle at large positions: at ``pos = 2**42`` one float64 ulp of the angle is about
1e-3 radians. So the angle is carried in turns (``pos * inv_freq / 2pi``) as a double-double:

1. ``inv_freq / 2pi`` is computed once per table with 50 significant digits (``decimal``)
   and split into ``hi + lo`` float64 pairs (~106 bits): a ``Waves``.
2. ``pos * hi`` is an exact two-product (Dekker); its integer part is dropped exactly, leaving
   the fractional turn with an absolute error near 2**-64.
3. The fraction times 2pi (again double-double) is the angle reduced to [-pi, pi], and
   ``sin(a + da) = sin(a) + cos(a) * da`` folds in the low part.

Only the first position of each aligned block of rows takes this path; the others are one
complex multiplication away (``wave_rows``, ``wave_blocks``). The float64 result is within
about 2**-51 of the exact value, which rounds to float32, float16 and bfloat16 within one
ulp. The classic tables and every preset (``presets``) share this machinery. The module
imports no gRPC: it is the domain core.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import Final, Protocol

import ml_dtypes
import numpy as np
import numpy.typing as npt

Float64Array = npt.NDArray[np.float64]
Int64Array = npt.NDArray[np.int64]


class Layout(enum.Enum):
    """Column order of a row."""

    INTERLEAVED = "interleaved"
    """``sin_0, cos_0, sin_1, cos_1, ...`` (Vaswani et al. 2017)."""
    SPLIT = "split"
    """``sin_0 .. sin_{h-1}, cos_0 .. cos_{h-1}``."""


class Schedule(enum.Enum):
    """Frequency schedule ``inv_freq[i]``."""

    PAPER = "paper"
    """``base ** (-2i / d_model)`` for ``i < ceil(d_model / 2)``; odd widths end with a sin."""
    TENSOR2TENSOR = "tensor2tensor"
    """``base ** (-i / max(h - 1, 1))``, ``h = d_model // 2``; odd widths end with a zero."""


DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype("<f8"),
}
"""Output dtypes by name; all little-endian, as they travel on the wire."""

DEFAULT_BASE: Final = 10000.0

# 2pi to 60 significant digits; the engine tests check it against mpmath.
_TWO_PI = Decimal("6.28318530717958647692528676655900576839433879875021164194989")
_TWO_PI_HI: Final = float(_TWO_PI)
_TWO_PI_LO: Final = float(_TWO_PI - Decimal(_TWO_PI_HI))
# Veltkamp's constant 2**27 + 1 splits a float64 into two halves of at most 26 bits each,
# whose pairwise products are exact.
_SPLITTER: Final = 134217729.0
# Elements per numpy pass: keeps the float64 temporaries of one pass inside the L2 cache.
_ELEMENTS_PER_PASS: Final = 1 << 15
# Digits of the frequencies: their relative error stays near 1e-45 even after the 32768
# products of the widest table, far under the 2**-97 that position 2**42 needs.
PRECISION: Final = 50


class TablePreset(Protocol):
    """A model family's table (``posenc_server.presets``): frozen, hashable, all parameters."""

    def encode_positions(
        self, spec: EncodingSpec, positions: Int64Array
    ) -> npt.NDArray[np.generic]: ...

    def encode_range(
        self, spec: EncodingSpec, start: int, stop: int
    ) -> npt.NDArray[np.generic]: ...


@dataclass(frozen=True)
class EncodingSpec:
    """Everything that determines the values and bytes of a table."""

    d_model: int
    base: float = DEFAULT_BASE
    dtype: str = "float32"
    layout: Layout = Layout.INTERLEAVED
    schedule: Schedule = Schedule.PAPER
    preset: TablePreset | None = None
    """When set, the preset computes the table (``d_model`` wide, in ``dtype``); the other
    fields are then informative only."""

    @property
    def numpy_dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype of the table's elements."""
        return DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one table row."""
        return self.d_model * self.numpy_dtype.itemsize

    @property
    def sin_columns(self) -> int:
        """Number of sin columns (frequencies)."""
        if self.schedule is Schedule.TENSOR2TENSOR:
            return self.d_model // 2
        return (self.d_model + 1) // 2

    @property
    def cos_columns(self) -> int:
        """Number of cos columns."""
        return self.d_model // 2


class Waves:
    """Exact frequencies, as the block rotation needs them.

    ``hi + lo`` is ``inv_freq / 2pi`` in double-double. Rows are ``v(p) = sin(p w) +
    i cos(p w)``: as complex128 in memory, [sin, cos] pairs, the interleaved layout as it
    is. ``rotations`` holds ``conj(u(j)) = cos(j w) - i sin(j w)`` for the ``j < block``
    rows of one block, each within about 2**-53 of exact, so that
    ``v(b + j) = v(b) * conj(u(j))``. The classic tables and every preset build their rows
    from one of these (``wave_rows``, ``wave_blocks``).
    """

    def __init__(self, frequencies: Sequence[Decimal]) -> None:
        """``frequencies`` are the angular frequencies ``inv_freq[i]``, to ``PRECISION``."""
        self.count = len(frequencies)
        self.hi = np.empty(self.count, dtype=np.float64)
        self.lo = np.empty(self.count, dtype=np.float64)
        with localcontext() as context:
            context.prec = PRECISION
            for i, frequency in enumerate(frequencies):
                turns = frequency / _TWO_PI
                self.hi[i] = float(turns)
                self.lo[i] = float(turns - Decimal(self.hi[i]))
        self.block = _block_rows(self.count)
        sin, cos = _sin_cos_rows(np.arange(self.block, dtype=np.float64), self.hi, self.lo)
        self.rotations = np.empty(sin.shape, dtype=np.complex128)
        self.rotations.real = cos
        self.rotations.imag = -sin
        for array in (self.hi, self.lo, self.rotations):
            array.flags.writeable = False

    def bases(self, positions: Int64Array) -> npt.NDArray[np.complex128]:
        """``v(p)`` for each position, through the extended-precision angle."""
        sin, cos = _sin_cos_rows(positions.astype(np.float64), self.hi, self.lo)
        out = np.empty(sin.shape, dtype=np.complex128)
        out.real = sin
        out.imag = cos
        return out


def classic_waves(spec: EncodingSpec) -> Waves:
    """The waves of the paper's and tensor2tensor's schedules, one per sin column."""
    return _classic_waves(spec.base, spec.d_model, spec.schedule)


@functools.lru_cache(maxsize=32)
def _classic_waves(base: float, d_model: int, schedule: Schedule) -> Waves:
    count = EncodingSpec(d_model=d_model, base=base, schedule=schedule).sin_columns
    with localcontext() as context:
        context.prec = PRECISION
        if schedule is Schedule.PAPER:
            exponent_step = Decimal(2) / Decimal(d_model)
        else:
            exponent_step = Decimal(1) / Decimal(max(count - 1, 1))
        ratio = (-exponent_step * Decimal(base).ln()).exp()
        # inv_freq[i] = ratio ** i: one product per column instead of one exp per column.
        frequencies = [Decimal(1)]
        for _ in range(count - 1):
            frequencies.append(frequencies[-1] * ratio)
    return Waves(frequencies[:count])


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

    # angle = (turns_hi + turns_lo) * 2pi as double-double.
    angle = turns_hi * _TWO_PI_HI
    high, low = _split(turns_hi)
    angle_lo = high * _TWO_PI_SPLIT[0] - angle
    angle_lo += high * _TWO_PI_SPLIT[1]
    angle_lo += low * _TWO_PI_SPLIT[0]
    angle_lo += low * _TWO_PI_SPLIT[1]
    angle_lo += turns_hi * _TWO_PI_LO + turns_lo * _TWO_PI_HI

    sin = np.sin(angle)
    cos = np.cos(angle)
    # First-order correction for the low part of the angle (|angle_lo| < 2**-50).
    sin_exact = sin + cos * angle_lo
    cos_exact = cos - sin * angle_lo
    return sin_exact, cos_exact


def encode_positions(spec: EncodingSpec, positions: npt.ArrayLike) -> npt.NDArray[np.generic]:
    """The table rows for ``positions`` (any int64 values with ``|pos| <= 2**52``).

    Returns a C-contiguous array of shape ``(len(positions), d_model)`` in ``spec.dtype``.
    Callers validate ``spec`` and the positions; this function trusts them. Each row is a
    function of (spec, position) alone: the same bytes as ``encode_range`` gives for it.
    """
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if spec.preset is not None:
        return spec.preset.encode_positions(spec, pos)
    if pos.size and (span := int(pos.max()) - int(pos.min()) + 1) <= 4 * pos.size:
        # Clustered positions (a decode window, a shuffled range): the covering range is
        # cheaper than one extended-precision angle per row, and gives the same rows.
        low = int(pos.min())
        return encode_range(spec, low, low + span)[pos - low]
    out = np.zeros((pos.size, spec.d_model), dtype=spec.numpy_dtype)
    _write_layout(spec, out, wave_rows(classic_waves(spec), pos))
    return out


def encode_range(spec: EncodingSpec, start: int, stop: int) -> npt.NDArray[np.generic]:
    """The table rows for positions ``start, start + 1, ..., stop - 1``."""
    if spec.preset is not None:
        return spec.preset.encode_range(spec, start, stop)
    out = np.zeros((stop - start, spec.d_model), dtype=spec.numpy_dtype)
    for first, rows in wave_blocks(classic_waves(spec), start, stop):
        _write_layout(spec, out[first : first + len(rows)], rows)
    return out


def _write_layout(
    spec: EncodingSpec, target: npt.NDArray[np.generic], waves: npt.NDArray[np.complex128]
) -> None:
    """Write rows of ``v = sin + i cos`` into ``target`` in the spec's column order."""
    n_sin, n_cos = spec.sin_columns, spec.cos_columns
    if spec.layout is Layout.INTERLEAVED:
        # One contiguous conversion: [sin, cos] pairs are v's memory as it is.
        target[:, : n_sin + n_cos] = waves.view(np.float64)[:, : n_sin + n_cos]
    else:
        target[:, :n_sin] = waves.real
        target[:, n_sin : n_sin + n_cos] = waves.imag[:, :n_cos]


def wave_rows(waves: Waves, positions: Int64Array) -> npt.NDArray[np.complex128]:
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
    for first in range(0, positions.size, rows_per_pass):
        chunk = positions[first : first + rows_per_pass]
        offset = chunk % waves.block
        bases, base_of_row = np.unique(chunk - offset, return_inverse=True)
        np.multiply(
            waves.bases(bases)[base_of_row],
            waves.rotations[offset],
            out=out[first : first + chunk.size],
        )
    return out


def wave_blocks(
    waves: Waves, start: int, stop: int
) -> Iterator[tuple[int, npt.NDArray[np.complex128]]]:
    """``wave_rows`` of positions ``start .. stop - 1``, one aligned block at a time.

    Yields ``(row offset, rows)``; ``rows`` is a scratch buffer reused for the next block,
    so callers copy it out before asking for more (a fresh multi-MiB array per block would
    cost more in page faults than the multiplication).
    """
    if waves.count == 0 or stop <= start:
        return
    block = waves.block
    aligned = start - start % block
    block_starts = aligned + block * np.arange(-(-(stop - aligned) // block), dtype=np.int64)
    bases = waves.bases(block_starts)
    scratch = np.empty((block, waves.count), dtype=np.complex128)
    for index, block_start in enumerate(block_starts.tolist()):
        first, last = max(start, block_start), min(stop, block_start + block)
        rows = scratch[: last - first]
        np.multiply(
            bases[index : index + 1],
            waves.rotations[first - block_start : last - block_start],
            out=rows,
        )
        yield first - start, rows


def _block_rows(count: int) -> int:
    """Rows per block: up to 64, keeping the rotation table at 2**18 entries (4 MiB) at most."""
    return max(1, min(64, (1 << 18) // max(count, 1)))


def is_valid_base(base: float) -> bool:
    """Whether ``base`` is accepted: finite and greater than 1."""
    return math.isfinite(base) and base > 1.0
