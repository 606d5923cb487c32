"""Rounding to bfloat16 and float16: a float64 to the bits of its nearest value, ties to
even (``half_bits``), and a row's values rounded so (``BFLOAT16_ROWS``, ``FLOAT16_ROWS``):
eight pairs at a time by a vector kernel (``vector``), which rounds through float32 and
says which values that may have got wrong; those, and the few values past a row's last
eight pairs, by ``half_bits``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from posenc_server.kernel import pairs, vector
from posenc_server.kernel.jit import helper, named
from posenc_server.kernel.pairs import Factors, RowWriter
from posenc_server.kernel.vector import LANES

#: A half-precision format, for ``half_bits``: the float64 bits its rounding drops (52 less
#: its mantissa's), its exponent's bias less float64's (at the exponent's place), its
#: smallest normal value, a float64 whose ulp is its smallest subnormal and that float64's
#: bits, and its infinity's bits.
Format = tuple[int, int, float, float, int, int]


def _bits(value: float) -> int:
    return int(np.float64(value).view(np.int64))


BFLOAT16: Final[Format] = (45, (1023 - 127) << 7, 2.0**-126, 2.0**-81, _bits(2.0**-81), 0x7F80)
FLOAT16: Final[Format] = (42, (1023 - 15) << 10, 2.0**-14, 2.0**28, _bits(2.0**28), 0x7C00)

#: Pairs a call of a vector kernel (``_rounded_row``): a run of steps with nothing but
#: vector operations in it, checked once for values it may have rounded wrong. A run with
#: one is done again; float16's doubts are sixteen times as common as bfloat16's ties.
_BFLOAT16_RUN: Final = 128
_FLOAT16_RUN: Final = 32


@helper
def half_bits(value: float, form: Format) -> int:
    """The bits of ``value`` rounded to the nearest value of the half-precision format
    ``form``, ties to even (as numpy and ml_dtypes round a float64), straight from the
    float64: not through float32, whose rounding can make a tie of a value that is not one.
    (Callers unpack ``form`` outside their loops: a global tuple read in a loop keeps it
    scalar.)

    Branch-free, so that a loop of it runs in vector instructions: both the normal and the
    subnormal rounding are computed, and the magnitude picks one. Normal: the float64's bits
    plus half an ulp of the format less one, plus the last kept bit (ties to even), then
    the dropped bits shifted away; a carry into the exponent is right, and anything past the
    largest finite value becomes infinity (``min``). Subnormal (and zero): the magnitude
    added to a float64 whose ulp is the format's smallest subnormal, which the addition
    rounds to; its bits less that float64's count those subnormals. Values are finite here
    (finite factors, sin and cos within 1)."""
    shift, rebias, smallest, magic, magic_bits, infinity = form
    magnitude = np.float64(abs(value))
    pattern = int(magnitude.view(np.int64))
    normal = ((pattern + ((1 << (shift - 1)) - 1) + ((pattern >> shift) & 1)) >> shift) - rebias
    subnormal = int(np.float64(magnitude + magic).view(np.int64)) - magic_bits
    bits = min(normal, infinity) if magnitude >= smallest else subnormal
    return bits | ((int(np.float64(value).view(np.int64)) >> 48) & 0x8000)


@helper
def _rounded_values(
    factors: Factors,
    amplitude: float,
    out: npt.NDArray[np.generic],
    first: int,
    count: int,
    step: int,
    plane: int,
    form: Format,
) -> None:
    """Pairs ``first`` to ``count`` (the few a vector kernel's steps leave) rounded to the
    format ``form`` one value at a time, straight from the float64 (``half_bits``): pair
    ``i``'s sine at ``out[i * step]``, its cosine ``plane`` further."""
    for i in range(first, count):
        sin, cos = pairs.pair(factors, amplitude, i)
        out[i * step] = half_bits(sin, form)
        out[i * step + plane] = half_bits(cos, form)


@helper
def _round_again(
    factors: Factors,
    amplitude: float,
    out: npt.NDArray[np.generic],
    first: int,
    mask: int,
    form: Format,
    step: int,
    plane: int,
) -> None:
    """The values of a vector kernel's ``mask`` of one step (bit ``k``: pair ``first + k``'s
    sine, ``LANES + k``: its cosine), placed as ``_rounded_values`` places them, rounded to
    the format ``form`` straight from the float64 (``half_bits``)."""
    for lane in range(2 * LANES):
        if mask >> lane & 1:
            i, cosine = first + lane % LANES, lane // LANES
            sin_or_cos = pairs.pair(factors, amplitude, i)[cosine]
            out[i * step + cosine * plane] = half_bits(sin_or_cos, form)


def _rounded_row(
    kernel: Callable[..., int],
    form: Format,
    name: str,
    *,
    planes: bool,
    run_pairs: int,
    vectorized: bool = True,
) -> RowWriter:
    """A row's values rounded to the format ``form`` by the vector kernel ``kernel``
    (``vector``) and the scalar rounding of the values it leaves (``half_bits``):
    ``out[k]`` = the bits of value ``k``, every column ``k`` (the interleaved layout), or
    the row's values as ``planes`` (the sines, then the cosines; the value after them left
    as it is: the zero column's 0), for the layouts copied by runs (``rows``).

    The kernel takes ``run_pairs`` pairs a call and tells whether any value of them may be
    rounded wrong (one in 65536 for bfloat16, 4096 for float16); such a run goes through it
    again a step at a time, which gives each step's mask of those values, rounded again
    exactly (``_round_again``). Not ``vectorized`` (float16 without F16C), rows take the
    scalar rounding alone: numba leaves the constant branch out, and the kernel uncompiled.
    The row's helper is named ``name`` (see ``jit.named``)."""

    def rounded(factors: Factors, amplitude: float, out: npt.NDArray[np.generic]) -> None:
        count = factors[0].size if planes else min(factors[0].size, out.size // 2)
        step, plane = (1, count) if planes else (2, 1)
        vectors = 0
        if vectorized:
            vectors = count - count % LANES
            for start in range(0, vectors, run_pairs):
                stop = min(start + run_pairs, vectors)
                if kernel(*factors, amplitude, out, start, stop, count):
                    for first in range(start, stop, LANES):
                        mask = kernel(*factors, amplitude, out, first, first + LANES, count)
                        if mask:
                            _round_again(factors, amplitude, out, first, mask, form, step, plane)
        _rounded_values(factors, amplitude, out, vectors, count, step, plane, form)
        if not planes:
            for k in range(2 * count, out.size):  # an odd width's last sin, or the zero column
                out[k] = half_bits(pairs.value(factors, amplitude, k), form)

    return helper(named(rounded, name))


def rounded_rows(
    to_columns: Callable[..., int],
    to_planes: Callable[..., int],
    form: Format,
    name: str,
    *,
    run_pairs: int,
    vectorized: bool = True,
) -> tuple[RowWriter, RowWriter]:
    """A format's rows (``_rounded_row``): straight to the interleaved layout's columns by
    the vector kernel ``to_columns``, and as planes by ``to_planes``; their helpers named
    after ``name``, which no other rows may take."""
    columns, planes = (
        _rounded_row(
            kernel,
            form,
            f"{name}_{kind}",
            planes=kind == "planes",
            run_pairs=run_pairs,
            vectorized=vectorized,
        )
        for kernel, kind in ((to_columns, "columns"), (to_planes, "planes"))
    )
    return columns, planes


#: Each format's rows: straight to the interleaved layout's columns, and as planes for the
#: layouts copied by runs.
BFLOAT16_ROWS: Final = rounded_rows(
    vector.bfloat16_to_columns,
    vector.bfloat16_to_planes,
    BFLOAT16,
    "bfloat16",
    run_pairs=_BFLOAT16_RUN,
)
FLOAT16_ROWS: Final = rounded_rows(
    vector.float16_to_columns,
    vector.float16_to_planes,
    FLOAT16,
    "float16",
    run_pairs=_FLOAT16_RUN,
    vectorized=vector.F16C,
)
