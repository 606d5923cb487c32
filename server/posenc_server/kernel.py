"""The engine's compiled loops: the extended-precision angles of block bases
(``angles_into``), and rows of a table from their bases and rotations (``rotate_into``).

numba compiles them once per machine (then loads them from its on-disk cache) for the host
CPU, without fast-math: every operation is one IEEE float64 multiplication or addition, in
the order written, never fused into an FMA or reassociated, so their bytes are those of the
same operations in numpy, on any CPU. Each call runs without the GIL.

numpy took two dozen passes over cache-sized parts for the angles (170 ns an element; here
7), and for the rows three passes over float64 pairs for the complex products, one more for
the columns and a Python step per few rows; here each row is computed once into a scratch
row and copied to its columns, cast on the way. A cold float32 table at d_model 4096 costs
0.15-0.25 s of CPU per GiB, 1.05 s before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal
from typing import TypeVar

import numba
import numpy as np
import numpy.typing as npt

from posenc_server import engine

_F = TypeVar("_F", bound=Callable[..., None])


def _compiled(function: _F) -> _F:
    """``function`` compiled without the GIL, and kept in numba's on-disk cache when numba
    finds a writable place for it (beside this file, ``NUMBA_CACHE_DIR``, the user's cache
    directory); where none is (an installation read-only to the server's user, without a
    home), each process compiles it at start instead of failing to import."""
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(function)  # type: ignore[return-value]
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, boundscheck=False)(function)  # type: ignore[return-value]


@_compiled
def rotate_into(
    bases: npt.NDArray[np.complex128],
    base_index: npt.NDArray[np.int64],
    rotations: npt.NDArray[np.complex128],
    rotation_index: npt.NDArray[np.int64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
    bfloat16: bool,
) -> None:
    """``out[r]`` = the columns of ``v(b) * conj(u(j)) * amplitude``, with ``v(b)`` =
    ``bases[base_index[r]]`` and ``v(j)`` = ``rotations[rotation_index[r]]`` (rows of
    ``sin + i cos``), for every row ``r`` of ``out``: float32 or float64 values, or with
    ``bfloat16`` the bits (uint16) of bfloat16 ones.

    The product's ``[sin, cos]`` pairs are ``[s C + c S, c C + s (-S)]`` for ``v(b) = s + i c``
    and ``v(j) = S + i C``; column ``k`` of ``out`` is pair value ``columns[k]`` (``2 *
    count``: zero).
    """
    row = np.zeros(2 * bases.shape[1] + 1)  # the last value stays 0: the zero columns'
    straight = _straight(columns, bfloat16)
    for r in range(out.shape[0]):
        base, rotation = bases[base_index[r]], rotations[rotation_index[r]]
        _write_row(base, rotation, columns, amplitude, out[r], row, straight, bfloat16)


@_compiled
def range_into(
    first: int,
    freq_hi: npt.NDArray[np.float64],
    freq_lo: npt.NDArray[np.float64],
    rotations: npt.NDArray[np.complex128],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
    bfloat16: bool,
) -> None:
    """``out[r]`` = the row of position ``first + r`` as ``rotate_into`` writes it, for
    every row ``r`` of ``out``: its block base ``b`` (a multiple of ``len(rotations)``)
    made here by ``angles_into`` when the range enters the block, its rotation
    ``rotations[first + r - b]``. One call for a range, where ``rotate_into`` takes its
    bases and indices made by numpy, a dozen small arrays a block."""
    block = rotations.shape[0]
    row = np.zeros(2 * freq_hi.size + 1)
    base = np.empty((1, freq_hi.size), dtype=np.complex128)
    position = np.empty(1, dtype=np.int64)
    straight = _straight(columns, bfloat16)
    for r in range(out.shape[0]):
        offset = (first + r) % block
        if r == 0 or offset == 0:
            position[0] = first + r - offset
            angles_into(position, freq_hi, freq_lo, base)
        _write_row(base[0], rotations[offset], columns, amplitude, out[r], row, straight, bfloat16)


@numba.njit(inline="always")
def _straight(columns: npt.NDArray[np.int64], bfloat16: bool) -> bool:
    """Whether each column is the row's value of its own index (the interleaved sinusoidal
    layout): the values then go straight to their columns, with no pass through a row."""
    straight = not bfloat16
    for k in range(columns.size):
        straight = straight and columns[k] == k
    return straight


@numba.njit(inline="always")
def _write_row(
    base: npt.NDArray[np.complex128],
    rotation: npt.NDArray[np.complex128],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
    row: npt.NDArray[np.float64],
    straight: bool,
    bfloat16: bool,
) -> None:
    """One row of ``rotate_into``: ``out``'s columns of ``v(b) * conj(u(j)) * amplitude``,
    through the scratch ``row`` unless ``straight``."""
    if straight:
        _rotated_columns(base, rotation, amplitude, out)
        return
    _rotated_row(base, rotation, amplitude, row)
    for k in range(columns.size):
        value = row[columns[k]]
        if bfloat16:
            out[k] = _bfloat16_bits(value)
        else:
            out[k] = value


@numba.njit(inline="always")
def _bfloat16_bits(value: float) -> int:
    """The bits of ``value`` rounded to the nearest bfloat16, ties to even (as ml_dtypes
    rounds): through float32 (rounded to nearest), then its bits, except where the first
    rounding made a tie for the second (low 16 bits exactly 0x8000 from an inexact float32):
    there the float64 value says which way."""
    single = np.float32(value)
    pattern = single.view(np.uint32)
    if pattern & 0xFFFF == 0x8000 and float(single) != value:
        # Away from zero when the float64 value is beyond the float32 tie.
        return int((pattern >> 16) + (abs(value) > abs(float(single))))
    return int((pattern + 0x7FFF + ((pattern >> 16) & 1)) >> 16)


@numba.njit(inline="always")
def _rotated_row(
    base: npt.NDArray[np.complex128],
    rotation: npt.NDArray[np.complex128],
    amplitude: float,
    row: npt.NDArray[np.float64],
) -> None:
    """``row``'s ``[sin, cos]`` pairs: ``v(b) * conj(u(j)) * amplitude`` (``rotate_into``)."""
    for i in range(base.size):
        s = base[i].real
        c = base[i].imag
        rotate_sin = rotation[i].real
        rotate_cos = rotation[i].imag
        row[2 * i] = (s * rotate_cos + c * rotate_sin) * amplitude
        row[2 * i + 1] = (c * rotate_cos + s * -rotate_sin) * amplitude


