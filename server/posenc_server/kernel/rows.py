"""The loops over a call's rows, one for each stored format (``numerics.STORE_*``) and each
way a call names its rows: by index arrays (``ROTATED``) or as a range (``RANGED``).

Each row is computed once, from its factors stored as planes (the sines, then the cosines)
that the loops read as contiguous arrays: the interleaved sinusoidal layout's values go
straight to their columns; other layouts' rows go through a scratch row of planes, copied
to their columns by runs (``column_runs``: a layout's halves, sections and repeats), cast
on the way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, NamedTuple

import numba
import numpy as np
import numpy.typing as npt

from posenc_server.kernel import halves, pairs
from posenc_server.kernel.angles import angles_into
from posenc_server.kernel.jit import allocating_helper, helper, named
from posenc_server.numerics import STORE_BFLOAT16 as BFLOAT16
from posenc_server.numerics import STORE_FLOAT16 as FLOAT16
from posenc_server.numerics import STORE_VALUES as VALUES

#: Rows of factors (or one row), as planes: the sines, then the cosines.
Planes = npt.NDArray[np.float64]
#: What a call's rows are written with: the layout's runs (``column_runs``), the amplitude,
#: the rows (``out``) and a scratch row of planes (``SCRATCH``), for the layouts copied by
#: runs.
Target = tuple[npt.NDArray[np.int64], float, npt.NDArray[np.generic], npt.NDArray[np.generic]]

#: Each format's rows: straight to the interleaved layout's columns, and as planes.
_WRITERS: Final[dict[int, tuple[Callable[..., None], Callable[..., None]]]] = {
    VALUES: (pairs.value_columns, pairs.planar_row),
    BFLOAT16: halves.BFLOAT16_ROWS,
    FLOAT16: halves.FLOAT16_ROWS,
}
#: Each format's scratch row: float64 values, or the bits of rounded ones.
SCRATCH: Final[dict[int, type[np.generic]]] = {
    VALUES: np.float64,
    BFLOAT16: np.uint16,
    FLOAT16: np.uint16,
}


@allocating_helper
def column_runs(columns: npt.NDArray[np.int64], count: int) -> npt.NDArray[np.int64]:
    """The columns as runs ``[to, from, length]``: ``out[to + j]`` = ``row[from + j]`` for
    ``j < length``, with the row's values as planes (``pairs.planar_row``: the sines, the
    cosines, then the zero column's 0); none when each column is the row's value of its
    own index (the interleaved sinusoidal layout), whose values go straight to their
    columns. A layout's columns are a few runs (halves, sections, repeats), which copy in
    vector instructions where a gather of each column would not."""
    runs = np.empty((columns.size, 3), dtype=np.int64)
    straight = True
    n = 0
    for k in range(columns.size):
        value = columns[k]
        straight = straight and value == k
        source = 2 * count if value >= 2 * count else (value % 2) * count + value // 2
        if n and runs[n - 1, 0] + runs[n - 1, 2] == k and runs[n - 1, 1] + runs[n - 1, 2] == source:
            runs[n - 1, 2] += 1
        else:
            runs[n, 0], runs[n, 1], runs[n, 2] = k, source, 1
            n += 1
    return runs[:0] if straight else runs[:n]


@helper
def _copy_runs(
    row: npt.NDArray[np.generic], runs: npt.NDArray[np.int64], out: npt.NDArray[np.generic]
) -> None:
    """``out``'s columns from ``row`` by ``runs`` (``column_runs``), cast as ``out`` stores them."""
    for n in range(runs.shape[0]):
        to, source, length = runs[n, 0], runs[n, 1], runs[n, 2]
        # Slices, indexed from 0: a computed index may be negative (wrapped around) for
        # all numba knows, which keeps the loop scalar.
        target, values = out[to : to + length], row[source : source + length]
        for j in range(length):
            target[j] = values[j]


def _row_writer(stored: int) -> Callable[[Planes, Planes, Target, int], None]:
    """The writer of one row in the format ``stored``, inlined into its loops."""
    straight, planar = _WRITERS[stored]

    @numba.njit(inline="always")
    def write_row(base: Planes, rotation: Planes, target: Target, r: int) -> None:
        """Row ``r`` of the target's rows: the columns of ``v(b) * conj(u(j)) * amplitude``,
        straight to them when there are no runs, else through the scratch row of planes
        and its runs."""
        runs, amplitude, out, scratch = target
        factors = (base[0], base[1], rotation[0], rotation[1])
        if runs.shape[0] == 0:
            straight(factors, amplitude, out[r])
        else:
            planar(factors, amplitude, scratch)
            _copy_runs(scratch, runs, out[r])

    return write_row


def _row_loops(stored: int, name: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """The loops over rows of ``rotate_into`` and ``range_into`` in the format ``stored``,
    named after ``name`` (see ``jit.named``), helpers like the rows' own (see
    ``jit.helper``): in a compiled entry point each view a row takes (its factors, its
    columns) would count a reference, atomically, in and out, a fixed cost per row that
    short rows (a rotary head's) pay in full."""
    write_row = _row_writer(stored)

    def rotated(
        bases: Planes,
        base_index: npt.NDArray[np.int64],
        rotations: Planes,
        rotation_index: npt.NDArray[np.int64],
        target: Target,
    ) -> None:
        for r in range(target[2].shape[0]):
            write_row(bases[base_index[r]], rotations[rotation_index[r]], target, r)

    def ranged(
        first: int,
        freq_hi: npt.NDArray[np.float64],
        freq_lo: npt.NDArray[np.float64],
        rotations: Planes,
        target: Target,
        base: Planes,
        position: npt.NDArray[np.int64],
    ) -> None:
        block = rotations.shape[0]
        offset = first % block
        for r in range(target[2].shape[0]):
            if r == 0 or offset == 0:
                position[0] = first + r - offset
                angles_into(position, freq_hi, freq_lo, base)
            write_row(base[0], rotations[offset], target, r)
            offset += 1
            if offset == block:
                offset = 0

    return helper(named(rotated, f"rotated_{name}")), helper(named(ranged, f"ranged_{name}"))


class Formats(NamedTuple):
    """A loop in each stored format, at the index of its number (``numerics.STORE_*``): an
    entry point indexes it with its own constant ``stored``, which numba resolves as it
    compiles the entry point, so each calls its format's loop directly and is compiled
    with no other's. (A plain tuple of loops would be typed as one of function pointers.)"""

    values: Callable[..., None]
    bfloat16: Callable[..., None]
    float16: Callable[..., None]


if (VALUES, BFLOAT16, FLOAT16) != tuple(range(len(Formats._fields))):  # noqa: SIM300
    raise ImportError("Formats must hold the stored formats in the order of their numbers")
# The loops over rows named by index arrays (rotate_into's), and over a range (range_into's).
ROTATED, RANGED = (
    Formats(*loops)
    for loops in zip(*(_row_loops(*stored) for stored in enumerate(Formats._fields)), strict=True)
)
