"""The start-up warm-up: a table of every kind, with valid parameters, run in every dtype,
and every kernel specialization a call can need compiled before a server listens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from posenc_server import kernel, numerics, warmup
from posenc_server.config import ServerConfig
from posenc_server.tables import KINDS


def test_the_warm_up_runs_every_table_kind_with_valid_parameters() -> None:
    tables = warmup.tables()
    assert {type(table) for table in tables} == set(KINDS.values())
    limits = ServerConfig()  # the default limits
    for table in tables:
        assert table.validate("table", limits) == [], table


def test_the_warm_up_compiles_every_kernel_specialization_it_serves() -> None:
    warmup.warm_up()
    expected = {
        numerics.STORE_VALUES: {"array(float32, 2d, C)", "array(float64, 2d, C)"},
        numerics.STORE_BFLOAT16: {"array(uint16, 2d, C)"},
        numerics.STORE_FLOAT16: {"array(uint16, 2d, C)"},
    }
    for stored, outs in expected.items():
        functions: list[Any] = [kernel.RANGE_INTO[stored], kernel.ROTATE_INTO[stored]]
        for function in functions:  # numba dispatchers: the out array is argument 6
            assert {str(signature[6]) for signature in function.signatures} == outs


def test_an_empty_kernel_cache_is_seeded_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed, cache = tmp_path / "seed", tmp_path / "run" / "numba-cache"
    (seed / "posenc_server").mkdir(parents=True)
    (seed / "posenc_server" / "kernel.nbi").write_bytes(b"index")
    monkeypatch.setenv(warmup.KERNEL_CACHE_SEED, str(seed))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    warmup.seed_kernel_cache()
    assert (cache / "posenc_server" / "kernel.nbi").read_bytes() == b"index"
    # A cache that holds anything is numba's own: left as it is.
    (cache / "posenc_server" / "kernel.nbi").write_bytes(b"numba's")
    warmup.seed_kernel_cache()
    assert (cache / "posenc_server" / "kernel.nbi").read_bytes() == b"numba's"
    assert [path.name for path in cache.parent.iterdir()] == ["numba-cache"]  # no leftovers


def test_an_unwritable_kernel_cache_is_left_to_numba(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "index").write_bytes(b"index")
    monkeypatch.setenv(warmup.KERNEL_CACHE_SEED, str(seed))
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/proc/posenc-numba-cache")  # no directory here
    warmup.seed_kernel_cache()  # no error: numba compiles, as without a seed
