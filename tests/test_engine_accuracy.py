"""The accuracy contract against mpmath at 50 digits, extremes included.

float64 is within 2**-50 of the exact value; narrower dtypes are the correctly rounded value
or its neighbour (``reference.within_contract``).
"""

from __future__ import annotations

import itertools
import zlib

import mpmath
import numpy as np
import pytest
from reference import LAYOUTS, SCHEDULES, classic, exact, within_contract

from posenc_server import engine, numerics
from posenc_server.tables.sinusoidal import Sinusoidal

POSITIONS = [0, 1, 2**31 - 1, 2**40 + 7, 2**42, -(2**42)]
D_MODELS = [1, 2, 3, 64, 4096, 65536]
BASES = [2.0, 100.0, 10000.0, 500000.0, 1e9]
VARIANTS = list(itertools.product(LAYOUTS, SCHEDULES))


def sample_points(seed: int) -> list[tuple[float, int, str, str, list[int], list[int]]]:
    """(base, d_model, layout, schedule, positions, columns) covering every required extreme."""
    rng = np.random.default_rng(seed)
    cases = []
    for n, (base, d_model) in enumerate(itertools.product(BASES, D_MODELS)):
        layout, schedule = VARIANTS[n % len(VARIANTS)]
        # Log-uniform magnitudes reach every scale from 1 to 2**42, both signs.
        magnitudes = np.exp2(rng.uniform(0, 42, size=10)).astype(np.int64)
        signs = rng.choice([-1, 1], size=10)
        positions = POSITIONS + [int(m * s) for m, s in zip(magnitudes, signs, strict=True)]
        columns = {0, d_model - 1, min(1, d_model - 1), max(d_model - 2, 0)}
        columns.update(int(c) for c in rng.integers(0, d_model, size=5))
        cases.append((base, d_model, layout, schedule, positions, sorted(columns)))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(engine.DTYPES))
def test_every_sampled_element_meets_the_contract(dtype: str) -> None:
    checked = 0
    failures = []
    # Each dtype checks points of its own (a seed from its name, not shared with the others).
    seed = zlib.crc32(dtype.encode())
    for base, d_model, layout, schedule, positions, columns in sample_points(seed):
        spec = classic(d_model, base, dtype, layout, schedule)
        table = engine.encode_positions(spec, positions)
        for row, position in enumerate(positions):
            for column in columns:
                value = table[row, column]
                reference = exact(base, d_model, layout, schedule, position, column)
                checked += 1
                if not within_contract(value, reference):
                    failures.append((base, d_model, layout, schedule, position, column, value))
    assert checked >= 2000
    assert not failures, failures[:10]


def test_contract_check_rejects_a_two_ulp_error() -> None:
    # The checker itself must be able to fail: one float32 ulp off passes, two do not.
    reference = mpmath.sin(mpmath.mpf(10**6))
    correct = np.float32(float(reference))
    one_off = np.nextafter(correct, np.float32(2))
    two_off = np.nextafter(one_off, np.float32(2))
    assert within_contract(correct, reference)
    assert within_contract(one_off, reference) or within_contract(
        np.nextafter(correct, np.float32(-2)), reference
    )
    assert not within_contract(two_off, reference)
    assert not within_contract(np.float64(float(reference) + 2**-48), reference)


def test_naive_float32_fails_where_the_engine_passes() -> None:
    # The bug the service exists to avoid: the usual position * div_term in float32.
    position, d_model = 10**6, 64
    div_term = np.exp(
        np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-np.log(1e4) / d_model)
    )
    naive = np.sin(np.float32(position) * div_term)
    spec = classic(d_model)
    ours = engine.encode_positions(spec, [position])[0, 0::2]
    references = [
        exact(10000.0, d_model, "interleaved", "paper", position, 2 * i)
        for i in range(d_model // 2)
    ]
    naive_error = max(abs(float(n) - float(r)) for n, r in zip(naive, references, strict=True))
    assert naive_error > 0.01
    assert all(within_contract(v, r) for v, r in zip(ours, references, strict=True))


def test_two_pi_constant_matches_mpmath() -> None:
    with mpmath.workdps(80):
        assert abs(mpmath.mpf(str(numerics.TWO_PI)) - 2 * mpmath.pi) < mpmath.mpf(10) ** -58


def test_frequency_table_matches_mpmath_to_double_double_precision() -> None:
    for schedule in SCHEDULES:
        waves = Sinusoidal(65536, 500000.0, schedule=schedule).waves()
        hi, lo = waves.hi, waves.lo
        for i in (0, 1, 777, len(hi) - 1):
            value = mpmath.mpf(float(hi[i])) + mpmath.mpf(float(lo[i]))
            reference = mpmath.mpf(500000.0) ** (
                -mpmath.mpf(2 * i) / 65536 if schedule == "paper" else -mpmath.mpf(i) / (32768 - 1)
            ) / (2 * mpmath.pi)
            assert abs(value / reference - 1) < mpmath.mpf(2) ** -100


RANGE_STARTS = [0, 2**31 - 100, 2**40 + 7, 2**42 - 300, -(2**42), -12345]


@pytest.mark.parametrize("dtype", list(engine.DTYPES))
def test_ranges_meet_the_contract_up_to_the_position_limit(dtype: str) -> None:
    # encode_range takes the block-rotation path for ranges longer than two blocks.
    rng = np.random.default_rng(7)
    checked = 0
    failures = []
    for n, (base, d_model) in enumerate(itertools.product(BASES, [1, 3, 64, 4096])):
        layout, schedule = VARIANTS[n % len(VARIANTS)]
        spec = classic(d_model, base, dtype, layout, schedule)
        start = RANGE_STARTS[n % len(RANGE_STARTS)]
        rows = 300
        table = engine.encode_range(spec, start, start + rows)
        for row in {0, 1, 63, 64, 65, rows - 1, *rng.integers(0, rows, size=8).tolist()}:
            for column in {0, d_model - 1, *rng.integers(0, d_model, size=4).tolist()}:
                reference = exact(base, d_model, layout, schedule, start + row, column)
                checked += 1
                if not within_contract(table[row, column], reference):
                    failures.append((base, d_model, layout, start + row, column))
    assert checked >= 500
    assert not failures, failures[:10]


def test_range_and_position_paths_agree() -> None:
    for layout, schedule in VARIANTS:
        for d_model in (1, 2, 5, 64, 129):
            spec = classic(d_model, 500.0, "float64", layout, schedule)
            by_range = engine.encode_range(spec, 2**42 - 1000, 2**42)
            by_list = engine.encode_positions(spec, np.arange(2**42 - 1000, 2**42))
            np.testing.assert_array_equal(by_range, by_list)
