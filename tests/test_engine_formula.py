"""Small tables cell by cell against the formula as written, and engine invariants."""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from reference import LAYOUTS, SCHEDULES, classic, exact

from posenc_server import admission, engine
from posenc_server.tables.rotary import Rotary
from posenc_server.tables.scalings import Yarn
from posenc_server.tables.sinusoidal import Sinusoidal


def formula(
    d_model: int, positions: list[int], base: float, layout: str, schedule: str
) -> np.ndarray:
    """The table's definition in plain float64 math (accurate for these small positions)."""
    if schedule == "paper":
        count = math.ceil(d_model / 2)
        inv = [base ** (-2 * i / d_model) for i in range(count)]
        n_sin, n_cos = count, d_model // 2
    else:
        half = d_model // 2
        inv = [base ** (-i / max(half - 1, 1)) for i in range(half)]
        n_sin = n_cos = half
    table = np.zeros((len(positions), d_model))
    for r, pos in enumerate(positions):
        sins = [math.sin(pos * f) for f in inv[:n_sin]]
        coss = [math.cos(pos * f) for f in inv[:n_cos]]
        if layout == "interleaved":
            for i, value in enumerate(sins):
                table[r, 2 * i] = value
            for i, value in enumerate(coss):
                table[r, 2 * i + 1] = value
        else:
            table[r, :n_sin] = sins
            table[r, n_sin : n_sin + n_cos] = coss
    return table


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("d_model", [1, 2, 3, 4, 7, 8, 33])
def test_small_tables_match_the_formula(layout: str, schedule: str, d_model: int) -> None:
    positions = [-5, -1, 0, 1, 2, 3, 17, 1000]
    spec = classic(d_model, 10000.0, "float64", layout, schedule)
    table = engine.encode_positions(spec, positions)
    np.testing.assert_allclose(
        table, formula(d_model, positions, 10000.0, layout, schedule), rtol=0, atol=1e-12
    )


def test_interleaved_paper_is_the_vaswani_table() -> None:
    table = engine.encode_range(classic(4, dtype="float64"), 0, 3)
    expected = [
        [0.0, 1.0, 0.0, 1.0],
        [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)],
        [math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)],
    ]
    np.testing.assert_allclose(table, expected, atol=1e-15)


def test_odd_widths_end_with_a_sin_for_paper_and_a_zero_for_tensor2tensor() -> None:
    paper = engine.encode_positions(classic(5, dtype="float64"), [3])[0]
    assert paper[4] == pytest.approx(math.sin(3 * 10000 ** (-4 / 5)), abs=1e-15)
    t2t = engine.encode_positions(classic(5, dtype="float64", schedule="tensor2tensor"), [3])[0]
    assert t2t[4] == 0.0
    assert t2t[0] == pytest.approx(math.sin(3), abs=1e-15)
    assert t2t[2] == pytest.approx(math.sin(3 * 10000**-1), abs=1e-15)


def test_every_cell_of_a_wide_split_row_matches_mpmath() -> None:
    spec = classic(129, 500000.0, "float64", "split", "paper")
    row = engine.encode_positions(spec, [2**42 - 3])[0]
    for column in range(129):
        reference = exact(500000.0, 129, "split", "paper", 2**42 - 3, column)
        assert abs(row[column] - float(reference)) <= 2**-50


@pytest.mark.parametrize(
    ("dtype", "numpy_dtype"),
    [
        ("float32", np.dtype("<f4")),
        ("float16", np.dtype("<f2")),
        ("bfloat16", np.dtype(ml_dtypes.bfloat16)),
        ("float64", np.dtype("<f8")),
    ],
)
def test_dtypes_are_little_endian_and_exactly_the_float64_table_rounded(
    dtype: str, numpy_dtype: np.dtype[Any]
) -> None:
    table = engine.encode_range(classic(16, dtype=dtype), 100, 110)
    assert table.dtype == numpy_dtype
    wide = engine.encode_range(classic(16, dtype="float64"), 100, 110)
    if dtype != "float64":  # float64 is the table the others are rounded from
        np.testing.assert_array_equal(table, wide.astype(numpy_dtype))


