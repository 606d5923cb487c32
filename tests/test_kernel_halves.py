"""The kernel's scalar rounding to bfloat16 and float16 (``kernel.halves``): a float64 to the
bits of its nearest value, ties to even, straight from the float64 (as ml_dtypes and numpy
round it); and the rows a CPU without F16C rounds with it alone, the same bits as the vector
kernel's rows."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import pytest
from test_engine_halves import _FORMATS, _hard_values

from posenc_server.kernel import halves, vector

_HALVES = {"bfloat16": halves.BFLOAT16, "float16": halves.FLOAT16}


@numba.njit
def _half_bits(values: Any, form: halves.Format) -> Any:
    out = np.empty(values.size, dtype=np.uint16)
    for i in range(values.size):
        out[i] = halves.half_bits(values[i], form)
    return out


@pytest.mark.parametrize("name", list(_HALVES))
def test_a_float64_rounds_to_the_nearest_value_ties_to_even(name: str) -> None:
    _, dtype, mantissa_bits = _FORMATS[name]
    values = np.concatenate([_hard_values(mantissa_bits), [0.0, -0.0, 1.0, -1.0]])
    with np.errstate(over="ignore"):
        expected = values.astype(dtype).view(np.uint16)
    got = _half_bits(values, _HALVES[name])
    wrong = np.flatnonzero(got != expected)
    assert wrong.size == 0, [(values[i], hex(got[i]), hex(expected[i])) for i in wrong[:5]]


@numba.njit
def _write(writer: Any, factors: Any, amplitude: float, out: Any) -> None:
    for r in range(out.shape[0]):
        writer((factors[0][r], factors[1][r], factors[2][r], factors[3][r]), amplitude, out[r])


@pytest.mark.skipif(not vector.F16C, reason="the vector kernel's rows need F16C")
@pytest.mark.parametrize("planes", [False, True], ids=["columns", "planes"])
def test_float16_rows_without_f16c_are_the_vector_kernels(planes: bool) -> None:
    """The scalar rounding alone (a CPU without F16C) and the vector kernel with it give
    every row the same bits, an odd width's last column included."""
    rng = np.random.default_rng(16)
    rows, count = 64, 45  # five steps of eight pairs and five pairs past them
    angles = rng.uniform(-np.pi, np.pi, (2, rows, count))
    factors = (np.sin(angles[0]), np.cos(angles[0]), np.sin(angles[1]), np.cos(angles[1]))
    scalar = halves.rounded_rows(
        vector.float16_to_columns,
        vector.float16_to_planes,
        halves.FLOAT16,
        "float16_scalar",
        run_pairs=32,
        vectorized=False,
    )
    width = 2 * count + 1
    for amplitude in (1.0, 0.8125):
        expected, got = np.zeros((2, rows, width), dtype=np.uint16)
        _write(halves.FLOAT16_ROWS[planes], factors, amplitude, expected)
        _write(scalar[planes], factors, amplitude, got)
        assert np.array_equal(got, expected)
