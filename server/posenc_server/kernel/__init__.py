"""The engine's compiled loops: the extended-precision angles of block bases
(``angles_into``), and rows of a table from their bases and rotations (``rotate_into``, and
``range_into`` for a range of positions), in each stored format (``ROTATE_INTO``,
``RANGE_INTO``, by ``numerics.STORE_*``).

numba compiles them once per machine (then loads them from its on-disk cache) for the host
CPU, without fast-math: every operation is one IEEE float64 multiplication or addition, in
the order written, never fused into an FMA or reassociated, so their bytes are those of the
same operations in numpy, on any CPU. Each call runs without the GIL.

The package's rooms: ``entry`` (the entry points, one factory for every format), ``rows``
(the loops over a call's rows, and the runs that copy a row to its layout's columns),
``pairs`` (a row's values), ``halves`` (rounding to bfloat16 and float16), ``vector`` (the
vector kernels, in LLVM's IR, that round eight pairs at a time), ``angles`` (the block
bases) and ``jit`` (how each is compiled and cached).
"""

from posenc_server.kernel.angles import angles_into
from posenc_server.kernel.entry import RANGE_INTO, ROTATE_INTO, range_into, rotate_into

__all__ = ["RANGE_INTO", "ROTATE_INTO", "angles_into", "range_into", "rotate_into"]