@pytest.mark.parametrize(
    "table",
    [
        Sinusoidal(4096, layout="split"),
        Sinusoidal(1023),
        Rotary(128, 500000.0),
        Rotary(96, layout="gptj", partial_rotary_factor=0.5),
        Rotary(64, 1e6, scaling=Yarn(factor=4.0, original_max_position_embeddings=4096)),
    ],
    ids=lambda table: f"{table.NAME}-{table.width}",
)
def test_bfloat16_rows_are_the_float64_rows_rounded_to_nearest_even(table: Any) -> None:
    # The engine rounds to bfloat16 through float32 and fixes the values whose float32 is
    # a bfloat16 tie (one in 65536): about a million values here, so a few dozen ties.
    wide, narrow = (engine.Encoding.prepare(table, dtype) for dtype in ("float64", "bfloat16"))
    rows = -(-(1 << 20) // table.width)
    start = 2**41 + 12345
    expected = engine.encode_range(wide, start, start + rows).astype(ml_dtypes.bfloat16)
    got = engine.encode_range(narrow, start, start + rows)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))
    positions = np.random.default_rng(3).integers(-(2**42), 2**42, 300)
    expected = engine.encode_positions(wide, positions).astype(ml_dtypes.bfloat16)
    got = engine.encode_positions(narrow, positions)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_range_equals_the_same_positions_listed_and_rows_are_independent() -> None:
    # Each row depends on (spec, position) only, so any split of a request, on any replica,
    # range or list, cached or not, gives the same bytes.
    spec = classic(64, layout="split")
    whole = engine.encode_range(spec, -10, 500)
    listed = engine.encode_positions(spec, list(range(-10, 500)))
    np.testing.assert_array_equal(engine.encode_range(spec, 33, 333), whole[43:343])
    np.testing.assert_array_equal(whole, listed)
    shuffled = np.random.default_rng(1).permutation(np.arange(-10, 500))
    np.testing.assert_array_equal(engine.encode_positions(spec, shuffled), whole[shuffled + 10])


@pytest.mark.parametrize("d_model", [8, 4096])
def test_rows_do_not_depend_on_how_the_work_was_split(d_model: int) -> None:
    # A fresh spec's first rows use rotations made for them alone; a range computed block by
    # block, as the service asks, and a whole range use the block's rotation table. All give
    # the same bytes, into a new array or into one given.
    start = 2**40 + 3
    fresh = classic(d_model, dtype="float64", base=12345.0)
    first_rows = engine.encode_positions(fresh, [start, start + 1])
    whole = engine.encode_range(classic(d_model, dtype="float64", base=12345.0), start, start + 600)
    np.testing.assert_array_equal(first_rows, whole[:2])
    spec = classic(d_model, dtype="float64", base=12345.0)
    out = np.empty_like(whole)
    for first in range(0, 600, 64):
        last = min(first + 64, 600)
        engine.encode_range(spec, start + first, start + last, out=out[first:last])
    np.testing.assert_array_equal(out, whole)


def test_negative_positions_are_odd_in_sin_and_even_in_cos() -> None:
    spec = classic(8, dtype="float64")
    positive = engine.encode_positions(spec, [12345, 2**41])
    negative = engine.encode_positions(spec, [-12345, -(2**41)])
    np.testing.assert_allclose(negative[:, 0::2], -positive[:, 0::2], rtol=0, atol=2**-50)
    np.testing.assert_allclose(negative[:, 1::2], positive[:, 1::2], rtol=0, atol=2**-50)


def test_empty_selection_gives_an_empty_table() -> None:
    assert engine.encode_range(classic(8), 5, 5).shape == (0, 8)


def test_a_column_writer_that_does_more_than_copy_is_refused() -> None:
    """The engine reads a kind's layout off its ``write_columns`` (which value each column
    copies): a writer that computes (here: scales, or writes a constant) cannot be read so,
    and is refused rather than given wrong columns."""

    class Scaled(Sinusoidal):
        def write_columns(self, target: Any, rows: Any) -> None:
            super().write_columns(target, rows)
            target *= 2.0

    class Constant(Sinusoidal):
        def write_columns(self, target: Any, rows: Any) -> None:
            super().write_columns(target, rows)
            target[:, -1] = 1.0

    for table in (Scaled(d_model=8), Constant(d_model=8)):
        with pytest.raises(ValueError, match="must only copy values"):
            engine.encode_range(engine.Encoding.prepare(table, "float32"), 0, 4)
    plain = engine.Encoding.prepare(Sinusoidal(d_model=5, layout="split"), "float32")
    assert plain.columns.tolist() == [0, 2, 4, 1, 3]


@pytest.mark.parametrize("d_model", [1, 8, 4096])
def test_a_block_is_computed_within_the_engines_working_memory(d_model: int) -> None:
    """The service computes 1 MiB blocks, and admits each computation for at most
    ``admission.ENGINE_WORKING_BYTES`` (4 MiB) beside its output: a narrow table's block is
    262,144 rows, whose positions and indices, made whole, took 10 MiB."""
    spec = classic(d_model, dtype="float32")
    rows = (1 << 18) // d_model
    out = np.empty((rows, d_model), dtype=np.float32)
    engine.encode_range(spec, 0, rows, out=out)  # the spec's rotation table, made once
    tracemalloc.start()
    try:
        engine.encode_range(spec, 10**9, 10**9 + rows, out=out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= admission.ENGINE_WORKING_BYTES // 2, f"{peak / 2**20:.2f} MiB"
