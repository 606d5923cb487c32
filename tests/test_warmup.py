"""The start-up warm-up: a table of every kind, with valid parameters, run in every dtype,
and every kernel specialization a call can need compiled before a server listens."""

from __future__ import annotations

from typing import Any

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
