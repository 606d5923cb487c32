"""The kernel's own rounding to bfloat16 and float16: every float64 to its nearest value,
ties to even, as numpy (float16) and ml_dtypes (bfloat16) round it, whichever path a row
takes (the interleaved layout's straight store, or another layout's row of planes, copied
to its columns by runs)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from posenc_server import kernel, numerics

_FORMATS = {
    "bfloat16": (numerics.STORE_BFLOAT16, np.dtype(ml_dtypes.bfloat16), 7),
    "float16": (numerics.STORE_FLOAT16, np.dtype(np.float16), 10),
}


def _hard_values(mantissa_bits: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Values where rounding goes wrong first: exact ties of the format (odd and even),
    a float64 ulp either side of them, values whose float32 is a tie (a rounding through
    float32 rounds them twice), subnormals, zeros, the largest values and past them, and
    random values over the whole exponent range, both signs."""
    rng = np.random.default_rng(33)
    n = 4000
    kept = rng.integers(0, 1 << mantissa_bits, n)
    exponents = rng.integers(-30 if mantissa_bits == 10 else -140, 17, n)
    ties = ((2 * kept + 1) / 2.0 ** (mantissa_bits + 1) + 1.0) * 2.0**exponents
    if mantissa_bits == 10:  # float16's subnormals: ties every 2^-24, from 2^-25
        ties = np.concatenate([ties, (2 * rng.integers(0, 1024, n) + 1) * 2.0**-25])
    near = [np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)]
    # float64 values off a tie by less than half a float32 ulp: float32 rounds them onto it.
    m = ties.size
    twice = ties * (1.0 + rng.choice([-1.0, 1.0], m) * 2.0 ** rng.integers(-40, -26, m))
    powers = 2.0 ** np.array([-14, -24, -25, -26, -126, -133, -134], dtype=np.float64)
    largest = [65504.0, 65519.99, 65520.0, 1e5, 3.389e38, 3.4e38, 1e300, 5e-324]
    special = np.concatenate([[0.0], powers, largest])
    spread = rng.standard_normal(n) * 2.0 ** rng.uniform(-150, 130, n)
    values = np.concatenate([ties, *near, twice, special, spread, rng.standard_normal(n)])
    return np.concatenate([values, -values[values != 0.0]])  # the kernel's zeros are +0


def _kernel_rows(values: np.ndarray[Any, np.dtype[np.float64]], stored: int, gathered: bool) -> Any:
    """``values`` through the format's ``kernel.rotate_into`` as the columns of rows of 64
    pairs: a base ``s + ci`` rotated by ``0 + 1i`` is ``(s, c)`` exactly. The sines take
    the first half of ``values`` and the cosines the second, so that both of a pair's
    lanes meet hard values."""
    pairs = 64
    count = -(-values.size // (2 * pairs))
    padded = np.zeros(2 * count * pairs)
    padded[: values.size] = values
    bases = np.ascontiguousarray(padded.reshape(2, count, pairs).transpose(1, 0, 2))
    rotations = np.stack([np.zeros((1, pairs)), np.ones((1, pairs))], axis=1)
    columns = np.arange(2 * pairs, dtype=np.int64)
    if gathered:  # the sin columns first: not the straight layout
        columns = np.concatenate([columns[0::2], columns[1::2]])
    out = np.empty((count, 2 * pairs), dtype=np.uint16)
    base_index = np.arange(count, dtype=np.int64)
    rotation_index = np.zeros(count, dtype=np.int64)
    rotate_into = kernel.ROTATE_INTO[stored]
    rotate_into(bases, base_index, rotations, rotation_index, columns, 1.0, out)
    sines, cosines = (out[:, :pairs], out[:, pairs:]) if gathered else (out[:, 0::2], out[:, 1::2])
    return np.concatenate([sines.reshape(-1), cosines.reshape(-1)])[: values.size]


@pytest.mark.parametrize("gathered", [False, True], ids=["straight", "gathered"])
@pytest.mark.parametrize("name", list(_FORMATS))
def test_the_kernel_rounds_every_float64_to_nearest_even(name: str, gathered: bool) -> None:
    stored, dtype, mantissa_bits = _FORMATS[name]
    values = _hard_values(mantissa_bits)
    with np.errstate(over="ignore"):
        expected = values.astype(dtype).view(np.uint16)
    got = _kernel_rows(values, stored, gathered)
    wrong = np.flatnonzero(got != expected)
    assert wrong.size == 0, [(values[i], hex(got[i]), hex(expected[i])) for i in wrong[:5]]
