"""The vector kernels: eight pairs of a row at a time (``LANES``), computed as ``pairs.pair``
computes them and rounded to bfloat16 or float16 in LLVM's IR, with a mask of the values
that rounding may have got wrong (the callers round those again exactly: ``halves``).

``float16_to_columns`` and ``float16_to_planes`` convert with F16C's instruction; they are
for CPUs that have it (``F16C``) alone: a loop that calls them compiles them only then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import llvmlite.binding  # type: ignore[import-untyped]
import numba.core.config
from llvmlite import ir
from numba.core import cgutils, types

from posenc_server.kernel.jit import intrinsic

#: Pairs a step of the vector kernels: eight, whose sines and cosines each fill a 256-bit
#: vector of 32-bit values.
LANES: Final = 8

_WORDS: Final = ir.VectorType(ir.IntType(32), LANES)
_SINGLES: Final = ir.VectorType(ir.FloatType(), LANES)
_HALVES: Final = ir.VectorType(ir.IntType(16), LANES)
_HIGH_HALVES: Final = ir.Constant(_WORDS, [2 * k + 1 for k in range(LANES)])
_F16C_CONVERSION: Final = ir.FunctionType(_HALVES, [_SINGLES, ir.IntType(32)])


def _splat(vector: ir.VectorType, value: int) -> ir.Constant:
    return ir.Constant(vector, [value] * LANES)


def _vector_kernel(name: str, rounding: Callable[..., Any], planes: bool) -> Callable[..., Any]:
    """A vector kernel: pairs ``first`` to ``stop`` (a multiple of ``LANES`` more) of a row
    as ``pairs.pair`` makes them (the same IEEE operations in its order: the same bits),
    rounded by ``rounding`` and stored in ``out`` (uint16) as pairs (``out[2 * first]`` on: the
    interleaved layout's columns) or as ``planes`` (the sines from ``out[first]``, the
    cosines from ``out[count + first]``: the scratch row the other layouts' runs copy from).
    Returns the mask of the values it may have rounded wrong, of all its steps at once (bit
    ``k``: some step's ``k``-th sine, ``LANES + k``: its ``k``-th cosine), so exact for a
    call of one step.

    A loop of one value at a time gets four 32-bit lanes a vector instruction at most: the
    float64 products come four to a vector, the sines and the cosines in two. Here eight
    sines are one vector and eight cosines another, rounded eight lanes at a time. Each step
    folds its doubts into two vectors (the least of ``rounding``'s low bits, unsigned), read
    once, at the end: no step leaves the vector unit or branches. The loop comes twice,
    with and without the amplitude's products (left out by an amplitude of 1, as
    ``pairs.pair`` leaves them). Contiguous arrays only (the engine's), which it reads and writes as
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
            return _Body(context, builder, signature, args).emit(rounding, planes)

        return signature, codegen

    typing.__name__ = typing.__qualname__ = name
    return intrinsic(typing)


class _Body:
    """The IR of one vector kernel's call: its arguments (the five arrays' data, the
    amplitude, ``first``, ``stop``, ``count``) and the two planes' least low bits so far."""

    def __init__(self, context: Any, builder: ir.IRBuilder, signature: Any, args: list[Any]):
        self.builder = builder
        self.data = [
            context.make_array(signature.args[k])(context, builder, args[k]).data
            for k in (0, 1, 2, 3, 5)
        ]
        self.amplitude, self.first, self.stop, self.count = args[4], args[6], args[7], args[8]
        self.doubles = ir.VectorType(ir.DoubleType(), LANES)
        scale = builder.insert_element(
            ir.Constant(self.doubles, None), self.amplitude, ir.IntType(32)(0)
        )
        self.scale = builder.shuffle_vector(scale, scale, _splat(_WORDS, 0))
        # Each plane's least low bits so far, per lane (unsigned): zero where some step
        # had a doubt.
        self.least = [
            cgutils.alloca_once_value(builder, _splat(_WORDS, 0xFFFFFFFF))  # type: ignore[no-untyped-call]
            for _ in range(2)
        ]

    def at(self, k: int, index: Any, vector: ir.Type) -> Any:
        """A pointer to a vector at array ``k``'s ``index``."""
        return self.builder.bitcast(self.builder.gep(self.data[k], [index]), vector.as_pointer())

    def emit(self, rounding: Callable[..., Any], planes: bool) -> Any:
        """The loop, with the amplitude's products when it is not 1 and without them when
        it is; then the mask of doubts."""
        builder = self.builder
        not_one = builder.fcmp_ordered("!=", self.amplitude, ir.DoubleType()(1.0))
        with builder.if_else(not_one) as (scaled, plain):
            with scaled:
                self.loop(rounding, planes, scaled=True)
            with plain:
                self.loop(rounding, planes, scaled=False)
        return self.mask()

    def loop(self, rounding: Callable[..., Any], planes: bool, scaled: bool) -> None:
        """Steps of ``LANES`` pairs from ``first`` to ``stop``: compute, round, store and
        fold each step's doubts."""
        builder = self.builder
        steps = cgutils.for_range_slice(builder, self.first, self.stop, self.first.type(LANES))
        with steps as (index, _):
            s, c, turn_s, turn_c = (
                builder.load(self.at(k, index, self.doubles), align=8) for k in range(4)
            )
            sin = builder.fadd(builder.fmul(s, turn_c), builder.fmul(c, turn_s))
            cos = builder.fadd(builder.fmul(c, turn_c), builder.fmul(s, builder.fneg(turn_s)))
            if scaled:
                sin, cos = builder.fmul(sin, self.scale), builder.fmul(cos, self.scale)
            rounded, lows = rounding(builder, sin, cos)
            if planes:
                self.store_planes(index, rounded)
            else:
                self.store_columns(index, rounded)
            self.fold(lows)

    def store_planes(self, index: Any, rounded: list[Any]) -> None:
        """The sines at ``out[index]``, the cosines at ``out[count + index]``."""
        builder = self.builder
        for plane, halves in enumerate(rounded):
            where = builder.add(index, builder.mul(self.count, self.count.type(plane)))
            builder.store(halves, self.at(4, where, _HALVES), align=2)

    def store_columns(self, index: Any, rounded: list[Any]) -> None:
        """Sine k and cosine k side by side: ``out``'s columns 2k and 2k + 1."""
        builder = self.builder
        order = [k // 2 + (k % 2) * LANES for k in range(2 * LANES)]
        pairs = builder.shuffle_vector(
            rounded[0],
            rounded[1],
            ir.Constant(ir.VectorType(ir.IntType(32), 2 * LANES), order),
        )
        where = builder.mul(index, index.type(2))
        builder.store(pairs, self.at(4, where, pairs.type), align=2)

    def fold(self, lows: list[Any]) -> None:
        """Keep each plane's least low bits, per lane (unsigned)."""
        builder = self.builder
        for low, plane_least in zip(lows, self.least, strict=True):
            so_far = builder.load(plane_least)
            smaller = builder.icmp_unsigned("<", low, so_far)
            builder.store(builder.select(smaller, low, so_far), plane_least)

    def mask(self) -> Any:
        """The doubts as a 16-bit mask: bit k a sine's lane k, bit ``LANES + k`` a
        cosine's."""
        builder = self.builder
        masks = [
            builder.zext(
                builder.bitcast(
                    builder.icmp_unsigned("==", builder.load(p), ir.Constant(_WORDS, None)),
                    ir.IntType(LANES),
                ),
                ir.IntType(16),
            )
            for p in self.least
        ]
        return builder.or_(masks[0], builder.shl(masks[1], ir.IntType(16)(LANES)))


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
        words = builder.bitcast(nearest, ir.VectorType(ir.IntType(16), 2 * LANES))
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


bfloat16_to_columns = _vector_kernel("bfloat16_to_columns", _bfloat16_rounding, planes=False)
bfloat16_to_planes = _vector_kernel("bfloat16_to_planes", _bfloat16_rounding, planes=True)
float16_to_columns = _vector_kernel("float16_to_columns", _float16_rounding, planes=False)
float16_to_planes = _vector_kernel("float16_to_planes", _float16_rounding, planes=True)


def has_f16c() -> bool:
    """Whether the CPU numba compiles for converts float32 to float16 itself (F16C): the
    features numba gives LLVM, the host's unless ``NUMBA_CPU_FEATURES`` (or
    ``NUMBA_CPU_NAME=generic``, which sets none) says otherwise."""
    features = getattr(numba.core.config, "CPU_FEATURES", None)
    if features is None:
        features = llvmlite.binding.get_host_cpu_features().flatten()
    return "+f16c" in str(features).split(",")


F16C: Final = has_f16c()
