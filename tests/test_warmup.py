"""The start-up warm-up: a table of every kind, with valid parameters, run in every dtype,
and every kernel specialization a call can need compiled before a server listens."""

from __future__ import annotations

from typing import Any

from posenc_server import kernel, warmup
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
    functions: list[Any] = [kernel.range_into, kernel.rotate_into]
    for function in functions:  # numba dispatchers
        outs = {str(signature[6]) for signature in function.signatures}
        for dtype in ("float32", "float64", "uint16"):
            assert f"array({dtype}, 2d, C)" in outs, (function, outs)
