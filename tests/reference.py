"""An independent reference for the tables (the formula as written, evaluated with mpmath),
and the shortest ways to run the server's engine on a table without a server."""

from __future__ import annotations

import mpmath
import numpy as np
import numpy.typing as npt

from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_server import convert, engine
from posenc_server.config import ServerConfig
from posenc_server.tables.sinusoidal import Sinusoidal

mpmath.mp.dps = 50

LAYOUTS = ("interleaved", "split")
SCHEDULES = ("paper", "tensor2tensor")


def classic(
    d_model: int,
    base: float = 10000.0,
    dtype: str = "float32",
    layout: str = "interleaved",
    schedule: str = "paper",
) -> engine.Encoding:
    """The classic sinusoidal table, ready for ``engine.encode_range`` / ``encode_positions``."""
    return engine.Encoding.prepare(Sinusoidal(d_model, base, layout, schedule), dtype)


def prepared(spec: pb.EncodingSpec, config: ServerConfig | None = None) -> engine.Encoding:
    """The engine's form of ``spec``, through the server's own conversion and validation."""
    violations: list[object] = []
    table = convert.table_from_proto(spec, violations)  # type: ignore[arg-type]
    assert table is not None, violations
    assert not (problems := table.validate(f"spec.{table.NAME}", config or ServerConfig())), (
        problems
    )
    dtype = pb.Dtype.Name(spec.dtype or pb.DTYPE_FLOAT32).removeprefix("DTYPE_").lower()
    return engine.Encoding.prepare(table, dtype)


def engine_range(spec: pb.EncodingSpec, start: int, stop: int) -> npt.NDArray[np.generic]:
    """What the server answers for ``spec`` and positions ``start .. stop - 1``."""
    return engine.encode_range(prepared(spec), start, stop)


def engine_positions(spec: pb.EncodingSpec, positions: npt.ArrayLike) -> npt.NDArray[np.generic]:
    """What the server answers for ``spec`` and ``positions``."""
    return engine.encode_positions(prepared(spec), positions)


def column_role(d_model: int, layout: str, schedule: str, column: int) -> tuple[str, int]:
    """("sin" | "cos" | "zero", frequency index) of one column, straight from the definitions."""
    if schedule == "tensor2tensor":
        pairs = d_model // 2
        n_sin = n_cos = pairs
    else:
        n_sin, n_cos = (d_model + 1) // 2, d_model // 2
    if layout == "interleaved":
        if column < 2 * n_cos:
            return ("sin" if column % 2 == 0 else "cos"), column // 2
        if column < n_sin + n_cos:
            return "sin", column // 2
        return "zero", 0
    if column < n_sin:
        return "sin", column
    if column < n_sin + n_cos:
        return "cos", column - n_sin
    return "zero", 0


def inv_freq(base: float, d_model: int, schedule: str, i: int) -> mpmath.mpf:
    """inv_freq[i] of the schedule (see ``posenc.v1.Schedule``), at 50 digits."""
    b = mpmath.mpf(base)
    if schedule == "paper":
        return b ** (-mpmath.mpf(2 * i) / d_model)
    return b ** (-mpmath.mpf(i) / max(d_model // 2 - 1, 1))


def exact(
    base: float, d_model: int, layout: str, schedule: str, position: int, column: int
) -> mpmath.mpf:
    """The exact table value at (position, column)."""
    role, i = column_role(d_model, layout, schedule, column)
    if role == "zero":
        return mpmath.mpf(0)
    angle = position * inv_freq(base, d_model, schedule, i)
    return mpmath.sin(angle) if role == "sin" else mpmath.cos(angle)


def _step(value: np.generic, up: bool) -> np.generic:
    """The next representable value of value's dtype towards +inf (up) or -inf."""
    dtype = np.dtype(type(value))
    bits_type = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    array = np.array([value], dtype=dtype)
    bits = array.view(bits_type)
    sign_bit = bits_type(1) << bits_type(8 * dtype.itemsize - 1)
    if float(value) == 0.0:
        # Smallest subnormal of the right sign.
        bits[0] = bits_type(1) if up else sign_bit | bits_type(1)
    elif (float(value) > 0) == up:
        bits[0] += bits_type(1)
    else:
        bits[0] -= bits_type(1)
    return array[0]  # type: ignore[no-any-return]


def within_contract(value: np.generic, exact_value: mpmath.mpf) -> bool:
    """The accuracy contract for one element.

    float64: absolute error <= 2**-50. Narrower dtypes: the value is the correctly rounded
    value or its neighbour (no representable number lies strictly between the value and the
    exact result); where |exact| < 2**-20, an absolute error <= 2**-50 also passes.
    """
    error = abs(mpmath.mpf(float(value)) - exact_value)
    if error <= mpmath.mpf(2) ** -50 and (
        np.dtype(type(value)) == np.float64 or abs(exact_value) < mpmath.mpf(2) ** -20
    ):
        return True
    if np.dtype(type(value)) == np.float64:
        return False
    as_float = mpmath.mpf(float(value))
    if as_float == exact_value:
        return True
    toward = _step(value, up=bool(as_float < exact_value))
    beyond = mpmath.mpf(float(toward))
    return bool(beyond >= exact_value if as_float < exact_value else beyond <= exact_value)
