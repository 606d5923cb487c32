"""Streams survive a server killed with SIGKILL mid-stream and restarted on the same port;
calls survive a replica restarted with SIGTERM under load.

Each test starts a server subprocess, starts a large stream through small chunks, kills the
server once it is well into the table, restarts it on the same port and checks the call
still returns exactly the table. On a loaded machine a restart can outlast the default retry
budget (about 5 s): these clients retry for up to a minute, so that the test decides on
resuming, not on how fast the machine starts a server. The restarted
server computing fewer rows than the table holds proves the stream resumed rather than
started over.
"""

from __future__ import annotations

import asyncio
import signal
import threading
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
# Retries of 2 s at most after the first few: about a minute.
RETRIES = 32

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
    with posenc.Client(
        server.target, chunk_bytes=CHUNK_BYTES, max_retries=RETRIES, timeout=120
    ) as client:
        table = client.get_range(0, ROWS, D_MODEL)
    check_resumed(restart.result(timeout=60), table, ROWS)


def test_get_positions_resumes_after_kill(spawn_server: Spawn) -> None:
    rows = ROWS // 4
    positions = np.random.default_rng(1).permutation(rows)
    server = spawn_server(free_port())
    restart = kill_and_restart_when(spawn_server, server, rows // 8)
    with posenc.Client(
        server.target, chunk_bytes=CHUNK_BYTES, max_retries=RETRIES, timeout=120
    ) as client:
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
    with posenc.Client(
        server.target, chunk_bytes=CHUNK_BYTES, max_retries=RETRIES, timeout=120
    ) as client:
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
            server.target, chunk_bytes=CHUNK_BYTES, max_retries=RETRIES, timeout=120
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
            server.target, chunk_bytes=CHUNK_BYTES, max_retries=RETRIES, timeout=120
        ) as client:
            async for first, block in client.iter_range(0, rows, D_MODEL):
                assert first == expected
                table[first : first + len(block)] = block
                expected += len(block)
        assert expected == rows
        return table

    table = asyncio.run(fetch())
    check_resumed(restart.result(timeout=60), table, rows)


def test_calls_racing_a_server_stop_are_retried(spawn_server: Spawn) -> None:
    """A server that stops (SIGTERM: it drains, then stops) fails the calls reaching it in
    the instant it stops with CANCELLED (gRPC cancels the calls it had not yet handed to
    a handler): they never ran, and the SDK retries them like UNAVAILABLE ones. Here a
    replica of two restarts four times under six threads of decode-sized calls, and no
    call is lost."""
    steady = spawn_server()
    restarting = spawn_server()
    port = restarting.port
    failures: list[str] = []
    calls = 0
    done = threading.Event()

    def load(seed: int) -> None:
        nonlocal calls
        rng = np.random.default_rng(seed)
        targets = [steady.target, f"127.0.0.1:{port}"]
        with posenc.Client(targets, row_cache_bytes=0, timeout=30) as client:
            while not done.is_set():
                positions = rng.integers(0, 1 << 30, 4)
                try:
                    rows = client.get_positions(positions, 64)
                    assert rows.shape == (4, 64)
                    calls += 1
                except Exception as error:
                    failures.append(repr(error))

    threads = [threading.Thread(target=load, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(4):
            time.sleep(0.5)
            restarting.process.send_signal(signal.SIGTERM)
            restarting.process.wait(30)
            restarting = spawn_server(port)
        time.sleep(0.5)
    finally:
        done.set()
        for thread in threads:
            thread.join(60)
    print(f"{calls} calls over 4 restarts, {len(failures)} failed")
    assert failures == []
    assert calls > 100
