"""A row's values: its pairs ``(sin, cos)`` of ``v(b) * conj(u(j)) * amplitude`` from the
factors' planes (``pair``), and the row written as its values are stored in float32 or
float64: to the interleaved layout's columns (``value_columns``) or as planes
(``planar_row``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from posenc_server.kernel.jit import helper

# A row's factors as ``pair`` reads them: the base's sines and cosines, the rotation's.
Plane = npt.NDArray[np.float64]
Factors = tuple[Plane, Plane, Plane, Plane]
#: What writes a row from its factors and amplitude into an array, as the row's format
#: stores it.
RowWriter = Callable[[Factors, float, npt.NDArray[np.generic]], None]


@helper
def pair(factors: Factors, amplitude: float, i: int) -> tuple[float, float]:
    """Pair ``i`` of a row: ``(sin, cos)`` of ``v(b) * conj(u(j)) * amplitude``, from
    ``v(b) = s + i c`` and ``v(j) = S + i C``: ``[s C + c S, c C + s (-S)]``."""
    sines, cosines, turn_sines, turn_cosines = factors
    s = sines[i]
    c = cosines[i]
    rotate_sin = turn_sines[i]
    rotate_cos = turn_cosines[i]
    sin = s * rotate_cos + c * rotate_sin
    cos = c * rotate_cos + s * -rotate_sin
    if amplitude != 1.0:
        sin *= amplitude
        cos *= amplitude
    return sin, cos


@helper
def value(factors: Factors, amplitude: float, k: int) -> float:
    """Value ``k`` of a row (0 past its pairs: an odd width's zero column)."""
    if k // 2 >= factors[0].size:
        return 0.0
    sin, cos = pair(factors, amplitude, k // 2)
    return sin if k % 2 == 0 else cos


@helper
def value_columns(factors: Factors, amplitude: float, out: npt.NDArray[np.generic]) -> None:
    """``out[k]`` = value ``k`` of the row, cast as it is stored, for every column ``k``."""
    count = min(factors[0].size, out.size // 2)
    for i in range(count):
        out[2 * i], out[2 * i + 1] = pair(factors, amplitude, i)
    for k in range(2 * count, out.size):  # an odd width's last sin, or the zero column
        out[k] = value(factors, amplitude, k)


@helper
def planar_row(factors: Factors, amplitude: float, row: npt.NDArray[np.float64]) -> None:
    """``row``'s sines, then its cosines; the value after them is left as it is (the zero
    column's 0)."""
    count = factors[0].size
    sines, cosines = row[:count], row[count : 2 * count]
    for i in range(count):
        sines[i], cosines[i] = pair(factors, amplitude, i)
