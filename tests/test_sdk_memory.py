"""Client memory: iter_range holds O(chunk), get_range about one copy of the result.

tracemalloc sees numpy's buffers; the server runs in its own process so that only the
client's allocations are counted.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
from conftest import ServerProcess

import posenc

MIB = 1 << 20


@pytest.mark.timeout(120)
def test_iter_range_memory_is_bounded_by_the_chunk_not_the_result(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    process = spawn_server()
    with posenc.Client(process.target) as client:
        client.get_range(0, 1, 8)  # connect before measuring
        tracemalloc.start()
        try:
            rows = 0
            # 256 MiB in 1 MiB chunks.
            for _, block in client.iter_range(0, 65536, 1024, timeout=None):
                rows += len(block)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert rows == 65536
    assert peak < 8 * MIB, f"iter_range peaked at {peak / MIB:.1f} MiB"


@pytest.mark.timeout(120)
def test_get_range_holds_about_one_copy_of_the_result(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    process = spawn_server()
    with posenc.Client(process.target) as client:
        client.get_range(0, 1, 8)
        tracemalloc.start()
        try:
            table = client.get_range(0, 32768, 1024, timeout=None)  # 128 MiB
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert table.nbytes == 128 * MIB
    assert peak < 1.1 * table.nbytes, f"get_range peaked at {peak / table.nbytes:.2f}x"


@pytest.mark.timeout(120)
def test_a_growing_table_extends_into_its_new_buffer_without_another_copy(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    process = spawn_server()
    with posenc.Client(process.target) as client:
        table = posenc.GrowingTable(client, 1024, min_rows=16384, max_step_bytes=256 * MIB)
        table.reserve(16384)  # 64 MiB held
        tracemalloc.start()
        try:
            table.reserve(16385)  # a new 128 MiB buffer: the old rows, then 64 MiB streamed in
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    grown = table.rows().nbytes
    assert grown == 128 * MIB
    assert peak < 1.1 * grown, f"the extension peaked at {peak / grown:.2f}x the new buffer"
