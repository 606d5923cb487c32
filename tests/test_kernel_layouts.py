"""The kernel writes any layout's columns as the row's values would be gathered: each column
the value its index names (or the zero column's 0), in every stored format, for ranges and
for lists of positions, whichever way the kernel copies them (straight for the interleaved
layout, by runs of columns for the others)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import numpy as np
import pytest

from posenc_server import engine, numerics

_FORMATS = {
    "float32": (np.float32, numerics.STORE_VALUES),
    "float64": (np.float64, numerics.STORE_VALUES),
    "bfloat16": (np.uint16, numerics.STORE_BFLOAT16),
    "float16": (np.uint16, numerics.STORE_FLOAT16),
}


def _layouts(count: int) -> dict[str, np.ndarray[Any, np.dtype[np.int64]]]:
    values = np.arange(2 * count)
    zero = 2 * count
    rng = np.random.default_rng(count)
    return {
        "split": np.concatenate([values[0::2], values[1::2]]),
        "cosines twice": np.concatenate([values[1::2], values[1::2]]),
        "cos, sin, zero": np.concatenate([values[1::2], values[0::2], [zero]]),
        "zero, then reversed": np.concatenate([[zero], values[::-1]]),
        "odd width, pairs swapped": values.reshape(-1, 2)[:, ::-1].reshape(-1)[:-1],
        "any": rng.integers(0, zero + 1, 2 * count + 3),
    }


def _rows(
    waves: engine.Waves, columns: np.ndarray[Any, Any], dtype: Any, stored: int, *, ranged: bool
) -> np.ndarray[Any, Any]:
    positions = (
        np.arange(2**40, 2**40 + 200, dtype=np.int64)
        if ranged
        else np.array([0, 1, -7, 2**42, 123_456_789] * 8, dtype=np.int64)
    )
    out = np.empty((positions.size, columns.size), dtype=dtype)
    engine._rotate(waves, positions, columns.astype(np.int64), 0.75, out, ranged, stored)
    return out


@pytest.mark.parametrize("count", [1, 3, 64, 2048])
@pytest.mark.parametrize("ranged", [True, False], ids=["range", "list"])
@pytest.mark.parametrize("name", list(_FORMATS))
def test_every_layout_is_the_interleaved_rows_gathered(count: int, ranged: bool, name: str) -> None:
    dtype, stored = _FORMATS[name]
    waves = engine.Waves(
        [Decimal(10000) ** (Decimal(-2 * i) / (2 * count)) for i in range(count)], 0.75
    )
    interleaved = _rows(waves, np.arange(2 * count), dtype, stored, ranged=ranged)
    with_zero = np.concatenate([interleaved, np.zeros((len(interleaved), 1), dtype)], axis=1)
    for layout, columns in _layouts(count).items():
        written = _rows(waves, columns, dtype, stored, ranged=ranged)
        assert np.array_equal(written, with_zero[:, columns]), layout