@numba.njit(inline="always")
def _rotated_columns(
    base: npt.NDArray[np.complex128],
    rotation: npt.NDArray[np.complex128],
    amplitude: float,
    out: npt.NDArray[np.generic],
) -> None:
    """``out[k]`` = value ``k`` of ``_rotated_row``'s row, for every column ``k`` of ``out``
    (the same float64 value, cast as it is stored), without the row in between."""
    pairs = min(base.size, out.size // 2)
    for i in range(pairs):
        s = base[i].real
        c = base[i].imag
        rotate_sin = rotation[i].real
        rotate_cos = rotation[i].imag
        out[2 * i] = (s * rotate_cos + c * rotate_sin) * amplitude
        out[2 * i + 1] = (c * rotate_cos + s * -rotate_sin) * amplitude
    for k in range(2 * pairs, out.size):  # an odd width's last sin, or the zero column
        i = k // 2
        if i >= base.size:
            out[k] = 0.0
            continue
        s = base[i].real
        c = base[i].imag
        rotate_sin = rotation[i].real
        rotate_cos = rotation[i].imag
        if k % 2 == 0:
            out[k] = (s * rotate_cos + c * rotate_sin) * amplitude
        else:
            out[k] = (c * rotate_cos + s * -rotate_sin) * amplitude


# The constants of the extended-precision angle (engine: TWO_PI, the Taylor coefficients).
_TWO_PI_HI = float(engine.TWO_PI)
_TWO_PI_LO = float(engine.TWO_PI - Decimal(_TWO_PI_HI))
# Veltkamp's constant 2**27 + 1 splits a float64 into two halves of at most 26 bits each,
# whose pairwise products are exact.
_SPLITTER = 134217729.0
# Taylor coefficients of sin (x**3 .. x**17) and cos (x**4 .. x**18), highest first for
# Horner's scheme: on [-pi/4, pi/4] the first term left out is below 2**-63.
_SIN_TAYLOR = tuple(reversed([(-1) ** k / math.factorial(2 * k + 1) for k in range(1, 9)]))
_COS_TAYLOR = tuple(reversed([(-1) ** k / math.factorial(2 * k) for k in range(2, 10)]))


@numba.njit(inline="always")
def _split(value: float) -> tuple[float, float]:
    """Veltkamp split: ``value == high + low`` with both halves at most 26 bits wide."""
    scaled = value * _SPLITTER
    high = scaled - (scaled - value)
    return high, value - high


_TWO_PI_SPLIT = (
    _TWO_PI_HI * _SPLITTER - (_TWO_PI_HI * _SPLITTER - _TWO_PI_HI),
    _TWO_PI_HI - (_TWO_PI_HI * _SPLITTER - (_TWO_PI_HI * _SPLITTER - _TWO_PI_HI)),
)


@_compiled
def angles_into(
    positions: npt.NDArray[np.int64],
    freq_hi: npt.NDArray[np.float64],
    freq_lo: npt.NDArray[np.float64],
    out: npt.NDArray[np.complex128],
) -> None:
    """``out[r, i]`` = ``sin(a) + i cos(a)``, ``a = 2pi * positions[r] * (freq_hi + freq_lo)[i]``
    in turns as a double-double, within about 2**-53 (the steps: ``engine``'s docstring)."""
    for r in range(positions.size):
        position = float(positions[r])
        pos_high, pos_low = _split(position)
        for i in range(freq_hi.size):
            frequency = freq_hi[i]
            freq_high, freq_low = _split(frequency)
            # Exact two-product position * freq_hi = product + product_error (Dekker).
            product = position * frequency
            product_error = pos_high * freq_high - product
            product_error += pos_high * freq_low
            product_error += pos_low * freq_high
            product_error += pos_low * freq_low
            # Dropping whole turns is exact; what is left lies in [-0.5, 0.5].
            turns = product - np.rint(product)
            correction = product_error + position * freq_lo[i]
            # Two-sum: turns + correction == turns_hi + turns_lo exactly.
            turns_hi = turns + correction
            virtual = turns_hi - turns
            turns_lo = (turns - (turns_hi - virtual)) + (correction - virtual)
            # Less the nearest quarter turn (exact: both are multiples of turns_hi's ulp),
            # within [-1/8, 1/8] turn.
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
            # Quarter turn q: (sin, cos) becomes (cos, -sin), (-sin, -cos), (-cos, sin).
            q = int(quarter) & 3
            if q & 1:
                sin, cos = cos_exact, sin_exact
            else:
                sin, cos = sin_exact, cos_exact
            sin *= float(1 - 2 * (q >> 1))
            cos *= float(1 - 2 * ((q ^ (q >> 1)) & 1))
            out[r, i] = complex(sin, cos)


@numba.njit(inline="always")
def _sin_cos_small(x: float) -> tuple[float, float]:
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
    return sin, head + cos_tail


@numba.njit(inline="always")
def _horner(z: float, coefficients: tuple[float, ...]) -> float:
    """``c0 + c1 z + c2 z**2 + ...`` of ``coefficients`` given highest first, Horner's way."""
    acc = coefficients[0]
    for coefficient in coefficients[1:]:
        acc *= z
        acc += coefficient
    return acc
