"""The engine's one compiled loop: rows of a table from their block bases and rotations.

numba compiles it once per process (or loads it from its on-disk cache) when the engine
first needs it, for the host CPU and without fast-math: every operation is one IEEE float64
multiplication or addition, in the order written, never fused into an FMA or reassociated,
so its bytes are those of the same operations in numpy, on any CPU. The whole call runs
without the GIL.

numpy took three passes over float64 pairs for the complex products, one more for the
columns, and a Python step per few rows; here each row is computed once into a scratch row
and copied to its columns, cast on the way: 3 to 4 times faster, and a stream's event loop no
longer waits for the GIL between a worker's numpy calls.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt


@numba.njit(nogil=True, cache=True, boundscheck=False)
def rotate_into(
    bases: npt.NDArray[np.complex128],
    base_index: npt.NDArray[np.int64],
    rotations: npt.NDArray[np.complex128],
    rotation_index: npt.NDArray[np.int64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.floating],
) -> None:
    """``out[r]`` = the columns of ``v(b) * conj(u(j)) * amplitude``, with ``v(b)`` =
    ``bases[base_index[r]]`` and ``v(j)`` = ``rotations[rotation_index[r]]`` (rows of
    ``sin + i cos``), for every row ``r`` of ``out``.

    The product's ``[sin, cos]`` pairs are ``[s C + c S, c C + s (-S)]`` for ``v(b) = s + i c``
    and ``v(j) = S + i C``; column ``k`` of ``out`` is pair value ``columns[k]`` (``2 *
    count``: zero).
    """
    count = bases.shape[1]
    row = np.zeros(2 * count + 1)  # the last value stays 0: the zero columns' source
    for r in range(out.shape[0]):
        base = bases[base_index[r]]
        rotation = rotations[rotation_index[r]]
        for i in range(count):
            s = base[i].real
            c = base[i].imag
            rotate_sin = rotation[i].real
            rotate_cos = rotation[i].imag
            row[2 * i] = (s * rotate_cos + c * rotate_sin) * amplitude
            row[2 * i + 1] = (c * rotate_cos + s * -rotate_sin) * amplitude
        for k in range(columns.size):
            out[r, k] = row[columns[k]]
