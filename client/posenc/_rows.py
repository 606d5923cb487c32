"""Rows the client already holds: read-ahead for decode loops, and a bounded cache of it.

A decode loop asks, at every step, for the next position of each sequence it generates. A
row depends only on (spec, position): the server sends the same bytes whichever request
carries it. So when a call asks for position ``p`` right after one that asked for ``p - 1``
(a sequence moving forward), it fetches ``p .. p + W - 1`` at once and keeps the extra
rows: that sequence's next ``W - 1`` steps need no call at all. ``W`` shrinks as more
sequences advance together, so that one call fetches at most ``readahead_bytes``; when
the step alone is that large, read-ahead would only move the same bytes in fewer, larger
calls, and calls go to the server as they are. Scattered positions are fetched as asked.

This module only plans and assembles; the clients make the calls (see ``RowPlan``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from posenc._protocol import DEFAULT_UNARY_MAX_BYTES, Query

DEFAULT_ROW_CACHE_BYTES = 64 << 20
# One default unary call. Measured on a 64-sequence step of 1 MiB, fetching several steps
# at once was slower per step than one call per step: read-ahead pays while the
# per-call cost outweighs the bytes.
DEFAULT_READAHEAD_BYTES = DEFAULT_UNARY_MAX_BYTES
# Further ahead than this, rows are more likely wasted (a sequence ends) than used.
MAX_READAHEAD_ROWS = 64
# Calls with more positions than this are batch work, not decode steps: they bypass the
# cache (so the server, not the cache, judges a list longer than its limit).
MAX_CACHED_CALL_ROWS = 4096
# Positions of recent calls remembered, to recognise sequences moving forward: this many
# per spec, for this many specs.
_RECENT_POSITIONS = 2 * MAX_CACHED_CALL_ROWS
_RECENT_SPECS = 8
_INT64_MAX = (1 << 63) - 1
# What an index entry costs beyond its row (dict slot, int key, tuple), counted in the budget.
_ENTRY_BYTES = 100

_Rows = np.ndarray[Any, np.dtype[Any]]


@dataclass(eq=False)
class _Batch:
    """The rows of one read-ahead fetch, all of one spec; cached and evicted as a unit."""

    key: bytes
    positions: list[int]
    rows: _Rows
    cost: int


_Entry = tuple[_Batch, int]  # a batch and the index of the row in it


class RowCache:
    """Read-ahead rows of ``get_positions`` calls by (spec, position), least recently used
    evicted first, within ``budget_bytes``. Thread-safe; it never calls the server."""

    def __init__(self, budget_bytes: int, readahead_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"row_cache_bytes must be >= 0, got {budget_bytes}")
        if readahead_bytes < 0:
            raise ValueError(f"readahead_bytes must be >= 0, got {readahead_bytes}")
        self.budget_bytes = budget_bytes
        self.readahead_bytes = readahead_bytes
        self._lock = threading.Lock()
        self._index: dict[bytes, dict[int, _Entry]] = {}
        # Per spec, most recent last: sets of positions asked for lately, oldest first.
        self._recent: OrderedDict[bytes, OrderedDict[int, None]] = OrderedDict()
        self._batches: OrderedDict[_Batch, None] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds now (rows and index), at most ``budget_bytes``."""
        with self._lock:
            return self._bytes

    def plan(self, query: Query) -> RowPlan | None:
        """How to answer a positions ``query``; None: send it to the server as it is."""
        positions = query.positions
        if (
            positions is None
            or not 0 < query.rows <= MAX_CACHED_CALL_ROWS
            or query.row_bytes == 0  # d_model 0: the server's error to give
            # One call may not flush the whole cache.
            or query.nbytes > self.budget_bytes // 4
        ):
            return None
        key = query.spec.SerializeToString(deterministic=True)
        wanted = positions.tolist()
        with self._lock:
            index = self._index.get(key, {})
            recent = self._recent.setdefault(key, OrderedDict())
            self._recent.move_to_end(key)
            if len(self._recent) > _RECENT_SPECS:
                self._recent.popitem(last=False)
            found = [index.get(position) for position in wanted]
            for batch in {entry[0] for entry in found if entry is not None}:
                self._batches.move_to_end(batch)
            missing = sorted({p for p, entry in zip(wanted, found, strict=True) if entry is None})
            advancing = np.array(
                [
                    (p - 1 in recent or p - 1 in index) and p <= _INT64_MAX - MAX_READAHEAD_ROWS
                    for p in missing
                ],
                dtype=bool,
            )
            recent.update(dict.fromkeys(wanted))
            while len(recent) > _RECENT_POSITIONS:
                recent.popitem(last=False)
        ahead = 1
        if advancing.any():
            fit = self.readahead_bytes // (int(advancing.sum()) * query.row_bytes)
            ahead = min(MAX_READAHEAD_ROWS, fit)
        if missing and ahead < 2:
            # Nothing to read ahead: the caller's own call costs less than fetching the
            # missing rows and assembling them with cached ones.
            return None
        starts = np.array(missing, dtype=np.int64)
        lengths = np.ones(len(missing), dtype=np.int64)
        if ahead >= 2:
            lengths[advancing] = ahead
        return RowPlan(self, query, key, found, starts, lengths)

    def _store(self, batch: _Batch) -> None:
        if batch.cost > self.budget_bytes:
            return
        with self._lock:
            while self._bytes + batch.cost > self.budget_bytes:
                self._evict(next(iter(self._batches)))
            self._batches[batch] = None
            self._bytes += batch.cost
            index = self._index.setdefault(batch.key, {})
            for row, position in enumerate(batch.positions):
                index[position] = (batch, row)

    def _evict(self, batch: _Batch) -> None:
        del self._batches[batch]
        self._bytes -= batch.cost
        index = self._index[batch.key]
        for position in batch.positions:
            entry = index.get(position)
            if entry is not None and entry[0] is batch:  # a newer batch may hold it now
                del index[position]
        if not index:
            del self._index[batch.key]


