"""The start-up warm-up: a table of every kind, with valid parameters, run in every dtype,
every kernel specialization a call can need compiled, and the cache's memory faulted in,
before a server listens."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ServerProcess

import posenc
from posenc_server import heap, kernel, numerics, warmup
from posenc_server.config import ServerConfig
from posenc_server.tables import KINDS

MIB = 1 << 20


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


def test_what_start_up_leaves_alive_is_frozen_out_of_the_collectors_walks() -> None:
    warmup.warm_up()
    kernels = kernel.RANGE_INTO[numerics.STORE_BFLOAT16]
    assert gc.is_tracked(kernels)
    try:
        warmup.freeze()
        assert gc.get_freeze_count() > 10_000
        # Frozen objects are in no generation a collection walks.
        assert not any(found is kernels for found in gc.get_objects())
        made_since = [[index] for index in range(100)]
        assert sum(found is made_since for found in gc.get_objects()) == 1
    finally:
        gc.unfreeze()


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


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_fresh_servers_first_calls_fault_in_no_cache_memory(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    # The cache's budget is faulted in before the server listens: its first cold calls
    # fill the cache without a page fault per page of it.
    server = spawn_server(0, "--cache-bytes", str(64 * MIB))
    with posenc.Client(server.target) as client:
        client.server_info()
        before = _minor_faults(server.process.pid)
        rows = client.get_range(10**6, 10**6 + 8192, 2048)  # 64 MiB of new blocks
        faults = _minor_faults(server.process.pid) - before
    assert rows.nbytes == 64 * MIB
    assert faults * heap.PAGE_BYTES < rows.nbytes // 8, faults
