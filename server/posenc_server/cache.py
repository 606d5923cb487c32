"""A byte-bounded, thread-safe LRU cache of table blocks with single-flight computation."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

from posenc_protocol.stats import CacheStats


class Sized(Protocol):
    """What the cache needs of a block: its size."""

    @property
    def nbytes(self) -> int:
        """Bytes it holds."""
        ...


Key = TypeVar("Key", bound=Hashable)
Block = TypeVar("Block", bound=Sized)


class _Pending(Generic[Block]):
    """A computation in progress that other threads asking for the same key wait on: its
    ``running`` lock is held until it is over (a lock, not an Event: one is made for every
    block computed, and an Event is several Python objects)."""

    def __init__(self) -> None:
        self.running = threading.Lock()
        self.running.acquire()
        self.value: Block | None = None
        self.error: BaseException | None = None


class BlockCache(Generic[Key, Block]):
    """LRU cache of immutable blocks whose total ``nbytes`` never exceeds a budget.

    ``get_or_compute`` runs the computation outside the lock, and only once when several
    threads miss the same key at the same time: the others wait for that result instead of
    computing it again. A block larger than the whole budget is returned but not stored.
    """

    def __init__(self, budget_bytes: int, on_evict: Callable[[int], None] | None = None) -> None:
        """``on_evict`` is called with the size of every evicted block, under the cache's
        lock: it must be quick and must not use the cache."""
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self._budget = budget_bytes
        self._on_evict = on_evict
        self._blocks: OrderedDict[Key, Block] = OrderedDict()
        self._pending: dict[Key, _Pending[Block]] = {}
        self._lock = threading.Lock()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached now (neither counted nor made more recent)."""
        with self._lock:
            return key in self._blocks

    def cached_keys(self) -> list[Key]:
        """The keys cached now (neither counted nor made more recent)."""
        with self._lock:
            return list(self._blocks)

    def get(self, key: Key) -> Block | None:
        """The cached block for ``key`` (counted as a hit or a miss), or None."""
        with self._lock:
            block = self._hit(key)
            self._misses += block is None
            return block

    def lookup(self, key: Key) -> Block | None:
        """The cached block for ``key`` (counted as a hit), or None, counted as nothing: the
        caller's computation of it, if any, counts the miss."""
        with self._lock:
            return self._hit(key)

    def get_or_compute(self, key: Key, compute: Callable[[], Block]) -> Block:
        """The cached block for ``key``, computing and storing it on a miss."""
        with self._lock:
            block = self._hit(key)
            if block is not None:
                return block
            self._misses += 1
            pending = self._pending.get(key)
            owner = pending is None
            if pending is None:
                # Not _Pending[Block](): a subscript at run time costs a typing cache lookup.
                pending = self._pending[key] = _Pending()
        if not owner:
            with pending.running:  # until the computation is over
                pass
            if pending.error is not None:
                raise pending.error
            assert pending.value is not None
            return pending.value
        try:
            block = compute()
            pending.value = block
        except BaseException as error:
            pending.error = error
            raise
        finally:
            with self._lock:
                del self._pending[key]
                if pending.value is not None:
                    self._store(key, pending.value)
            pending.running.release()
        return block

    def _hit(self, key: Key) -> Block | None:
        # Called with the lock held: the block, made the most recent and counted, or None.
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
            self._hits += 1
        return block

    def _store(self, key: Key, block: Block) -> None:
        # Called with the lock held.
        size = block.nbytes
        if size > self._budget:
            return
        old = self._blocks.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        while self._bytes + size > self._budget:
            _, evicted = self._blocks.popitem(last=False)
            self._bytes -= evicted.nbytes
            self._evictions += 1
            if self._on_evict is not None:
                self._on_evict(evicted.nbytes)
        self._blocks[key] = block
        self._bytes += size

    def stats(self) -> CacheStats:
        """Counters since creation, and what is held now."""
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                bytes=self._bytes,
                entries=len(self._blocks),
                budget_bytes=self._budget,
            )
