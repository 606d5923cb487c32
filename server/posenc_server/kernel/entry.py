"""The kernel's entry points: ``rotate_into`` and ``range_into`` in each stored format
(``numerics.STORE_*``), made by one factory (``_entry_points``), by format in
``ROTATE_INTO`` and ``RANGE_INTO``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numba
import numpy as np
import numpy.typing as npt

from posenc_server.kernel import rows
from posenc_server.kernel.jit import compiled, named
from posenc_server.kernel.rows import Planes
from posenc_server.numerics import STORE_BFLOAT16 as BFLOAT16
from posenc_server.numerics import STORE_FLOAT16 as FLOAT16
from posenc_server.numerics import STORE_VALUES as VALUES

Kernel = Callable[..., None]


@numba.njit(inline="always")
def _target(
    columns: npt.NDArray[np.int64],
    count: int,
    amplitude: float,
    out: npt.NDArray[np.generic],
    scratch_type: type[np.generic],
) -> rows.Target:
    """``out``'s rows as the loops write them (``rows.Target``), with a scratch row of
    ``count`` pairs (``scratch_type``: the format's ``rows.SCRATCH``) and a last value that
    stays 0 (the zero columns')."""
    scratch = np.zeros(2 * count + 1, dtype=scratch_type)
    return rows.column_runs(columns, count), amplitude, out, scratch


def _entry_points(stored: int, suffix: str) -> tuple[Kernel, Kernel]:
    """``rotate_into`` and ``range_into`` in the format ``stored``, named with ``suffix``.
    They make the scratch arrays and hand the rows to the format's loop (``rows``), which
    runs without reference counting, as an entry point, allocating, cannot.

    ``stored`` is a constant of each: it picks its format's loop of ``rows.ROTATED`` or
    ``rows.RANGED`` as the entry point is compiled, for the arrays each is given. The
    closure holds the format's number, not its loop: numba keys a cached function by its
    closure's contents, and a compiled function's would be new in every process, so the
    cache would never be used."""
    return _rotate_entry(stored, suffix), _range_entry(stored, suffix)


def _rotate_entry(stored: int, suffix: str) -> Kernel:
    """``rotate_into`` in the format ``stored`` (``_entry_points``)."""
    scratch_type = rows.SCRATCH[stored]

    def rotate_into(
        bases: Planes,
        base_index: npt.NDArray[np.int64],
        rotations: Planes,
        rotation_index: npt.NDArray[np.int64],
        columns: npt.NDArray[np.int64],
        amplitude: float,
        out: npt.NDArray[np.generic],
    ) -> None:
        """``out[r]`` = the columns of ``v(b) * conj(u(j)) * amplitude``, with ``v(b)`` =
        ``bases[base_index[r]]`` and ``v(j)`` = ``rotations[rotation_index[r]]`` (rows of
        ``sin + i cos`` as planes: ``[2, count]`` float64, the sines then the cosines, which
        a loop reads without shuffling pairs apart), for every row ``r`` of ``out``: cast to
        ``out``'s float32 or float64, or rounded to bfloat16 or float16, whose bits a uint16
        ``out`` holds.

        The product's ``[sin, cos]`` pairs are ``[s C + c S, c C + s (-S)]`` for ``v(b) = s
        + i c`` and ``v(j) = S + i C``; column ``k`` of ``out`` is pair value ``columns[k]``
        (``2 * count``: zero)."""
        target = _target(columns, bases.shape[2], amplitude, out, scratch_type)
        rows.ROTATED[stored](bases, base_index, rotations, rotation_index, target)

    return compiled(named(rotate_into, f"rotate_into{suffix}"))


def _range_entry(stored: int, suffix: str) -> Kernel:
    """``range_into`` in the format ``stored`` (``_entry_points``)."""
    scratch_type = rows.SCRATCH[stored]

    def range_into(
        first: int,
        freq_hi: npt.NDArray[np.float64],
        freq_lo: npt.NDArray[np.float64],
        rotations: Planes,
        columns: npt.NDArray[np.int64],
        amplitude: float,
        out: npt.NDArray[np.generic],
    ) -> None:
        """``out[r]`` = the row of position ``first + r`` as ``rotate_into`` writes it, for
        every row ``r`` of ``out``: its block base ``b`` (a multiple of ``len(rotations)``)
        made here by ``angles_into`` when the range enters the block, its rotation
        ``rotations[first + r - b]``. One call for a range, where ``rotate_into`` takes its
        bases and indices made by numpy, a dozen small arrays a block."""
        target = _target(columns, freq_hi.size, amplitude, out, scratch_type)
        base, position = np.empty((1, 2, freq_hi.size)), np.empty(1, dtype=np.int64)
        rows.RANGED[stored](first, freq_hi, freq_lo, rotations, target, base, position)

    return compiled(named(range_into, f"range_into{suffix}"))


rotate_into, range_into = _entry_points(VALUES, "")
_ROTATE_BFLOAT16, _RANGE_BFLOAT16 = _entry_points(BFLOAT16, "_bfloat16")
_ROTATE_FLOAT16, _RANGE_FLOAT16 = _entry_points(FLOAT16, "_float16")

#: Each format's kernels, by ``numerics.STORE_*``.
ROTATE_INTO: Final = {VALUES: rotate_into, BFLOAT16: _ROTATE_BFLOAT16, FLOAT16: _ROTATE_FLOAT16}
RANGE_INTO: Final = {VALUES: range_into, BFLOAT16: _RANGE_BFLOAT16, FLOAT16: _RANGE_FLOAT16}