class RowPlan:
    """One ``get_positions`` call through the cache.

    The client fetches :attr:`fetch` (None when every row is cached), then calls
    :meth:`result` with the rows it got. Should that fetch fail with INVALID_ARGUMENT or
    RESOURCE_EXHAUSTED, the client makes the caller's own call instead: read-ahead may pass
    the server's position limit, and the server's error must name the caller's positions.
    """

    def __init__(
        self,
        cache: RowCache,
        query: Query,
        key: bytes,
        found: list[_Entry | None],
        starts: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
    ) -> None:
        self._cache = cache
        self._query = query
        self._key = key
        self._found = found
        self._reads_ahead = bool((lengths > 1).any())
        first_rows = np.cumsum(lengths) - lengths
        self._first_row_of = dict(zip(starts.tolist(), first_rows.tolist(), strict=True))
        self.fetch: Query | None = None
        if starts.size:
            total = int(lengths.sum())
            positions = np.repeat(starts, lengths) + (
                np.arange(total, dtype=np.int64) - np.repeat(first_rows, lengths)
            )
            self.fetch = dataclasses.replace(query, rows=total, positions=positions)

    def result(self, fetched: _Rows | None = None) -> _Rows:
        """The caller's rows, from the cache and ``fetched`` (the rows of :attr:`fetch`).

        A new array: callers may write to it without touching the cache.
        """
        entries = self._found
        if self.fetch is not None:
            assert fetched is not None and self.fetch.positions is not None
            positions = self.fetch.positions.tolist()
            batch = _Batch(
                self._key, positions, fetched, fetched.nbytes + _ENTRY_BYTES * len(positions)
            )
            if self._reads_ahead:
                self._cache._store(batch)
            assert self._query.positions is not None
            entries = [
                entry if entry is not None else (batch, self._first_row_of[position])
                for entry, position in zip(entries, self._query.positions.tolist(), strict=True)
            ]
        out = self._query.empty()
        groups: dict[_Batch, tuple[list[int], list[int]]] = {}
        for row, entry in enumerate(entries):
            assert entry is not None
            rows_out, rows_in = groups.setdefault(entry[0], ([], []))
            rows_out.append(row)
            rows_in.append(entry[1])
        for batch, (rows_out, rows_in) in groups.items():  # one numpy gather per batch
            out[rows_out] = batch.rows[rows_in]
        return out
