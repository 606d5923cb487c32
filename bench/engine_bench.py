"""a. Engine, cold: posenc's encode_range against plain float64 numpy and naive float32."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.common import MIB, Section, Sizes, Table, Target, median, ratio, rotated
from bench.harness import Servers

Array = npt.NDArray[Any]


def _classic(d_model: int, dtype: str) -> Any:
    """The classic sinusoidal table, prepared afresh: a run pays for its frequencies too."""
    from posenc_server import engine
    from posenc_server.tables.sinusoidal import Sinusoidal

    return engine.Encoding.prepare(Sinusoidal(d_model), dtype)


def engine_float32(start: int, rows: int, d_model: int) -> Array:
    from posenc_server import engine

    return engine.encode_range(_classic(d_model, "float32"), start, start + rows)


def engine_float64(start: int, rows: int, d_model: int) -> Array:
    from posenc_server import engine

    return engine.encode_range(_classic(d_model, "float64"), start, start + rows)


def plain_numpy(start: int, rows: int, d_model: int, base: float = 10000.0) -> Array:
    """The plain accurate way: float64 angles, np.sin / np.cos, interleaved, cast to float32."""
    positions = np.arange(start, start + rows, dtype=np.float64)
    inv_freq = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    angles = positions[:, None] * inv_freq[None, :]
    out = np.empty((rows, d_model), dtype=np.float32)
    out[:, 0::2] = np.sin(angles)
    out[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return out


def naive_float32(start: int, rows: int, d_model: int, base: float = 10000.0) -> Array:
    """The usual PyTorch code, in numpy: everything float32, ``position * div_term``."""
    position = np.arange(start, start + rows, dtype=np.float32)[:, None]
    div_term = np.exp(
        np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-(math.log(base) / d_model))
    )
    out = np.zeros((rows, d_model), dtype=np.float32)
    out[:, 0::2] = np.sin(position * div_term)
    out[:, 1::2] = np.cos(position * div_term[: d_model // 2])
    return out


def run(sizes: Sizes, servers: Servers) -> Section:
    """Section a, in-process: the idle servers are not called (``servers`` unused)."""
    section = Section(
        "a",
        "Engine, cold",
        method=(
            f"float32 tables of rows x d_model starting at position {sizes.engine_start}, "
            "computed in the harness process. posenc = `posenc_server.engine.encode_range` "
            "with every engine lru_cache cleared before each run; plain numpy = float64 "
            "angles `positions[:, None] * inv_freq[None, :]`, np.sin/np.cos, interleaved and "
            "cast to float32; naive float32 = the usual PyTorch code (`div_term = exp(arange(0, "
            "d, 2) * -(log(10000)/d))` and `position * div_term` all in float32). The three "
            f"run interleaved, {sizes.repeats} times each (order rotated); medians. Errors are "
            "max |x - reference| against the engine's float64 table of the same positions. "
            "Per value: new rows of a known table in each dtype, written into an array "
            "touched before; a dtype's blocks one after another as a stream's (median of ten), "
            "the dtypes in turn."
        ),
    )
    methods: dict[str, Callable[[int, int, int], Array]] = {
        "posenc engine": engine_float32,
        "plain numpy (float64 angles)": plain_numpy,
        "naive float32": naive_float32,
    }
    rows_out: list[list[Any]] = []
    data: dict[str, Any] = {}
    for rows, d_model in sizes.engine_shapes:
        start = sizes.engine_start
        nbytes = rows * d_model * 4
        samples: dict[str, list[float]] = {name: [] for name in methods}
        for method in methods.values():  # warm-up: imports, page faults, numpy dispatch
            method(start, min(rows, 64), d_model)
        for repeat in range(sizes.repeats):
            for name in rotated(list(methods), repeat):
                t0 = time.perf_counter()
                methods[name](start, rows, d_model)
                samples[name].append(time.perf_counter() - t0)
        reference = engine_float64(start, rows, d_model)
        errors = {
            "posenc engine": float(
                np.max(np.abs(engine_float32(start, rows, d_model) - reference))
            ),
            "plain numpy (float64 angles)": float(
                np.max(np.abs(plain_numpy(start, rows, d_model) - reference))
            ),
            "naive float32": float(np.max(np.abs(naive_float32(start, rows, d_model) - reference))),
        }
        del reference
        speeds = {name: nbytes / MIB / median(s) for name, s in samples.items()}
        key = f"{rows}x{d_model}"
        data[key] = {
            "rows": rows,
            "d_model": d_model,
            "start": start,
            "bytes": nbytes,
            "seconds": samples,
            "mib_per_s": speeds,
            "max_abs_error": errors,
        }
        for name in methods:
            rows_out.append(
                [
                    key,
                    name,
                    f"{median(samples[name]) * 1e3:.1f}",
                    f"{speeds[name]:.0f}",
                    f"{ratio(speeds[name], speeds['plain numpy (float64 angles)']):.2f}",
                    f"{errors[name]:.2e}",
                ]
            )
        section.targets.append(
            Target(
                f"engine {key} cold MiB/s / plain numpy MiB/s",
                ratio(speeds["posenc engine"], speeds["plain numpy (float64 angles)"]),
                ">=",
                4.0,
            )
        )
        section.targets.append(
            Target(
                f"naive float32 max abs error at {key} from position {start}",
                errors["naive float32"],
                "",
                0.0,
                unit="",
            )
        )
    section.tables.append(
        Table(
            "float32 output, cold",
            ["rows x d_model", "method", "median ms", "MiB/s", "x plain numpy", "max abs error"],
            rows_out,
        )
    )
    _per_value(sizes, section, data)
    section.data = data
    return section


#: The dtypes of ``_per_value``.
_PER_VALUE_DTYPES = ("float32", "bfloat16", "float16", "float64")
#: A stream's block: the bytes of output the server computes in one call, in any dtype.
_BLOCK_BYTES = MIB
#: Memory the blocks of ``_per_value``'s second measure go to, in turn: far more than the
#: CPU's caches hold, as a server's cache budget (512 MiB by default) is.
_POOL_BYTES = 256 * MIB
#: ``_per_value``'s measures: the same block each time, and each block to the next part
#: of the pool.
_IN_CACHE, _AS_A_STREAM = "in cache", "as a stream"


def _per_value(sizes: Sizes, section: Section, data: dict[str, Any]) -> None:
    """The engine's cost per value in each dtype and table, as a stream computes its blocks:
    new rows of a known table (its frequencies made), 1 MiB of output a call (so half
    precision's blocks hold twice float32's rows), one block after the other (the factors
    stay in the CPU's caches), the median of eight taken; the dtypes take turns. Twice:
    into the same block each time (its output stays in the CPU's caches: the computing
    alone), and into the next MiB of a pool of 256 MiB touched before (as the server writes
    each block into its own message, in a heap far larger than the caches). bfloat16 and
    float16 values are rounded in the kernel, float32 and float64 ones stored as they are."""
    from posenc_server import engine
    from posenc_server.tables.rotary import Rotary
    from posenc_server.tables.sinusoidal import Sinusoidal

    # The classic table 4096 wide (interleaved, written straight to its columns) and the
    # rotary table of a head of 128 (transformers' layout, copied by runs from a row of
    # planes).
    tables = {"sinusoidal d_model 4096": Sinusoidal(4096), "rotary head_dim 128": Rotary(128)}
    pool = np.ones(_POOL_BYTES, dtype=np.uint8)
    blocks = _POOL_BYTES // _BLOCK_BYTES
    data["per_value"] = {}
    for name, kind in tables.items():
        encodings = {dtype: engine.Encoding.prepare(kind, dtype) for dtype in _PER_VALUE_DTYPES}
        first_rows = {dtype: engine.encode_range(encodings[dtype], 0, 1) for dtype in encodings}
        rows = {dtype: _BLOCK_BYTES // one.nbytes for dtype, one in first_rows.items()}
        width = first_rows["float32"].shape[1]

        samples: dict[str, dict[str, list[float]]] = {
            measure: {dtype: [] for dtype in _PER_VALUE_DTYPES}
            for measure in (_IN_CACHE, _AS_A_STREAM)
        }
        start = sizes.engine_start
        turn = 0
        for repeat in range(4 * sizes.repeats):
            for dtype in rotated(list(_PER_VALUE_DTYPES), repeat):
                for measure in (_IN_CACHE, _AS_A_STREAM):
                    times = []
                    for _ in range(8):
                        turn += 1
                        index = 0 if measure == _IN_CACHE else turn % blocks
                        out = _block(pool, index, first_rows[dtype], rows[dtype])
                        start += rows[dtype]
                        t0 = time.perf_counter()
                        engine.encode_range(encodings[dtype], start, start + rows[dtype], out=out)
                        times.append(time.perf_counter() - t0)
                    samples[measure][dtype].append(median(times) / out.size)
        ns = {
            measure: {dtype: median(values) * 1e9 for dtype, values in by_dtype.items()}
            for measure, by_dtype in samples.items()
        }
        data["per_value"][name] = {"rows": rows, "width": width, "seconds_per_value": samples}
        section.tables.append(
            Table(
                f"ns per value, {name}: 1 MiB blocks of new rows x {width} of a known table",
                ["dtype", "rows a block", *(f"{m}: {c}" for m in ns for c in ("ns", "x float32"))],
                [
                    [
                        dtype,
                        str(rows[dtype]),
                        *(
                            f"{figure:.{digits}f}"
                            for by_dtype in ns.values()
                            for figure, digits in (
                                (by_dtype[dtype], 3),
                                (by_dtype[dtype] / by_dtype["float32"], 2),
                            )
                        ),
                    ]
                    for dtype in _PER_VALUE_DTYPES
                ],
            )
        )
        for measure, by_dtype in ns.items():
            for dtype in ("bfloat16", "float16"):
                section.targets.append(
                    Target(
                        f"engine {dtype} value / float32 value, {name}, {measure} "
                        "(time, rounding included)",
                        by_dtype[dtype] / by_dtype["float32"],
                        "",
                        0.0,
                    )
                )


def _block(pool: Array, index: int, row: Array, rows: int) -> Array:
    """Block ``index`` of ``pool`` (bytes), as ``rows`` rows like ``row``."""
    first = index * _BLOCK_BYTES
    return pool[first : first + rows * row.nbytes].view(row.dtype).reshape(rows, row.shape[1])
