"""Client memory: iter_range holds O(chunk), get_range about one copy of the result, and a
dropped large result's memory serves the next result without new page faults.

tracemalloc sees numpy's buffers and the SDK's result maps; the server runs in its own
process so that only the client's allocations and page faults are counted.
"""

from __future__ import annotations

import resource
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import pytest
from conftest import Spawn

import posenc

MIB = 1 << 20
T = TypeVar("T")


@pytest.fixture
def remote(spawn_server: Spawn) -> Iterator[posenc.Client]:
    """A client of a server in its own process: only the client's allocations and page
    faults are this process's."""
    with posenc.Client(spawn_server().target) as client:
        yield client


def traced_peak(call: Callable[[], T]) -> tuple[T, int]:
    """``call()`` and the peak of the memory tracemalloc sees while it runs."""
    tracemalloc.start()
    try:
        result = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_iter_range_memory_is_bounded_by_the_chunk_not_the_result(
    remote: posenc.Client,
) -> None:
    remote.get_range(0, 1, 8)  # connect before measuring
    # 256 MiB in 1 MiB chunks.
    rows, peak = traced_peak(
        lambda: sum(len(block) for _, block in remote.iter_range(0, 65536, 1024, timeout=None))
    )
    assert rows == 65536
    assert peak < 8 * MIB, f"iter_range peaked at {peak / MIB:.1f} MiB"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_get_range_holds_about_one_copy_of_the_result(remote: posenc.Client) -> None:
    remote.get_range(0, 1, 8)
    table, peak = traced_peak(lambda: remote.get_range(0, 32768, 1024, timeout=None))  # 128 MiB
    assert table.nbytes == 128 * MIB
    assert table.nbytes <= peak < 1.1 * table.nbytes, (
        f"get_range peaked at {peak / table.nbytes:.2f}x"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_growing_table_extends_into_its_new_buffer_without_another_copy(
    remote: posenc.Client,
) -> None:
    table = posenc.GrowingTable(remote, 1024, min_rows=16384, max_step_bytes=256 * MIB)
    table.reserve(16384)  # 64 MiB held
    # A new 128 MiB buffer: the old rows, then 64 MiB streamed in.
    _, peak = traced_peak(lambda: table.reserve(16385))
    grown = table.rows().nbytes
    assert grown == 128 * MIB
    assert peak < 1.1 * grown, f"the extension peaked at {peak / grown:.2f}x the new buffer"


def _resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_dropped_large_result_is_the_memory_of_the_next_one(
    remote: posenc.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote.get_range(0, 1, 8)

    def fetch(start: int) -> np.ndarray:
        return remote.get_range(start, start + 16384, 1024, timeout=None)  # 64 MiB

    # The first call of a width the client does not know yet tries a unary call first,
    # which the server refuses: that failure must not keep the result alive either.
    first = fetch(0)
    address = first.ctypes.data
    del first
    second = fetch(10**6)
    assert second.ctypes.data == address

    # A result still alive is never reused: the next one has memory of its own.
    kept = second.copy()
    third = fetch(2 * 10**6)
    assert not np.shares_memory(second, third)
    np.testing.assert_array_equal(second, kept)
    assert not np.array_equal(second, third)
    del second, third

    # Keeping none: a dropped result's memory goes back to the system at once.
    monkeypatch.setenv("POSENC_KEEP_RESULT_BYTES", "0")
    result = fetch(3 * 10**6)
    before = _resident_bytes()
    del result
    assert before - _resident_bytes() >= 60 * MIB


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kept_result_memory_goes_back_to_the_system_when_no_result_takes_it(
    remote: posenc.Client,
) -> None:
    result = remote.get_range(0, 16384, 1024, timeout=None)  # 64 MiB
    before = _resident_bytes()
    del result
    assert before - _resident_bytes() < 8 * MIB  # kept for the next result
    deadline = time.monotonic() + 30
    while before - _resident_bytes() < 60 * MIB:
        assert time.monotonic() < deadline, "the kept memory was never given back"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_large_results_have_their_dtype_and_rows(remote: posenc.Client, dtype: str) -> None:
    # 16,384 rows of 1024 are 32 MiB or more: the result lives in a map of its own.
    for _ in range(2):  # a new map, then the kept one
        large = remote.get_range(100, 100 + 16384, 1024, dtype=dtype, timeout=None)
        assert large.dtype.name == dtype and large.shape == (16384, 1024)
        np.testing.assert_array_equal(large[-3:], remote.get_range(16481, 16484, 1024, dtype=dtype))
        del large
