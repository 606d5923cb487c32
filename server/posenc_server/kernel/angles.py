"""The extended-precision angles of block bases (``angles_into``): ``sin`` and ``cos`` of
``2pi * position * frequency`` for positions up to 2**42, within about 2**-53, from
float64 operations alone (double-double products and sums, Taylor polynomials)."""

from __future__ import annotations

import math
from decimal import Decimal

import numba
import numpy as np
import numpy.typing as npt

from posenc_server.kernel.jit import compiled
from posenc_server.numerics import TWO_PI

# The constants of the extended-precision angle (engine: TWO_PI, the Taylor coefficients).
_TWO_PI_HI = float(TWO_PI)
_TWO_PI_LO = float(TWO_PI - Decimal(_TWO_PI_HI))
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


@compiled
def angles_into(
    positions: npt.NDArray[np.int64],
    freq_hi: npt.NDArray[np.float64],
    freq_lo: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
) -> None:
    """``out[r, 0, i]``, ``out[r, 1, i]`` = ``sin(a)``, ``cos(a)``, with ``a = 2pi *
    positions[r] * (freq_hi + freq_lo)[i]`` in turns as a double-double, within about
    2**-53 (the steps: ``engine``'s docstring)."""
    for r in range(positions.size):
        position = float(positions[r])
        for i in range(freq_hi.size):
            turns_hi, turns_lo, quarter = _turns(position, freq_hi[i], freq_lo[i])
            angle, angle_lo = _angle(turns_hi, turns_lo)
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
            out[r, 0, i] = sin
            out[r, 1, i] = cos


@numba.njit(inline="always")
def _turns(position: float, frequency: float, frequency_lo: float) -> tuple[float, float, float]:
    """``position * (frequency + frequency_lo)`` in turns, less whole turns and the nearest
    quarter turn: a double-double ``(turns_hi, turns_lo)`` within [-1/8, 1/8] turn, and
    that quarter turn."""
    pos_high, pos_low = _split(position)
    freq_high, freq_low = _split(frequency)
    # Exact two-product position * frequency = product + product_error (Dekker).
    product = position * frequency
    product_error = pos_high * freq_high - product
    product_error += pos_high * freq_low
    product_error += pos_low * freq_high
    product_error += pos_low * freq_low
    # Dropping whole turns is exact; what is left lies in [-0.5, 0.5].
    turns = product - np.rint(product)
    correction = product_error + position * frequency_lo
    # Two-sum: turns + correction == turns_hi + turns_lo exactly.
    turns_hi = turns + correction
    virtual = turns_hi - turns
    turns_lo = (turns - (turns_hi - virtual)) + (correction - virtual)
    # Less the nearest quarter turn (exact: both are multiples of turns_hi's ulp), within
    # [-1/8, 1/8] turn.
    quarter = np.rint(turns_hi * 4.0)
    turns_hi -= quarter * 0.25
    return turns_hi, turns_lo, quarter


@numba.njit(inline="always")
def _angle(turns_hi: float, turns_lo: float) -> tuple[float, float]:
    """``(turns_hi + turns_lo) * 2pi`` as a double-double ``(angle, angle_lo)``, in
    [-pi/4, pi/4] for turns within [-1/8, 1/8]."""
    angle = turns_hi * _TWO_PI_HI
    high, low = _split(turns_hi)
    angle_lo = high * _TWO_PI_SPLIT[0] - angle
    angle_lo += high * _TWO_PI_SPLIT[1]
    angle_lo += low * _TWO_PI_SPLIT[0]
    angle_lo += low * _TWO_PI_SPLIT[1]
    angle_lo += turns_hi * _TWO_PI_LO + turns_lo * _TWO_PI_HI
    return angle, angle_lo


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
