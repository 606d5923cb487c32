"""The block cache on its own: LRU order, byte budget, counters, single flight."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from posenc_server.cache import BlockCache

Array = np.ndarray


def block(nbytes: int, fill: int = 0) -> np.ndarray:
    return np.full(nbytes, fill, dtype=np.uint8)


def test_hits_misses_and_bytes_are_counted() -> None:
    cache: BlockCache[str, Array] = BlockCache(1000)
    assert cache.get("a") is None
    first = cache.get_or_compute("a", lambda: block(100, 1))
    again = cache.get_or_compute("a", lambda: pytest.fail("recomputed a cached block"))
    assert again is first
    assert cache.get("a") is first
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions) == (2, 2, 0)
    assert (stats.bytes, stats.entries, stats.budget_bytes) == (100, 1, 1000)


def test_membership_is_neither_counted_nor_made_recent() -> None:
    cache: BlockCache[int, Array] = BlockCache(200)
    for key in range(2):
        cache.get_or_compute(key, lambda: block(100))
    assert 0 in cache and 5 not in cache
    cache.get_or_compute(2, lambda: block(100))  # evicts 0: `in` did not make it recent
    assert 0 not in cache and 1 in cache and 2 in cache
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (0, 3)


def test_evictions_are_reported_with_their_sizes() -> None:
    evicted: list[int] = []
    cache: BlockCache[int, Array] = BlockCache(250, on_evict=evicted.append)
    for key, size in enumerate((100, 120, 90, 200)):
        cache.get_or_compute(key, lambda size=size: block(size))
    # 90 evicts 100; 200 evicts 120 and 90.
    assert evicted == [100, 120, 90]


def test_least_recently_used_is_evicted_first_and_budget_holds() -> None:
    cache: BlockCache[int, Array] = BlockCache(300)
    for key in range(3):
        cache.get_or_compute(key, lambda: block(100))
    cache.get(0)  # 0 becomes most recent; 1 is now the oldest
    cache.get_or_compute(3, lambda: block(100))
    assert cache.get(1) is None
    assert all(cache.get(key) is not None for key in (0, 2, 3))
    stats = cache.stats()
    assert stats.evictions == 1 and stats.bytes == 300 and stats.entries == 3


def test_a_block_larger_than_the_budget_is_returned_but_not_stored() -> None:
    cache: BlockCache[str, Array] = BlockCache(50)
    cache.get_or_compute("small", lambda: block(40))
    big = cache.get_or_compute("big", lambda: block(100))
    assert big.nbytes == 100
    assert cache.get("big") is None
    assert cache.get("small") is not None
    assert cache.stats().bytes == 40


def test_concurrent_misses_on_one_key_compute_once() -> None:
    cache: BlockCache[str, Array] = BlockCache(1000)
    calls = 0

    def slow() -> np.ndarray:
        nonlocal calls
        calls += 1
        time.sleep(0.2)
        return block(10)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: cache.get_or_compute("k", slow), range(8)))
    assert calls == 1
    assert all(result is results[0] for result in results)


def test_a_failed_computation_raises_in_every_waiter_and_is_not_cached() -> None:
    cache: BlockCache[str, Array] = BlockCache(1000)

    def broken() -> np.ndarray:
        time.sleep(0.1)
        raise RuntimeError("boom")

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(cache.get_or_compute, "k", broken) for _ in range(4)]
        for future in futures:
            with pytest.raises(RuntimeError, match="boom"):
                future.result()
    assert cache.get_or_compute("k", lambda: block(5)).nbytes == 5


def test_many_threads_never_exceed_the_budget() -> None:
    cache: BlockCache[int, Array] = BlockCache(10_000)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 200, size=2000)

    def work(key: int) -> None:
        cache.get_or_compute(int(key), lambda: block(int(key) % 7 * 100 + 100))
        assert cache.stats().bytes <= 10_000

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, keys))
    stats = cache.stats()
    assert stats.bytes <= 10_000
    assert stats.hits + stats.misses == 2000
    assert stats.evictions > 0


def test_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError):
        BlockCache(-1)
