"""The engine's compiled loops: the extended-precision angles of block bases
(``angles_into``), and rows of a table from their bases and rotations (``rotate_into``).

numba compiles them once per machine (then loads them from its on-disk cache) for the host
CPU, without fast-math: every operation is one IEEE float64 multiplication or addition, in
the order written, never fused into an FMA or reassociated, so their bytes are those of the
same operations in numpy, on any CPU. Each call runs without the GIL.

Each row is computed once, from factors stored as planes (the sines, then the cosines) that
the loops read as contiguous arrays: the interleaved sinusoidal layout's values go straight
to their columns; other layouts' rows go through a scratch row of planes, copied to their
columns by runs (``_runs``: a layout's halves, sections and repeats), cast on the way.

bfloat16 and float16 values are rounded in the same loops, to their bits, with integer and
float operations: eight pairs at a time by vector code written in LLVM's IR
(``_vector_kernel``), which rounds as many values an instruction as float32 rows store,
straight to the interleaved layout's columns or to the scratch row of the others; the few
values a row has beyond its last eight pairs by ``_half_bits``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Final, TypeVar

import llvmlite.binding  # type: ignore[import-untyped]
import numba
import numba.core.config
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from posenc_server.numerics import STORE_BFLOAT16 as BFLOAT16
from posenc_server.numerics import STORE_FLOAT16 as FLOAT16
from posenc_server.numerics import STORE_VALUES as VALUES
from posenc_server.numerics import TWO_PI

_F = TypeVar("_F", bound=Callable[..., None])
_G = TypeVar("_G", bound=Callable[..., object])


def _compiled(function: _F) -> _F:
    """``function`` compiled without the GIL, and kept in numba's on-disk cache when numba
    finds a writable place for it (beside this file, ``NUMBA_CACHE_DIR``, the user's cache
    directory); where none is (an installation read-only to the server's user, without a
    home), each process compiles it at start instead of failing to import."""
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(function)  # type: ignore[return-value]
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, boundscheck=False)(function)  # type: ignore[return-value]


def _intrinsic(typing: Callable[..., object]) -> Callable[..., Any]:
    """numba's ``intrinsic`` (LLVM IR the loops call, typed by ``typing``), typed as what
    those loops call."""
    return intrinsic(typing)


def _helper(function: _G) -> _G:
    """A loop's helper, compiled once per argument types and inlined where it is called by
    LLVM: numba's own inlining (``inline="always"``) types and lowers it again at every call
    site, which made the kernels take several times as long to compile.

    Without numba's reference counting (a helper allocates nothing; its caller holds its
    arrays): where LLVM does not inline a helper (one that rounds half precision, with its
    rarely taken path of exact rounding), each call would count a reference to every array
    it is given, atomically, in and out: a fixed cost per row, which short rows (a rotary
    head's) would pay in full."""
    return numba.njit(_nrt=False)(function)  # type: ignore[call-overload,no-any-return]


def _allocating_helper(function: _G) -> _G:
    """A helper that allocates arrays (so with numba's reference counting)."""
    return numba.njit(function)  # type: ignore[no-any-return]


@_compiled
def rotate_into(
    bases: npt.NDArray[np.float64],
    base_index: npt.NDArray[np.int64],
    rotations: npt.NDArray[np.float64],
    rotation_index: npt.NDArray[np.int64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
) -> None:
    """``out[r]`` = the columns of ``v(b) * conj(u(j)) * amplitude``, with ``v(b)`` =
    ``bases[base_index[r]]`` and ``v(j)`` = ``rotations[rotation_index[r]]`` (rows of
    ``sin + i cos`` as planes: ``[2, count]`` float64, the sines then the cosines, which a
    loop reads without shuffling pairs apart), for every row ``r`` of ``out``, cast to
    ``out``'s float32 or float64.
    ``rotate_into_bfloat16`` and ``rotate_into_float16`` round them to that format instead,
    whose bits a uint16 ``out`` holds: each format a function of its own, so that numba
    compiles each one's loops only for the arrays it is given.

    The product's ``[sin, cos]`` pairs are ``[s C + c S, c C + s (-S)]`` for ``v(b) = s + i c``
    and ``v(j) = S + i C``; column ``k`` of ``out`` is pair value ``columns[k]`` (``2 *
    count``: zero).
    """
    _rotate_rows(bases, base_index, rotations, rotation_index, columns, amplitude, out, VALUES)


@_compiled
def rotate_into_bfloat16(
    bases: npt.NDArray[np.float64],
    base_index: npt.NDArray[np.int64],
    rotations: npt.NDArray[np.float64],
    rotation_index: npt.NDArray[np.int64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
) -> None:
    """``rotate_into``, rounded to bfloat16."""
    _rotate_rows(bases, base_index, rotations, rotation_index, columns, amplitude, out, BFLOAT16)


@_compiled
def rotate_into_float16(
    bases: npt.NDArray[np.float64],
    base_index: npt.NDArray[np.int64],
    rotations: npt.NDArray[np.float64],
    rotation_index: npt.NDArray[np.int64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
) -> None:
    """``rotate_into``, rounded to float16."""
    _rotate_rows(bases, base_index, rotations, rotation_index, columns, amplitude, out, FLOAT16)


@numba.njit(inline="always")
def _rotate_rows(
    bases: npt.NDArray[np.float64],
    base_index: npt.NDArray[np.int64],
    rotations: npt.NDArray[np.float64],
    rotation_index: npt.NDArray[np.int64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
    stored: int,
) -> None:
    """``rotate_into`` in the format ``stored`` (a constant where it is inlined): the scratch
    arrays made here, the rows written by that format's loop (``_row_loops``)."""
    row = np.zeros(2 * bases.shape[2] + 1)  # the last value stays 0: the zero columns'
    halves = np.zeros(row.size, dtype=np.uint16)
    runs = _runs(columns, bases.shape[2])
    arguments = (bases, base_index, rotations, rotation_index, runs, amplitude, out, row, halves)
    if stored == BFLOAT16:
        _rotated_bfloat16(*arguments)
    elif stored == FLOAT16:
        _rotated_float16(*arguments)
    else:
        _rotated_values(*arguments)


@_compiled
def range_into(
    first: int,
    freq_hi: npt.NDArray[np.float64],
    freq_lo: npt.NDArray[np.float64],
    rotations: npt.NDArray[np.float64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
) -> None:
    """``out[r]`` = the row of position ``first + r`` as ``rotate_into`` writes it, for
    every row ``r`` of ``out``: its block base ``b`` (a multiple of ``len(rotations)``)
    made here by ``angles_into`` when the range enters the block, its rotation
    ``rotations[first + r - b]``. One call for a range, where ``rotate_into`` takes its
    bases and indices made by numpy, a dozen small arrays a block."""
    _range_rows(first, freq_hi, freq_lo, rotations, columns, amplitude, out, VALUES)


@_compiled
def range_into_bfloat16(
    first: int,
    freq_hi: npt.NDArray[np.float64],
    freq_lo: npt.NDArray[np.float64],
    rotations: npt.NDArray[np.float64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
) -> None:
    """``range_into``, rounded to bfloat16."""
    _range_rows(first, freq_hi, freq_lo, rotations, columns, amplitude, out, BFLOAT16)


@_compiled
def range_into_float16(
    first: int,
    freq_hi: npt.NDArray[np.float64],
    freq_lo: npt.NDArray[np.float64],
    rotations: npt.NDArray[np.float64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
) -> None:
    """``range_into``, rounded to float16."""
    _range_rows(first, freq_hi, freq_lo, rotations, columns, amplitude, out, FLOAT16)


@numba.njit(inline="always")
def _range_rows(
    first: int,
    freq_hi: npt.NDArray[np.float64],
    freq_lo: npt.NDArray[np.float64],
    rotations: npt.NDArray[np.float64],
    columns: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
    stored: int,
) -> None:
    """``range_into`` in the format ``stored`` (a constant where it is inlined): the scratch
    arrays made here, the rows written by that format's loop (``_row_loops``)."""
    row = np.zeros(2 * freq_hi.size + 1)
    halves = np.zeros(row.size, dtype=np.uint16)
    base = np.empty((1, 2, freq_hi.size))
    position = np.empty(1, dtype=np.int64)
    runs = _runs(columns, freq_hi.size)
    arguments = (
        first,
        freq_hi,
        freq_lo,
        rotations,
        runs,
        amplitude,
        out,
        row,
        halves,
        base,
        position,
    )
    if stored == BFLOAT16:
        _ranged_bfloat16(*arguments)
    elif stored == FLOAT16:
        _ranged_float16(*arguments)
    else:
        _ranged_values(*arguments)


def _row_loops(stored: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """The loops over rows of ``rotate_into`` and ``range_into`` in the format ``stored``
    (a constant of each loop), helpers like the rows' own (see ``_helper``): in a compiled
    entry point each view a row takes (its factors, its columns) would count a reference,
    atomically, in and out, a fixed cost per row that short rows (a rotary head's) pay in
    full."""

    @_helper
    def rotated(
        bases: npt.NDArray[np.float64],
        base_index: npt.NDArray[np.int64],
        rotations: npt.NDArray[np.float64],
        rotation_index: npt.NDArray[np.int64],
        runs: npt.NDArray[np.int64],
        amplitude: float,
        out: npt.NDArray[np.generic],
        row: npt.NDArray[np.float64],
        halves: npt.NDArray[np.uint16],
    ) -> None:
        for r in range(out.shape[0]):
            base, rotation = bases[base_index[r]], rotations[rotation_index[r]]
            _write_row(base, rotation, runs, amplitude, out[r], row, halves, stored)

    @_helper
    def ranged(
        first: int,
        freq_hi: npt.NDArray[np.float64],
        freq_lo: npt.NDArray[np.float64],
        rotations: npt.NDArray[np.float64],
        runs: npt.NDArray[np.int64],
        amplitude: float,
        out: npt.NDArray[np.generic],
        row: npt.NDArray[np.float64],
        halves: npt.NDArray[np.uint16],
        base: npt.NDArray[np.float64],
        position: npt.NDArray[np.int64],
    ) -> None:
        block = rotations.shape[0]
        offset = first % block
        for r in range(out.shape[0]):
            if r == 0 or offset == 0:
                position[0] = first + r - offset
                angles_into(position, freq_hi, freq_lo, base)
            _write_row(base[0], rotations[offset], runs, amplitude, out[r], row, halves, stored)
            offset += 1
            if offset == block:
                offset = 0

    return rotated, ranged


@_allocating_helper
def _runs(columns: npt.NDArray[np.int64], count: int) -> npt.NDArray[np.int64]:
    """The columns as runs ``[to, from, length]``: ``out[to + j]`` = ``row[from + j]`` for
    ``j < length``, with the row's values as planes (``_planar_row``: the sines, the
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


@numba.njit(inline="always")
def _write_row(
    base: npt.NDArray[np.float64],
    rotation: npt.NDArray[np.float64],
    runs: npt.NDArray[np.int64],
    amplitude: float,
    out: npt.NDArray[np.generic],
    row: npt.NDArray[np.float64],
    halves: npt.NDArray[np.uint16],
    stored: int,
) -> None:
    """One row of ``rotate_into``: ``out``'s columns of ``v(b) * conj(u(j)) * amplitude``,
    stored as ``stored`` says: straight to the columns when there are no ``runs``, else
    through the scratch ``row`` (and, rounded, ``halves``) and its runs. Each format has a
    loop of its own, which runs in vector instructions: the factors' planes are read as
    four arrays, one value of each a pair."""
    factors = (base[0], base[1], rotation[0], rotation[1])
    if runs.shape[0] == 0:
        if stored == BFLOAT16:
            _bfloat16_columns(factors, amplitude, out)
        elif stored == FLOAT16:
            _float16_columns(factors, amplitude, out)
        else:
            _value_columns(factors, amplitude, out)
        return
    if stored == VALUES:
        _planar_row(factors, amplitude, row)
        _copy_runs(row, runs, out)
        return
    if stored == BFLOAT16:
        _bfloat16_planes(factors, amplitude, halves)
    else:
        _float16_planes(factors, amplitude, halves)
    _copy_runs(halves, runs, out)


@_helper
def _copy_runs(
    row: npt.NDArray[np.generic], runs: npt.NDArray[np.int64], out: npt.NDArray[np.generic]
) -> None:
    """``out``'s columns from ``row`` by ``runs`` (``_runs``), cast as ``out`` stores them."""
    for n in range(runs.shape[0]):
        to, source, length = runs[n, 0], runs[n, 1], runs[n, 2]
        # Slices, indexed from 0: a computed index may be negative (wrapped around) for
        # all numba knows, which keeps the loop scalar.
        target, values = out[to : to + length], row[source : source + length]
        for j in range(length):
            target[j] = values[j]


# A row's factors as ``_pair`` reads them: the base's sines and cosines, the rotation's.
_Plane = npt.NDArray[np.float64]
_Factors = tuple[_Plane, _Plane, _Plane, _Plane]


@_helper
def _pair(factors: _Factors, amplitude: float, i: int) -> tuple[float, float]:
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


@_helper
def _value(factors: _Factors, amplitude: float, k: int) -> float:
    """Value ``k`` of a row (0 past its pairs: an odd width's zero column)."""
    if k // 2 >= factors[0].size:
        return 0.0
    sin, cos = _pair(factors, amplitude, k // 2)
    return sin if k % 2 == 0 else cos


@_helper
def _value_columns(factors: _Factors, amplitude: float, out: npt.NDArray[np.generic]) -> None:
    """``out[k]`` = value ``k`` of the row, cast as it is stored, for every column ``k``."""
    count = min(factors[0].size, out.size // 2)
    for i in range(count):
        out[2 * i], out[2 * i + 1] = _pair(factors, amplitude, i)
    for k in range(2 * count, out.size):  # an odd width's last sin, or the zero column
        out[k] = _value(factors, amplitude, k)


@_helper
def _rounded_values(
    factors: _Factors,
    amplitude: float,
    out: npt.NDArray[np.generic],
    first: int,
    count: int,
    step: int,
    plane: int,
    form: tuple[int, int, float, float, int, int],
) -> None:
    """Pairs ``first`` to ``count`` (the few a vector kernel's steps leave) rounded to the
    format ``form`` one value at a time, straight from the float64 (``_half_bits``): pair
    ``i``'s sine at ``out[i * step]``, its cosine ``plane`` further."""
    for i in range(first, count):
        sin, cos = _pair(factors, amplitude, i)
        out[i * step] = _half_bits(sin, form)
        out[i * step + plane] = _half_bits(cos, form)


@_helper
def _round_again(
    factors: _Factors,
    amplitude: float,
    out: npt.NDArray[np.generic],
    first: int,
    mask: int,
    form: tuple[int, int, float, float, int, int],
    step: int,
    plane: int,
) -> None:
    """The values of a vector kernel's ``mask`` of one step (bit ``k``: pair ``first + k``'s
    sine, ``_LANES + k``: its cosine), placed as ``_rounded_values`` places them, rounded to
    the format ``form`` straight from the float64 (``_half_bits``)."""
    for lane in range(2 * _LANES):
        if mask >> lane & 1:
            i, cosine = first + lane % _LANES, lane // _LANES
            out[i * step + cosine * plane] = _half_bits(_pair(factors, amplitude, i)[cosine], form)


def _rounded_row(
    kernel: Callable[..., int],
    form: tuple[int, int, float, float, int, int],
    *,
    planes: bool,
    run_pairs: int,
    vectorized: bool = True,
) -> Callable[[_Factors, float, npt.NDArray[np.generic]], None]:
    """A row's values rounded to the format ``form`` by the vector kernel ``kernel``
    (``_vector_kernel``) and the scalar rounding of the values it leaves (``_half_bits``):
    ``out[k]`` = the bits of value ``k``, every column ``k`` (the interleaved layout), or
    the row's values as ``planes`` (the sines, then the cosines; the value after them left
    as it is: the zero column's 0), for the layouts copied by runs (``_copy_runs``).

    The kernel takes ``run_pairs`` pairs a call and tells whether any value of them may be
    rounded wrong (one in 65536 for bfloat16, 4096 for float16); such a run goes through it
    again a step at a time, which gives each step's mask of those values, rounded again
    exactly (``_round_again``). Not ``vectorized`` (float16 without F16C), rows take the
    scalar rounding alone: numba leaves the constant branch out, and the kernel uncompiled."""

    @_helper
    def rounded(factors: _Factors, amplitude: float, out: npt.NDArray[np.generic]) -> None:
        count = factors[0].size if planes else min(factors[0].size, out.size // 2)
        step, plane = (1, count) if planes else (2, 1)
        vectors = 0
        if vectorized:
            vectors = count - count % _LANES
            for start in range(0, vectors, run_pairs):
                stop = min(start + run_pairs, vectors)
                if kernel(*factors, amplitude, out, start, stop, count):
                    for first in range(start, stop, _LANES):
                        mask = kernel(*factors, amplitude, out, first, first + _LANES, count)
                        if mask:
                            _round_again(factors, amplitude, out, first, mask, form, step, plane)
        _rounded_values(factors, amplitude, out, vectors, count, step, plane, form)
        if not planes:
            for k in range(2 * count, out.size):  # an odd width's last sin, or the zero column
                out[k] = _half_bits(_value(factors, amplitude, k), form)

    return rounded


#: Pairs a step of the vector kernels: eight, whose sines and cosines each fill a 256-bit
#: vector of 32-bit values.
_LANES: Final = 8
#: Pairs a call of a vector kernel (``_rounded_row``): a run of steps with nothing but
#: vector operations in it, checked once for values it may have rounded wrong. A run with
#: one is done again; float16's doubts are sixteen times as common as bfloat16's ties.
_BFLOAT16_RUN: Final = 128
_FLOAT16_RUN: Final = 32
_WORDS: Final = ir.VectorType(ir.IntType(32), _LANES)
_SINGLES: Final = ir.VectorType(ir.FloatType(), _LANES)
_HALVES: Final = ir.VectorType(ir.IntType(16), _LANES)
_HIGH_HALVES: Final = ir.Constant(_WORDS, [2 * k + 1 for k in range(_LANES)])
_F16C_CONVERSION: Final = ir.FunctionType(_HALVES, [_SINGLES, ir.IntType(32)])


def _splat(vector: ir.VectorType, value: int) -> ir.Constant:
    return ir.Constant(vector, [value] * _LANES)


def _vector_kernel(name: str, rounding: Callable[..., Any], planes: bool) -> Callable[..., Any]:
    """A vector kernel: pairs ``first`` to ``stop`` (a multiple of ``_LANES`` more) of a row
    as ``_pair`` makes them (the same IEEE operations in its order: the same bits), rounded
    by ``rounding`` and stored in ``out`` (uint16) as pairs (``out[2 * first]`` on: the
    interleaved layout's columns) or as ``planes`` (the sines from ``out[first]``, the
    cosines from ``out[count + first]``: the scratch row the other layouts' runs copy from).
    Returns the mask of the values it may have rounded wrong, of all its steps at once (bit
    ``k``: some step's ``k``-th sine, ``_LANES + k``: its ``k``-th cosine), so exact for a
    call of one step.

    A loop of one value at a time gets four 32-bit lanes a vector instruction at most: the
    float64 products come four to a vector, the sines and the cosines in two. Here eight
    sines are one vector and eight cosines another, rounded eight lanes at a time. Each step
    folds its doubts into two vectors (the least of ``rounding``'s low bits, unsigned), read
    once, at the end: no step leaves the vector unit or branches. The loop comes twice,
    with and without the amplitude's products (left out by an amplitude of 1, as ``_pair``
    leaves them). Contiguous arrays only (the engine's), which it reads and writes as
    vectors: numba refuses to compile it for others."""

    def typing(
        typingctx: object,
        sines: types.Type,
        cosines: types.Type,
        turn_sines: types.Type,
        turn_cosines: types.Type,
        amplitude: types.Type,
        out: types.Type,
        first: types.Type,
        stop: types.Type,
        count: types.Type,
    ) -> object:
        arrays = (sines, cosines, turn_sines, turn_cosines, out)
        if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays):
            return None
        signature = types.uint16(*arrays[:4], types.float64, out, *(types.intp,) * 3)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[Any]) -> Any:
            data = [
                context.make_array(signature.args[k])(context, builder, args[k]).data
                for k in (0, 1, 2, 3, 5)
            ]

            def at(k: int, index: Any, vector: ir.Type) -> Any:  # vector at array k's index
                return builder.bitcast(builder.gep(data[k], [index]), vector.as_pointer())

            amplitude, first, stop, count = args[4], args[6], args[7], args[8]
            doubles = ir.VectorType(ir.DoubleType(), _LANES)
            scale = builder.insert_element(ir.Constant(doubles, None), amplitude, ir.IntType(32)(0))
            scale = builder.shuffle_vector(scale, scale, _splat(_WORDS, 0))
            # Each plane's least low bits so far, per lane (unsigned): zero where some step
            # had a doubt.
            least = [
                cgutils.alloca_once_value(builder, _splat(_WORDS, 0xFFFFFFFF))  # type: ignore[no-untyped-call]
                for _ in range(2)
            ]

            def loop(scaled: bool) -> None:
                steps = cgutils.for_range_slice(builder, first, stop, first.type(_LANES))
                with steps as (index, _):
                    s, c, turn_s, turn_c = (
                        builder.load(at(k, index, doubles), align=8) for k in range(4)
                    )
                    sin = builder.fadd(builder.fmul(s, turn_c), builder.fmul(c, turn_s))
                    cos = builder.fadd(
                        builder.fmul(c, turn_c), builder.fmul(s, builder.fneg(turn_s))
                    )
                    if scaled:
                        sin, cos = builder.fmul(sin, scale), builder.fmul(cos, scale)
                    rounded, lows = rounding(builder, sin, cos)
                    if planes:
                        for plane, halves in enumerate(rounded):
                            where = builder.add(index, builder.mul(count, count.type(plane)))
                            builder.store(halves, at(4, where, _HALVES), align=2)
                    else:
                        # Sine k and cosine k side by side: out's columns 2k and 2k + 1.
                        order = [k // 2 + (k % 2) * _LANES for k in range(2 * _LANES)]
                        pairs = builder.shuffle_vector(
                            rounded[0],
                            rounded[1],
                            ir.Constant(ir.VectorType(ir.IntType(32), 2 * _LANES), order),
                        )
                        where = builder.mul(index, index.type(2))
                        builder.store(pairs, at(4, where, pairs.type), align=2)
                    for low, plane_least in zip(lows, least, strict=True):
                        so_far = builder.load(plane_least)
                        smaller = builder.icmp_unsigned("<", low, so_far)
                        builder.store(builder.select(smaller, low, so_far), plane_least)

            with builder.if_else(builder.fcmp_ordered("!=", amplitude, ir.DoubleType()(1.0))) as (
                scaled,
                plain,
            ):
                with scaled:
                    loop(scaled=True)
                with plain:
                    loop(scaled=False)
            masks = [
                builder.zext(
                    builder.bitcast(
                        builder.icmp_unsigned("==", builder.load(p), ir.Constant(_WORDS, None)),
                        ir.IntType(_LANES),
                    ),
                    ir.IntType(16),
                )
                for p in least
            ]
            return builder.or_(masks[0], builder.shl(masks[1], ir.IntType(16)(_LANES)))

        return signature, codegen

    typing.__name__ = typing.__qualname__ = name
    return _intrinsic(typing)


def _bfloat16_rounding(builder: ir.IRBuilder, sin: Any, cos: Any) -> tuple[list[Any], list[Any]]:
    """Eight sines and eight cosines (float64) rounded to bfloat16 through float32 (rounded
    to nearest), eight lanes an instruction: their bits (16-bit lanes); and low bits of each
    (32-bit lanes), zero where that may be wrong. Those are a float32 that is itself a
    bfloat16 tie (its low 16 bits ``0x8000``), with the float64 on either side of it or on
    it. The caller rounds them again from float64, and only ties round differently to
    nearest-even and to nearest-away: so the lanes round half away from zero, a single
    addition, whose low 16 bits are zero exactly on a tie."""
    rounded, lows = [], []
    for value in (sin, cos):
        bits = builder.bitcast(builder.fptrunc(value, _SINGLES), _WORDS)
        nearest = builder.add(bits, _splat(_WORDS, 0x8000))
        # The high halves of the 32-bit lanes (little-endian: the odd 16-bit ones) by a
        # shuffle, which LLVM merges with the pairs' interleaving into one permutation (a
        # shift and a truncation it does not merge).
        words = builder.bitcast(nearest, ir.VectorType(ir.IntType(16), 2 * _LANES))
        rounded.append(builder.shuffle_vector(words, words, _HIGH_HALVES))
        lows.append(builder.and_(nearest, _splat(_WORDS, 0xFFFF)))
    return rounded, lows


def _float16_rounding(builder: ir.IRBuilder, sin: Any, cos: Any) -> tuple[list[Any], list[Any]]:
    """Eight sines and eight cosines (float64) rounded to float16 through float32 (rounded
    to nearest), then F16C's conversion (to nearest even), eight lanes an instruction: their
    bits, and low bits of each as ``_bfloat16_rounding`` gives them. Only a float32 on a
    float16 tie can be rounded wrong: its low 13 bits ``0x1000`` for a normal float16, and
    more low bits zero below float16's normals. So every float32 whose low 12 bits are zero
    is a doubt (one in 4096 of arbitrary values; exact values such as 0 and 1 too), whatever
    its exponent: those 12 bits are its low bits."""
    # F16C's conversion by its intrinsic (4: as the rounding mode says, to nearest even), so
    # that each plane is converted in registers: LLVM moves a plain fptrunc past the pairs'
    # interleaving and converts sixteen lanes straight into memory, a slower instruction.
    convert = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, _F16C_CONVERSION, "llvm.x86.vcvtps2ph.256"
    )
    rounded, lows = [], []
    for value in (sin, cos):
        single = builder.fptrunc(value, _SINGLES)
        rounded.append(builder.call(convert, [single, ir.IntType(32)(4)]))
        lows.append(builder.and_(builder.bitcast(single, _WORDS), _splat(_WORDS, 0xFFF)))
    return rounded, lows


_bfloat16_to_columns = _vector_kernel("_bfloat16_to_columns", _bfloat16_rounding, planes=False)
_bfloat16_to_planes = _vector_kernel("_bfloat16_to_planes", _bfloat16_rounding, planes=True)
# Only where the CPU has F16C, whose intrinsic they call (the loops that call these compile
# them only then).
_float16_to_columns = _vector_kernel("_float16_to_columns", _float16_rounding, planes=False)
_float16_to_planes = _vector_kernel("_float16_to_planes", _float16_rounding, planes=True)


def _bits(value: float) -> int:
    return int(np.float64(value).view(np.int64))


# A half-precision format, for ``_half_bits``: the float64 bits its rounding drops (52 less
# its mantissa's), its exponent's bias less float64's (at the exponent's place), its
# smallest normal value, a float64 whose ulp is its smallest subnormal and that float64's
# bits, and its infinity's bits.
_BFLOAT16_FORMAT: Final = (45, (1023 - 127) << 7, 2.0**-126, 2.0**-81, _bits(2.0**-81), 0x7F80)
_FLOAT16_FORMAT: Final = (42, (1023 - 15) << 10, 2.0**-14, 2.0**28, _bits(2.0**28), 0x7C00)


@_helper
def _half_bits(value: float, form: tuple[int, int, float, float, int, int]) -> int:
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


def _has_f16c() -> bool:
    """Whether the CPU numba compiles for converts float32 to float16 itself (F16C): the
    features numba gives LLVM, the host's unless ``NUMBA_CPU_FEATURES`` (or
    ``NUMBA_CPU_NAME=generic``, which sets none) says otherwise."""
    features = getattr(numba.core.config, "CPU_FEATURES", None)
    if features is None:
        features = llvmlite.binding.get_host_cpu_features().flatten()
    return "+f16c" in str(features).split(",")


_F16C: Final = _has_f16c()

# Each half-precision format's rounded rows: straight to the interleaved layout's columns, or
# as planes for the layouts copied by runs.
_bfloat16_columns = _rounded_row(
    _bfloat16_to_columns, _BFLOAT16_FORMAT, planes=False, run_pairs=_BFLOAT16_RUN
)
_bfloat16_planes = _rounded_row(
    _bfloat16_to_planes, _BFLOAT16_FORMAT, planes=True, run_pairs=_BFLOAT16_RUN
)
_float16_columns = _rounded_row(
    _float16_to_columns, _FLOAT16_FORMAT, planes=False, run_pairs=_FLOAT16_RUN, vectorized=_F16C
)
_float16_planes = _rounded_row(
    _float16_to_planes, _FLOAT16_FORMAT, planes=True, run_pairs=_FLOAT16_RUN, vectorized=_F16C
)


@_helper
def _planar_row(factors: _Factors, amplitude: float, row: npt.NDArray[np.float64]) -> None:
    """``row``'s sines, then its cosines: ``v(b) * conj(u(j)) * amplitude``
    (``rotate_into``); the value after them is left as it is (the zero column's 0)."""
    count = factors[0].size
    sines, cosines = row[:count], row[count : 2 * count]
    for i in range(count):
        sines[i], cosines[i] = _pair(factors, amplitude, i)


_rotated_values, _ranged_values = _row_loops(VALUES)
_rotated_bfloat16, _ranged_bfloat16 = _row_loops(BFLOAT16)
_rotated_float16, _ranged_float16 = _row_loops(FLOAT16)

# Each format's kernels, by ``numerics.STORE_*``.
RANGE_INTO: Final = {VALUES: range_into, BFLOAT16: range_into_bfloat16, FLOAT16: range_into_float16}
ROTATE_INTO: Final = {
    VALUES: rotate_into,
    BFLOAT16: rotate_into_bfloat16,
    FLOAT16: rotate_into_float16,
}


# The constants of the extended-precision angle (engine: TWO_PI, the Taylor coefficients).
_TWO_PI_HI = float(TWO_PI)
_TWO_PI_LO = float(TWO_PI - Decimal(_TWO_PI_HI))
# Veltkamp's constant 2**27 + 1 splits a float64 into two halves of at most 26 bits each,
# whose pairwise products are exact.
_SPLITTER = 134217729.0
# Taylor coefficients of sin (x**3 .. x**17) and cos (x**4 .. x**18), highest first for
# Horner's scheme: on [-pi/4, pi/4] the first term left out is below 2**-63.
_SIN_TAYLOR = tuple(reversed([(-1) ** k / math.factorial(2 * k + 1) for k in range(1, 9)]))
_COS_TAYLOR = tuple(reversed([(-1) ** k / math.factorial(2 * k) for k in range(2, 10)]))


@numba.njit(inline="always")
def _split(value: float) -> tuple[float, float]:
    """Veltkamp split: ``value == high + low`` with both halves at most 26 bits wide."""
    scaled = value * _SPLITTER
    high = scaled - (scaled - value)
    return high, value - high


_TWO_PI_SPLIT = (
    _TWO_PI_HI * _SPLITTER - (_TWO_PI_HI * _SPLITTER - _TWO_PI_HI),
    _TWO_PI_HI - (_TWO_PI_HI * _SPLITTER - (_TWO_PI_HI * _SPLITTER - _TWO_PI_HI)),
)


@_compiled
def angles_into(
    positions: npt.NDArray[np.int64],
    freq_hi: npt.NDArray[np.float64],
    freq_lo: npt.NDArray[np.float64],
    out: npt.NDArray[np.float64],
) -> None:
    """``out[r, 0, i]``, ``out[r, 1, i]`` = ``sin(a)``, ``cos(a)``, with ``a = 2pi *
    positions[r] * (freq_hi + freq_lo)[i]`` in turns as a double-double, within about
    2**-53 (the steps: ``engine``'s docstring)."""
    for r in range(positions.size):
        position = float(positions[r])
        pos_high, pos_low = _split(position)
        for i in range(freq_hi.size):
            frequency = freq_hi[i]
            freq_high, freq_low = _split(frequency)
            # Exact two-product position * freq_hi = product + product_error (Dekker).
            product = position * frequency
            product_error = pos_high * freq_high - product
            product_error += pos_high * freq_low
            product_error += pos_low * freq_high
            product_error += pos_low * freq_low
            # Dropping whole turns is exact; what is left lies in [-0.5, 0.5].
            turns = product - np.rint(product)
            correction = product_error + position * freq_lo[i]
            # Two-sum: turns + correction == turns_hi + turns_lo exactly.
            turns_hi = turns + correction
            virtual = turns_hi - turns
            turns_lo = (turns - (turns_hi - virtual)) + (correction - virtual)
            # Less the nearest quarter turn (exact: both are multiples of turns_hi's ulp),
            # within [-1/8, 1/8] turn.
            quarter = np.rint(turns_hi * 4.0)
            turns_hi -= quarter * 0.25
            # angle = (turns_hi + turns_lo) * 2pi as double-double, in [-pi/4, pi/4].
            angle = turns_hi * _TWO_PI_HI
            high, low = _split(turns_hi)
            angle_lo = high * _TWO_PI_SPLIT[0] - angle
            angle_lo += high * _TWO_PI_SPLIT[1]
            angle_lo += low * _TWO_PI_SPLIT[0]
            angle_lo += low * _TWO_PI_SPLIT[1]
            angle_lo += turns_hi * _TWO_PI_LO + turns_lo * _TWO_PI_HI
            sin, cos = _sin_cos_small(angle)
            # First-order correction for the low part of the angle (|angle_lo| < 2**-50).
            sin_exact = sin + cos * angle_lo
            cos_exact = cos - sin * angle_lo
            # Quarter turn q: (sin, cos) becomes (cos, -sin), (-sin, -cos), (-cos, sin).
            q = int(quarter) & 3
            if q & 1:
                sin, cos = cos_exact, sin_exact
            else:
                sin, cos = sin_exact, cos_exact
            sin *= float(1 - 2 * (q >> 1))
            cos *= float(1 - 2 * ((q ^ (q >> 1)) & 1))
            out[r, 0, i] = sin
            out[r, 1, i] = cos


@numba.njit(inline="always")
def _sin_cos_small(x: float) -> tuple[float, float]:
    """sin and cos of ``x`` in [-pi/4, pi/4], each within about 0.7 ulp.

    Taylor polynomials in ``z = x * x``; cos adds ``1 - z / 2`` with its rounding errors
    (and that of ``z``) carried separately, so that its largest term costs no accuracy.
    """
    z = x * x
    x_high, x_low = _split(x)
    z_error = (x_high * x_high - z) + 2.0 * x_high * x_low + x_low * x_low
    sin_tail = _horner(z, _SIN_TAYLOR)
    sin_tail *= z
    sin_tail *= x
    sin = x + sin_tail
    half = 0.5 * z
    head = 1.0 - half
    cos_tail = _horner(z, _COS_TAYLOR)
    cos_tail *= z
    cos_tail *= z
    cos_tail += ((1.0 - head) - half) - 0.5 * z_error
    return sin, head + cos_tail


@numba.njit(inline="always")
def _horner(z: float, coefficients: tuple[float, ...]) -> float:
    """``c0 + c1 z + c2 z**2 + ...`` of ``coefficients`` given highest first, Horner's way."""
    acc = coefficients[0]
    for coefficient in coefficients[1:]:
        acc *= z
        acc += coefficient
    return acc
