"""The kernel's vector kernels (``kernel.vector``): eight pairs of a row a step, rounded to
bfloat16 or float16 and stored as pairs or as planes; every value they do not report as a
doubt is the nearest value to the float64, ties to even, and every value they may have got
wrong is reported."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numba
import numpy as np
import pytest

from posenc_server.kernel import vector
from posenc_server.kernel.vector import LANES

_F16C = pytest.mark.skipif(not vector.F16C, reason="float16's kernels need F16C")
_KERNELS = [
    pytest.param(np.dtype(ml_dtypes.bfloat16), vector.bfloat16_to_columns, False, id="bfloat16"),
    pytest.param(np.dtype(ml_dtypes.bfloat16), vector.bfloat16_to_planes, True, id="bfloat16-p"),
    pytest.param(np.float16, vector.float16_to_columns, False, id="float16", marks=_F16C),
    pytest.param(np.float16, vector.float16_to_planes, True, id="float16-p", marks=_F16C),
]

Array = np.ndarray[Any, Any]


@functools.cache
def _caller(kernel: Callable[..., int]) -> Callable[..., int]:
    """``kernel`` as Python calls it (an intrinsic is called from compiled code alone)."""

    @numba.njit
    def call(factors: Any, amplitude: float, out: Any, first: int, stop: int, count: int) -> int:
        sines, cosines, turn_sines, turn_cosines = factors
        return kernel(sines, cosines, turn_sines, turn_cosines, amplitude, out, first, stop, count)

    return call  # type: ignore[no-any-return]


def _pairs(factors: tuple[Array, ...], amplitude: float) -> tuple[Array, Array]:
    """The row's sines and cosines as ``pairs.pair`` computes them, in numpy."""
    s, c, turn_s, turn_c = factors
    sin, cos = s * turn_c + c * turn_s, c * turn_c + s * -turn_s
    return (sin * amplitude, cos * amplitude) if amplitude != 1.0 else (sin, cos)


def _stored(out: Array, count: int, planes: bool) -> tuple[Array, Array]:
    """The sines and the cosines a kernel stored in ``out``."""
    return (out[:count], out[count:]) if planes else (out[0::2], out[1::2])


def _run(
    kernel: Callable[..., int], factors: tuple[Array, ...], amplitude: float
) -> tuple[Array, list[int]]:
    """``out`` (the row) and each step's mask, a kernel call a step."""
    count = factors[0].size
    out = np.zeros(2 * count, dtype=np.uint16)
    masks = [
        _caller(kernel)(factors, amplitude, out, first, first + LANES, count)
        for first in range(0, count, LANES)
    ]
    return out, masks


@pytest.mark.parametrize(("dtype", "kernel", "planes"), _KERNELS)
@pytest.mark.parametrize("amplitude", [1.0, 0.8125])
def test_values_not_reported_are_rounded_to_nearest_even(
    dtype: Any, kernel: Callable[..., int], planes: bool, amplitude: float
) -> None:
    rng = np.random.default_rng(8)
    count = 40 * LANES
    angles = rng.uniform(-np.pi, np.pi, (2, count))
    factors = (np.sin(angles[0]), np.cos(angles[0]), np.sin(angles[1]), np.cos(angles[1]))
    out, masks = _run(kernel, factors, amplitude)
    doubts = np.array([[mask >> lane & 1 for lane in range(2 * LANES)] for mask in masks])
    for plane, (values, stored) in enumerate(
        zip(_pairs(factors, amplitude), _stored(out, count, planes), strict=True)
    ):
        sure = doubts[:, plane * LANES : (plane + 1) * LANES].reshape(-1) == 0
        expected = values.astype(dtype).view(np.uint16)
        assert np.array_equal(stored[sure], expected[sure])
    assert doubts.mean() < 0.01  # doubts are rare: a whole run is done again for one


@pytest.mark.parametrize(("dtype", "kernel", "planes"), _KERNELS)
def test_a_value_rounded_through_a_float32_tie_is_reported(
    dtype: Any, kernel: Callable[..., int], planes: bool
) -> None:
    """A float64 just off a tie of the format whose float32 is the tie itself: rounding
    through float32 can round it the wrong way, so its lane (and that lane alone) is in
    the mask, in the step it falls in."""
    tie = 1.0 + 2.0 ** -(11 if dtype == np.float16 else 8)  # between 1 and its next value
    count = 3 * LANES
    sines, cosines = np.full(count, 0.3), np.full(count, 0.7)  # whose float32s are no doubt
    lane, step = 5, 2
    cosines[step * LANES + lane] = np.nextafter(tie, 0.0)
    factors = (sines, cosines, np.zeros(count), np.ones(count))  # rotated by 0 + 1i: as they are
    _, masks = _run(kernel, factors, 1.0)
    assert masks == [0, 0, 1 << (LANES + lane)]
    out = np.zeros(2 * count, dtype=np.uint16)  # a call of many steps: their masks at once
    assert _caller(kernel)(factors, 1.0, out, 0, count, count) == 1 << (LANES + lane)
