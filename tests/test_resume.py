"""Streams survive a server killed with SIGKILL mid-stream and restarted on the same port.

Each test starts a server subprocess, starts a large stream through small chunks, kills the
server once it is well into the table, restarts it on the same port (1-3 s, covered by the
default retry budget) and checks the call still returns exactly the table. The restarted
server computing fewer rows than the table holds proves the stream resumed rather than
started over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from conftest import ServerProcess, free_port

import posenc

ROWS = 1 << 20
D_MODEL = 256  # 1 GiB of float32
CHUNK_BYTES = 64 << 10

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

Spawn = Callable[..., ServerProcess]


def rows_computed(target: str) -> int:
    with posenc.Client(target, max_retries=0, timeout=5) as client:
        return client.server_info().rows_computed


def kill_and_restart_when(
    spawn_server: Spawn, server: ServerProcess, rows: int
) -> Future[ServerProcess]:
    """In the background: once ``server`` computed ``rows`` rows, SIGKILL it and start a new
    one on the same port. The future holds the new server."""

    def run() -> ServerProcess:
        deadline = time.monotonic() + 60
        while rows_computed(server.target) < rows:
            assert time.monotonic() < deadline, "the stream never got going"
            time.sleep(0.02)
        server.kill()
        return spawn_server(server.port)

    executor = ThreadPoolExecutor(1)
    future = executor.submit(run)
    executor.shutdown(wait=False)
    return future


def check_resumed(restarted: ServerProcess, table: np.ndarray[Any, Any], rows: int) -> None:
    # Fewer rows computed after the restart than the table holds: the second call asked
    # only for what was missing.
    assert 0 < rows_computed(restarted.target) < rows
    with posenc.Client(restarted.target, timeout=120) as client:
        fresh = client.get_range(0, rows, D_MODEL)
    assert table.shape == fresh.shape
    assert np.array_equal(table, fresh)


@pytest.mark.slow  # a GiB through a killed and restarted server
def test_get_range_resumes_after_kill(spawn_server: Spawn) -> None:
    server = spawn_server(free_port())
    restart = kill_and_restart_when(spawn_server, server, ROWS // 8)
    with posenc.Client(server.target, chunk_bytes=CHUNK_BYTES, timeout=120) as client:
        table = client.get_range(0, ROWS, D_MODEL)
    check_resumed(restart.result(timeout=60), table, ROWS)


def test_get_positions_resumes_after_kill(spawn_server: Spawn) -> None:
    rows = ROWS // 4
    positions = np.random.default_rng(1).permutation(rows)
    server = spawn_server(free_port())
    restart = kill_and_restart_when(spawn_server, server, rows // 8)
    with posenc.Client(server.target, chunk_bytes=CHUNK_BYTES, timeout=120) as client:
        table = client.get_positions(positions, D_MODEL)
    restarted = restart.result(timeout=60)
    assert 0 < rows_computed(restarted.target) < rows
    with posenc.Client(restarted.target, timeout=120) as client:
        fresh = client.get_range(0, rows, D_MODEL)
    assert np.array_equal(table, fresh[positions])


def test_iter_range_resumes_after_kill(spawn_server: Spawn) -> None:
    rows = ROWS // 4
    server = spawn_server(free_port())
    restart = kill_and_restart_when(spawn_server, server, rows // 8)
    table = np.empty((rows, D_MODEL), dtype=np.float32)
    expected = 0
    with posenc.Client(server.target, chunk_bytes=CHUNK_BYTES, timeout=120) as client:
        for first, block in client.iter_range(0, rows, D_MODEL):
            assert first == expected  # no gap, no repeat across the restart
            table[first : first + len(block)] = block
            expected += len(block)
    assert expected == rows
    check_resumed(restart.result(timeout=60), table, rows)


def test_async_get_range_resumes_after_kill(spawn_server: Spawn) -> None:
    rows = ROWS // 2  # the sync test covers the full size
    server = spawn_server(free_port())
    restart = kill_and_restart_when(spawn_server, server, rows // 8)

    async def fetch() -> np.ndarray[Any, Any]:
        async with posenc.AsyncClient(
            server.target, chunk_bytes=CHUNK_BYTES, timeout=120
        ) as client:
            return await client.get_range(0, rows, D_MODEL)

    table = asyncio.run(fetch())
    check_resumed(restart.result(timeout=60), table, rows)


def test_async_iter_range_resumes_after_kill(spawn_server: Spawn) -> None:
    rows = ROWS // 4
    server = spawn_server(free_port())
    restart = kill_and_restart_when(spawn_server, server, rows // 8)

    async def fetch() -> np.ndarray[Any, Any]:
        table = np.empty((rows, D_MODEL), dtype=np.float32)
        expected = 0
        async with posenc.AsyncClient(
            server.target, chunk_bytes=CHUNK_BYTES, timeout=120
        ) as client:
            async for first, block in client.iter_range(0, rows, D_MODEL):
                assert first == expected
                table[first : first + len(block)] = block
                expected += len(block)
        assert expected == rows
        return table

    table = asyncio.run(fetch())
    check_resumed(restart.result(timeout=60), table, rows)
