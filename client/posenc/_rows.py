"""Rows the client already holds: read-ahead for decode loops, and a bounded cache of it.

A decode loop asks, at every step, for the next position of each sequence it generates. A
row depends only on (spec, position): the server sends the same bytes whichever request
carries it. So when a call asks for position ``p`` right after one that asked for ``p - 1``
(a sequence moving forward), it fetches ``p .. p + W - 1`` at once and keeps the extra
rows: that sequence's next ``W - 1`` steps need no call at all. ``W`` shrinks as more
sequences advance together, so that one call fetches at most ``readahead_bytes``; when
the step alone is that large, read-ahead would only move the same bytes in fewer, larger
calls, and calls go to the server as they are. Scattered positions are fetched as asked.

After each call, the clients also fetch in the background the next rows of every sequence
moving forward whose cached rows run short (the next windows, at least ``LEAD_STEPS``
steps ahead; for large steps a step a fetch): a loop that does anything between steps (a
model's forward pass) then finds its rows cached. A call that needs rows still in flight
waits for them (``Pending``).

This module only plans and assembles; :mod:`posenc._core` makes the calls (see ``RowPlan``
and ``AheadFetch``). Rows are counted in bytes, so a table is cached once its width is
known: from a response, the first of each table going to the server as asked.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from posenc._channel import DEFAULT_UNARY_MAX_BYTES
from posenc._checks import INT64_MAX
from posenc._query import Query, distinct

DEFAULT_ROW_CACHE_BYTES = 64 << 20
# One default unary call: read-ahead pays while a call's fixed cost outweighs its bytes;
# past that size the bytes dominate, and fetching several steps at once saves nothing.
DEFAULT_READAHEAD_BYTES = DEFAULT_UNARY_MAX_BYTES
# Further ahead than this, rows are more likely wasted (a sequence ends) than used.
MAX_READAHEAD_ROWS = 64
#: Steps that a sequence's rows are fetched ahead at least, whatever the window: the time of
#: this many of the loop's steps (5 ms of model time each, say) for a background fetch to
#: land. With a lead of one step, a step waits whenever its fetch takes longer than the
#: model's time between two steps (a busy server, a block to compute).
LEAD_STEPS = 4
# Calls with more positions than this are batch work, not decode steps: they bypass the
# cache (so the server, not the cache, judges a list longer than its limit).
MAX_CACHED_CALL_ROWS = 4096
# Positions of recent calls remembered, to recognise sequences moving forward: this many
# per spec, for this many specs.
_RECENT_POSITIONS = 2 * MAX_CACHED_CALL_ROWS
_RECENT_SPECS = 8
# What an index entry costs beyond its row (dict slot, int key, tuple), counted in the budget.
_ENTRY_BYTES = 100
# Batches of a spec that a lookup tries, newest first: a decode step's rows are all in the
# window fetched last, or the one before while a window's successor is landing.
_LOOKUP_BATCHES = 4

_Rows = np.ndarray[Any, np.dtype[Any]]


class _Batch:
    """The rows of one read-ahead fetch, all of one spec; cached and evicted as a unit.

    A fetch asks for distinct positions in ascending order, so row ``i`` is the row of
    ``held[i]``: a lookup is a binary search of ``held``, without an index. ``covered[i]``
    says whether the batch holds the row ``lead`` positions after ``held[i]`` too; the
    first step that finds a row of it not covered claims the next rows (``claimed``).
    """

    __slots__ = ("claimed", "cost", "covered", "held", "key", "positions", "rows")

    def __init__(self, key: bytes, held: npt.NDArray[np.int64], rows: _Rows) -> None:
        self.key = key
        self.held = held
        self.positions: list[int] = held.tolist()
        self.rows = rows
        self.cost = rows.nbytes + _ENTRY_BYTES * len(self.positions)
        self.covered = np.zeros(len(self.positions), dtype=bool)
        self.claimed = False

    def cover(self, lead: int) -> None:
        """Works out ``covered`` for read-ahead ``lead`` rows (before the batch is shared)."""
        ahead = np.minimum(np.arange(len(self.held)) + lead, len(self.held) - 1)
        self.covered = self.held[ahead] == self.held + lead


_Entry = tuple[_Batch, int]  # a batch and the index of the row in it


@dataclass(frozen=True, eq=False)
class Pending:
    """Rows a call needs are being fetched in the background: wait for ``tokens`` (the
    clients' futures), then plan again."""

    tokens: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class AheadFetch:
    """A background fetch of rows ahead, in flight under ``token`` until
    :meth:`RowCache.finish_ahead`."""

    query: Query
    key: bytes
    token: Any


@dataclass(frozen=True, eq=False)
class AheadClaim:
    """The background fetches a decode step calls for (:meth:`RowCache.claim_ahead` of
    ``query``), claimed off the caller's path: by the client's read-ahead thread or task,
    once the step has returned."""

    query: Query


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
        # Per spec: positions being fetched (in the background, or ahead by a caller's own
        # call), and the token of each fetch.
        self._in_flight: dict[bytes, dict[int, Any]] = {}
        # What :meth:`lookup` reads without the lock: per spec, its newest batches (a tuple,
        # replaced whole under the lock, so a reader sees one or the other).
        self._newest: dict[bytes, tuple[_Batch, ...]] = {}

    @property
    def in_flight(self) -> int:
        """How many rows are being fetched now (in the background, or ahead by a call)."""
        with self._lock:
            return sum(len(positions) for positions in self._in_flight.values())

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds now (rows and index), at most ``budget_bytes``."""
        with self._lock:
            return self._bytes

    def lookup(self, key: bytes, positions: npt.NDArray[np.int64]) -> tuple[_Rows, bool] | None:
        """The rows of ``positions`` (flat, int64) of spec ``key`` as a new array, when one of
        the spec's newest batches holds them all, and whether a read-ahead claim is due;
        None otherwise: the caller plans (:meth:`plan`).

        The decode loop's path: no lock and no index, a binary search of a batch and one
        gather, so that a step whose rows are cached costs a few numpy calls. A batch is
        never changed once stored, and a row depends only on (spec, position): a batch
        evicted while it is read still holds the right rows.

        A claim is due at the first step whose rows are within the lead of their window's
        end (:meth:`claim_ahead` fetches the next rows then), once a batch: the steps
        between wake no thread.
        """
        newest = self._newest.get(key, ())
        # First the batch holding the first position (a dict read: atomic under the GIL), so
        # that a step whose window is not among the newest (a lead of several windows,
        # landed ahead of it) is still a lookup.
        first = self._index.get(key, {}).get(positions.item(0))
        if first is not None:
            newest = (first[0], *newest)
        if positions.size == 1:  # one sequence: a bisection of the list, no array calls
            position = positions.item()
            for batch in newest:
                row = bisect.bisect_left(batch.positions, position)
                if row < len(batch.positions) and batch.positions[row] == position:
                    due = not batch.claimed and not batch.covered[row]
                    batch.claimed |= due
                    return batch.rows[row : row + 1].copy(), due
            return None
        wanted = positions.tobytes()
        for batch in newest:
            held = batch.held
            rows = held.searchsorted(positions)
            # Bytes compared: fewer numpy calls than == and all() (clip: the rows checked).
            if held.take(rows, mode="clip").tobytes() == wanted:
                due = not batch.claimed and b"\x00" in batch.covered.take(rows).tobytes()
                batch.claimed |= due
                return batch.rows.take(rows, axis=0, mode="clip"), due
        return None

    def _lead(self, moving: int, row_bytes: int) -> tuple[int, int]:
        """The read-ahead window and lead of ``moving`` sequences of rows of ``row_bytes``
        (see :meth:`claim_ahead`)."""
        window = max(1, min(MAX_READAHEAD_ROWS, self.readahead_bytes // (moving * row_bytes)))
        # Steps ahead held at most a quarter of the cache: a lead of huge steps would
        # evict the rows it fetched before they are used.
        lead = max(window // 2, min(LEAD_STEPS, self.budget_bytes // (4 * moving * row_bytes)), 1)
        return window, lead

    def _steps(self, query: Query) -> bool:
        """Whether ``query`` may be a decode step: a short list, with read-ahead on."""
        return (
            query.positions is not None
            and 0 < query.rows <= MAX_CACHED_CALL_ROWS
            # Only read-ahead puts rows in the cache.
            and self.readahead_bytes > 0
            and self.budget_bytes > 0
        )

    def cacheable(self, query: Query) -> bool:
        """Whether ``query`` is a decode step whose rows the cache may hold (and so read
        ahead of)."""
        return (
            self._steps(query)
            and bool(query.row_bytes)  # the width is known (and not 0, the server's error)
            # One call may not flush the whole cache.
            and (query.nbytes or 0) <= self.budget_bytes // 4
        )

    def plan(
        self, query: Query, *, wait: bool = True, new_token: Callable[[], Any] = object
    ) -> RowPlan | Pending | None:
        """How to answer a positions ``query``; None: send it to the server as it is.

        ``Pending`` when some of its rows are being fetched (unless ``wait`` is false: the
        call then fetches them itself). A plan that fetches has its rows in flight under a
        token from ``new_token`` until :meth:`RowPlan.release`, as a background fetch's are:
        other calls wait for them, and background claims leave them out.
        """
        if not self._steps(query):
            return None
        assert query.positions is not None
        key = query.spec_key
        wanted = query.positions.tolist()
        with self._lock:
            index = self._index.get(key, {})
            in_flight = self._in_flight.get(key)
            # Before the width is known too: a prefetch of a new spec may be on its way.
            if wait and in_flight:
                tokens = {in_flight[p] for p in wanted if p not in index and p in in_flight}
                if tokens:
                    return Pending(tuple(tokens))
            if not self.cacheable(query):
                if query.columns is None:
                    # The first call of a spec (its width still unknown) goes out as
                    # asked, but counts as a step: the next one may read ahead.
                    self._add_recent(self._recent_of(key), wanted)
                return None
            recent = self._recent_of(key)
            found = [index.get(position) for position in wanted]
            for batch in {entry[0] for entry in found if entry is not None}:
                self._batches.move_to_end(batch)
            missing = sorted({p for p, entry in zip(wanted, found, strict=True) if entry is None})
            advancing = np.array(
                [
                    (p - 1 in recent or p - 1 in index) and p <= INT64_MAX - MAX_READAHEAD_ROWS
                    for p in missing
                ],
                dtype=bool,
            )
            self._add_recent(recent, wanted)
        ahead = 1
        if advancing.any():
            assert query.row_bytes is not None  # cacheable
            fit = self.readahead_bytes // (int(advancing.sum()) * query.row_bytes)
            ahead = min(MAX_READAHEAD_ROWS, fit)
        if missing and ahead < 2:
            # Nothing to read ahead: the caller's own call costs less than fetching the
            # missing rows and assembling them with cached ones.
            return None
        starts = np.array(missing, dtype=np.int64)
        lengths = np.ones(len(missing), dtype=np.int64)
        lengths[advancing] = ahead
        plan = RowPlan(self, query, key, found, starts, lengths, new_token())
        if plan.fetch is not None:
            assert plan.fetch.positions is not None
            with self._lock:
                in_flight = self._in_flight.setdefault(key, {})
                for position in plan.fetch.positions.tolist():
                    in_flight.setdefault(position, plan.token)
        return plan

    def _recent_of(self, key: bytes) -> OrderedDict[int, None]:
        """The positions asked for lately of spec ``key`` (under the lock)."""
        recent = self._recent.setdefault(key, OrderedDict())
        self._recent.move_to_end(key)
        if len(self._recent) > _RECENT_SPECS:
            self._recent.popitem(last=False)
        return recent

    @staticmethod
    def _add_recent(recent: OrderedDict[int, None], positions: list[int]) -> None:
        recent.update(dict.fromkeys(positions))
        while len(recent) > _RECENT_POSITIONS:
            recent.popitem(last=False)

    def claim_ahead(self, query: Query, new_token: Callable[[], Any]) -> list[AheadFetch]:
        """What to fetch in the background after ``query``, nearest rows first: for each of
        its positions ``p`` that moves forward, the rows up to ``p + lead`` that are neither
        cached nor in flight, in windows. Each fetch's positions are in flight under a token
        from ``new_token`` (the client's future) until :meth:`finish_ahead`. Empty when
        nothing needs fetching.

        A window is what ``readahead_bytes`` holds of every moving sequence (at most 64
        rows); the lead is half a window, and at least :data:`LEAD_STEPS` steps (fewer when
        they would take more than a quarter of the cache). Steps too
        large for more than a row a window (64 sequences of 16 KiB rows in 1 MiB) thus
        still have their next rows fetched several steps before they are needed, a window
        a fetch: a fetch that takes longer than the model's time between two steps (a
        busy server, a block to compute) delays no step.
        """
        if not self.cacheable(query):
            return []
        assert query.positions is not None
        key = query.spec_key
        with self._lock:
            recent = self._recent.get(key, OrderedDict())
            index = self._index.get(key, {})
            in_flight = self._in_flight.get(key, {})
            # A position whose predecessor was asked for, or is cached: steps served by
            # lookup() leave no trace in ``recent``, but their rows came from read-ahead.
            moving = [
                p
                for p in set(query.positions.tolist())
                if (p - 1 in recent or p - 1 in index) and p <= INT64_MAX - 2 * MAX_READAHEAD_ROWS
            ]
            if not moving:
                return []
            assert query.row_bytes is not None  # cacheable
            window, lead = self._lead(len(moving), query.row_bytes)
            # Per position to fetch, the window it falls in (0: the nearest rows).
            layer_of: dict[int, int] = {}
            # Steps too large for a lead of one window refill a lead's worth at once, so
            # that the fetch's fixed cost is paid once for several windows (see
            # Core.fetch_aheads: they land one by one).
            refill = lead if window < lead else 0
            for p in moving:
                probe = p + lead
                if probe in index or probe in in_flight:
                    continue
                start = p + 1
                while start < probe and (start in index or start in in_flight):
                    start += 1
                for offset in range(max(window, probe + refill + 1 - start)):
                    position = start + offset
                    # Windows of nearby sequences overlap: each row once, in its nearest.
                    layer = min(offset // window, layer_of.get(position, offset // window))
                    layer_of[position] = layer
            if not layer_of:
                return []
            layers: dict[int, list[int]] = {}
            for position, layer in layer_of.items():
                layers.setdefault(layer, []).append(position)
            in_flight = self._in_flight.setdefault(key, in_flight)
            fetches = []
            for layer in sorted(layers):
                positions = np.array(sorted(layers[layer]), dtype=np.int64)
                token = new_token()
                for position in layers[layer]:
                    in_flight.setdefault(position, token)
                fetch = dataclasses.replace(
                    query, rows=positions.size, positions=positions, out=None
                )
                fetches.append(AheadFetch(fetch, key, token))
        return fetches

    def claim_prefetch(self, query: Query, new_token: Callable[[], Any]) -> list[AheadFetch]:
        """A background fetch of the rows of ``query`` that are neither cached nor in flight
        (none when the query is not a decode step's, or every row is there): the caller
        knows which rows its next step needs, as a dynamic-NTK loop knows its next table."""
        if not self._steps(query):
            return []
        assert query.positions is not None
        key = query.spec_key
        with self._lock:
            index = self._index.get(key, {})
            in_flight = self._in_flight.setdefault(key, {})
            wanted = sorted(
                {p for p in query.positions.tolist() if p not in index and p not in in_flight}
            )
            if not wanted:
                if not in_flight:
                    del self._in_flight[key]
                return []
            token = new_token()
            in_flight.update(dict.fromkeys(wanted, token))
        positions = np.array(wanted, dtype=np.int64)
        fetch = dataclasses.replace(query, rows=positions.size, positions=positions, out=None)
        return [AheadFetch(fetch, key, token)]

    def finish_ahead(self, ahead: AheadFetch, rows: _Rows | None) -> None:
        """A background fetch ended: its rows (None: it failed) join the cache, and its
        positions are no longer in flight. The client then completes its token."""
        assert ahead.query.positions is not None
        positions = ahead.query.positions.tolist()
        if rows is not None:
            self._store(_Batch(ahead.key, ahead.query.positions, rows))
        self._landed(ahead.key, positions, ahead.token)

    def _landed(self, key: bytes, positions: list[int], token: Any) -> None:
        """The fetch of ``token`` ended: its ``positions`` are no longer in flight."""
        with self._lock:
            in_flight = self._in_flight.get(key, {})
            for position in positions:
                if in_flight.get(position) is token:
                    del in_flight[position]
            if not in_flight:
                self._in_flight.pop(key, None)

    def _store(self, batch: _Batch) -> None:
        if batch.cost > self.budget_bytes:
            return
        if batch.rows.shape[1] and len(batch.positions):
            # Its sequences: runs of consecutive positions (the windows fetched).
            runs = 1 + int(np.count_nonzero(np.diff(batch.held) != 1))
            batch.cover(self._lead(runs, batch.rows.shape[1] * batch.rows.dtype.itemsize)[1])
        with self._lock:
            while self._bytes + batch.cost > self.budget_bytes:
                self._evict(next(iter(self._batches)))
            self._batches[batch] = None
            self._bytes += batch.cost
            index = self._index.setdefault(batch.key, {})
            for row, position in enumerate(batch.positions):
                index[position] = (batch, row)
            newest = self._newest.get(batch.key, ())
            self._newest[batch.key] = (batch, *newest[: _LOOKUP_BATCHES - 1])

    def _evict(self, batch: _Batch) -> None:
        del self._batches[batch]
        self._bytes -= batch.cost
        newest = tuple(kept for kept in self._newest.get(batch.key, ()) if kept is not batch)
        if newest:
            self._newest[batch.key] = newest
        else:
            self._newest.pop(batch.key, None)
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
    :meth:`result` with the rows it got, or :meth:`release` if the fetch failed; then it
    completes :attr:`token`, which calls waiting for these rows wait on. Should that fetch
    fail with INVALID_ARGUMENT or RESOURCE_EXHAUSTED, the client makes the caller's own call
    instead: read-ahead may pass the server's position limit, and the server's error must
    name the caller's positions.
    """

    def __init__(
        self,
        cache: RowCache,
        query: Query,
        key: bytes,
        found: list[_Entry | None],
        starts: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        token: Any,
    ) -> None:
        self._cache = cache
        self._query = query
        self._key = key
        self.token = token
        self._found = found
        self.fetch: Query | None = None
        if starts.size:
            first_rows = np.cumsum(lengths) - lengths
            windows = np.repeat(starts, lengths) + (
                np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(first_rows, lengths)
            )
            # Windows of nearby sequences overlap: each row once.
            positions = distinct(windows)
            self.fetch = dataclasses.replace(
                query, rows=positions.size, positions=positions, out=None
            )
            rows = np.searchsorted(positions, starts)
            self._row_of_start = dict(zip(starts.tolist(), rows.tolist(), strict=True))

    def release(self) -> None:
        """The fetch ended (its rows stored by :meth:`result`, or it failed): its rows are no
        longer in flight under :attr:`token`. Idempotent."""
        if self.fetch is not None:
            assert self.fetch.positions is not None
            self._cache._landed(self._key, self.fetch.positions.tolist(), self.token)

    def result(self, fetched: _Rows | None = None) -> _Rows:
        """The caller's rows, from the cache and ``fetched`` (the rows of :attr:`fetch`).

        A new array: callers may write to it without touching the cache.
        """
        entries = self._found
        if self.fetch is not None:
            assert fetched is not None and self.fetch.positions is not None
            batch = _Batch(self._key, self.fetch.positions, fetched)
            self._cache._store(batch)  # a fetch always reads ahead (else plan() gave None)
            self.release()
            assert self._query.positions is not None
            entries = [
                entry if entry is not None else (batch, self._row_of_start[position])
                for entry, position in zip(entries, self._query.positions.tolist(), strict=True)
            ]
        out = self._query.empty()
        groups: dict[_Batch, tuple[list[int], list[int]]] = {}
        for row, entry in enumerate(entries):
            assert entry is not None
            rows_out, rows_in = groups.setdefault(entry[0], ([], []))
            rows_out.append(row)
            rows_in.append(entry[1])
        if len(groups) == 1:
            # Every row from one batch (a decode step read ahead): straight into ``out``,
            # without the temporary array a fancy-indexed gather makes (a MiB of fresh
            # pages per step for 64 sequences of d_model 4096).
            ((batch, (_, rows_in)),) = groups.items()
            np.take(batch.rows, rows_in, axis=0, out=out, mode="clip")  # unbuffered
            return out
        for batch, (rows_out, rows_in) in groups.items():  # one numpy gather per batch
            out[rows_out] = batch.rows[rows_in]
        return out
