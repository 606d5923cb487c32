"""Admission of encoding calls against one byte budget per process.

A call's memory is the request it brought, what parsing and gathering it takes, and the
response bytes gRPC holds until the client reads them (a client that never reads holds them
for as long as its connection lives). Every encoding call reserves an estimate of those
bytes before it uses them and gives them back when its last message has been handed to the
client's connection; a call that does not fit waits up to ``admission_wait_seconds`` for
others to finish, then gets RESOURCE_EXHAUSTED with RetryInfo (``OverloadedError``), which
the SDK retries. Memory in flight therefore stays within ``in_flight_bytes`` whatever the
calls, hostile ones included, and legitimate calls beyond it are delayed, not refused
outright.

The budget lives on the event loop: reservations and releases happen there, without locks.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np

from posenc_server.errors import OverloadedError

# A request parses into at most one position per byte whose high bit is clear (each varint
# ends in one), and each position costs this much while the call lasts: the protobuf's
# int64 and the numpy copy.
POSITION_WORKING_BYTES = 16
# Positions are grouped by cached block this many at a time, each taking this much working
# memory (block ids, offsets, the sort order and its groups): bounded whatever the list's
# length.
GATHER_POSITIONS = 1 << 16
GATHER_BYTES_PER_POSITION = 64
# Reading a request holds it about this many times over: gRPC's receive buffers, the
# message it assembles from them, and the bytes handed to the handler.
READ_COPIES = 3
# What any call takes besides its request and response: the parsed message, the spec
# lookup, the handler's frames.
CALL_BYTES = 64 << 10
# The engine computes the rows of uncached positions in slices of at most this much working
# memory (double-double angles and complex waves: about 128 bytes a row plus 16 a column).
ENGINE_WORKING_BYTES = 4 << 20
_ENGINE_ROW_BYTES = 128
_ENGINE_ELEMENT_BYTES = 16
# A stream holds about this many chunks at once: one being computed, one in gRPC's hands.
STREAM_CHUNKS_HELD = 2
# Counting varint ends in slices keeps the count's own temporary array small.
_COUNT_SLICE = 1 << 20


def position_bound(request: bytes) -> int:
    """An upper bound on the positions a serialized request can hold: one per varint end."""
    view = np.frombuffer(request, dtype=np.uint8)
    return sum(
        int(np.count_nonzero(view[first : first + _COUNT_SLICE] < 0x80))
        for first in range(0, view.size, _COUNT_SLICE)
    )


def request_cost(request: bytes) -> int:
    """Bytes a call needs before its response is known: its request, parsed and gathered."""
    positions = position_bound(request)
    gathering = GATHER_BYTES_PER_POSITION * min(positions, GATHER_POSITIONS)
    return len(request) + POSITION_WORKING_BYTES * positions + gathering + CALL_BYTES


def engine_slice_rows(width: int) -> int:
    """Rows the engine computes at once for a table ``width`` columns wide."""
    row_bytes = _ENGINE_ROW_BYTES + _ENGINE_ELEMENT_BYTES * width
    return max(1, ENGINE_WORKING_BYTES // row_bytes)


def response_cost(rows: int, width: int, row_bytes: int, chunk_bytes: int | None) -> int:
    """Bytes computing and answering ``rows`` rows holds at once: the engine's working
    memory, and all of a unary result (built once, then copied into the message) or a
    stream's chunks in hand (``chunk_bytes``)."""
    engine_rows = min(rows, engine_slice_rows(width))
    working = engine_rows * (_ENGINE_ROW_BYTES + _ENGINE_ELEMENT_BYTES * width)
    result = rows * row_bytes
    if chunk_bytes is None:
        return working + 2 * result
    return working + STREAM_CHUNKS_HELD * min(result, chunk_bytes)


def unary_cost(max_unary_bytes: int) -> int:
    """What computing and answering the largest unary result takes (``response_cost``)."""
    return ENGINE_WORKING_BYTES + 2 * max_unary_bytes


_Waiter = tuple["Reservation", int, "asyncio.Future[None]"]


class Reservation:
    """Bytes one call holds in the budget; ``grow`` adds more once the call knows them.

    While the call reads its request (``reading``), the reservation holds the largest
    request allowed, and another call may take it over once the read has waited
    ``ByteBudget.preempt_after`` seconds: ``preempted`` is set and the ``reader`` task is
    cancelled. A call whose request does not come cannot keep others from theirs.
    """

    def __init__(self, budget: ByteBudget, peer: str = "") -> None:
        self._budget = budget
        self.peer = peer
        """The call's connection (gRPC's peer address): takeovers go to the connections
        with the fewest calls reading or waiting to."""
        self.counted = False  # among its peer's calls reading or waiting to
        self.nbytes = 0
        self.reading_since: float | None = None
        self.preempted = False
        self.reader: asyncio.Task[Any] | None = None

    async def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` more, waiting for room as admission does; OverloadedError if
        none comes within the wait."""
        await self._budget.acquire(self, nbytes)

    async def settle(self, nbytes: int) -> None:
        """The request has arrived: hold ``nbytes`` from now on (no longer preemptible)."""
        self._budget.stop_reading(self)
        if nbytes < self.nbytes:
            self._budget.give_back(self, self.nbytes - nbytes)
        else:
            await self.grow(nbytes - self.nbytes)


class ByteBudget:
    """``capacity`` bytes shared by the calls in flight, first come first served."""

    def __init__(
        self,
        capacity: int,
        wait_seconds: float,
        retry_after_seconds: float,
        preempt_after_seconds: float,
    ) -> None:
        self.capacity = capacity
        self.wait_seconds = wait_seconds
        self.retry_after_seconds = retry_after_seconds
        self.preempt_after = preempt_after_seconds
        self.used = 0
        self.released = 0  # bytes given back since the start (the heap may be trimmed)
        self.refused = 0
        self.preemptions = 0
        # Bytes the waiting calls asked for: a waiting call holds its request, so the
        # queue is bounded by the budget too (beyond it, calls are refused at once).
        self._waiting_bytes = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._readers: set[Reservation] = set()
        # Calls reading or waiting to read, by connection; and the waiter a stale read goes
        # to (None: to be chosen again, after any change of either).
        self._peer_calls: collections.Counter[str] = collections.Counter()
        self._chosen: _Waiter | None = None

    @asynccontextmanager
    async def admitted(
        self, nbytes: int, *, reading: bool = False, peer: str = ""
    ) -> AsyncIterator[Reservation]:
        """Hold ``nbytes`` (and whatever the call grows by) until the block ends;
        ``reading``: preemptible until ``Reservation.settle``; ``peer``: the call's
        connection."""
        reservation = Reservation(self, peer)
        if reading:
            reservation.counted = True
            self._peer_calls[peer] += 1
            self._chosen = None
        try:
            await self.acquire(reservation, nbytes)
            if reading:
                reservation.reading_since = asyncio.get_running_loop().time()
                self._readers.add(reservation)
            yield reservation
        finally:
            self.stop_reading(reservation)
            self.give_back(reservation, reservation.nbytes)

    def fits_now(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` would be admitted at once, waiting for no one."""
        return not self._waiters and (self.used + nbytes <= self.capacity or self.used == 0)

    def stop_reading(self, reservation: Reservation) -> None:
        """``reservation`` is no longer preemptible."""
        self._readers.discard(reservation)
        reservation.reading_since = None
        if reservation.counted:
            reservation.counted = False
            self._peer_calls[reservation.peer] -= 1
            if not self._peer_calls[reservation.peer]:
                del self._peer_calls[reservation.peer]
            self._chosen = None

    def give_back(self, reservation: Reservation, nbytes: int) -> None:
        """Release ``nbytes`` of ``reservation``."""
        reservation.nbytes -= nbytes
        self.used -= nbytes
        self.released += nbytes
        self._wake()

    async def acquire(self, reservation: Reservation, nbytes: int) -> None:
        """Add ``nbytes`` to ``reservation`` once they fit; OverloadedError after the wait.

        A call larger than the whole budget is admitted when it is alone, so that every
        request the limits accept can be served.
        """
        nbytes = min(nbytes, self.capacity - reservation.nbytes)
        if nbytes <= 0:
            return
        if not self._waiters and self._fits(nbytes, reservation):
            self._take(reservation, nbytes)
            return
        if self._preempt(reservation, nbytes):
            self._take(reservation, nbytes)
            return
        holding = reservation.nbytes > 0
        if holding and self._waiting_bytes + nbytes > self.capacity:
            # A waiting call that holds bytes holds its request too: the queue of those is
            # bounded by the budget (calls about to read hold nothing and may queue).
            raise self._refusal()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        entry = (reservation, nbytes, waiter)
        self._waiters.append(entry)
        self._chosen = None
        self._waiting_bytes += nbytes if holding else 0
        try:
            await self._wait(entry, loop.time() + self.wait_seconds)
        except (TimeoutError, asyncio.CancelledError) as error:
            if waiter.done() and not waiter.cancelled():
                if isinstance(error, asyncio.CancelledError):
                    raise
                return
            waiter.cancel()
            self._waiters.remove(entry)
            self._chosen = None
            self._wake()  # the calls queued behind this one may fit now
            if isinstance(error, asyncio.CancelledError):
                raise
            raise self._refusal() from None
        finally:
            self._waiting_bytes -= nbytes if holding else 0

    async def _wait(self, entry: _Waiter, deadline: float) -> None:
        """Wait, queued as ``entry``, until its bytes are granted (by ``_wake``, or by taking
        a stale read's room over); TimeoutError at ``deadline`` (the loop's time)."""
        reservation, nbytes, waiter = entry
        loop = asyncio.get_running_loop()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            try:
                # Shielded: a wait that runs out just as the bytes are granted keeps them.
                await asyncio.wait_for(asyncio.shield(waiter), min(remaining, self._stale_in()))
                return
            except TimeoutError:
                if waiter.done():
                    return  # granted (_wake took the bytes for this call)
            # A read went stale: a waiter takes it over, the one whose connection has the
            # fewest calls reading or waiting, the newest of those: calls that never send
            # their request, however many queued first and however fast they come, cannot
            # starve a call of another connection.
            if self._next_taker() is entry and self._preempt(reservation, nbytes):
                self._waiters.remove(entry)
                self._chosen = None
                self._take(reservation, nbytes)
                waiter.set_result(None)
                return

    def _next_taker(self) -> _Waiter | None:
        """The waiter that takes a stale read's room over (see ``acquire``)."""
        if self._chosen is None and self._waiters:
            calls = self._peer_calls
            self._chosen = min(
                reversed(self._waiters), key=lambda waiter: calls.get(waiter[0].peer, 0)
            )
        return self._chosen

    def _stale_in(self) -> float:
        """Seconds until the longest waiting read may be preempted (the wait if none)."""
        started = [r.reading_since for r in self._readers if r.reading_since is not None]
        if not started:
            return self.wait_seconds
        now = asyncio.get_running_loop().time()
        return max(0.005, min(started) + self.preempt_after - now)

    def _preempt(self, reservation: Reservation, nbytes: int) -> bool:
        """Take over the reservations of reads waiting longer than ``preempt_after``, the
        longest waiting first, until ``nbytes`` fit; whether they do."""
        now = asyncio.get_running_loop().time()
        stale = sorted(
            (
                reader
                for reader in self._readers
                if reader is not reservation
                and reader.reading_since is not None
                and now - reader.reading_since >= self.preempt_after
            ),
            # The stale reads of the connections with the most calls first, the longest
            # waiting first among those.
            key=lambda reader: (
                -self._peer_calls.get(reader.peer, 0),
                reader.reading_since or 0.0,
            ),
        )
        for reader in stale:
            if self._fits(nbytes, reservation):
                break
            self.stop_reading(reader)
            self.used -= reader.nbytes
            reader.nbytes = 0
            reader.preempted = True
            if reader.reader is not None:
                reader.reader.cancel()
            self.preemptions += 1
        return self._fits(nbytes, reservation)

    def _refusal(self) -> OverloadedError:
        self.refused += 1
        return OverloadedError(
            f"this server process has {self.capacity} bytes for calls in flight "
            "(--in-flight-bytes) and they are in use: retry later or on another replica",
            retry_after_seconds=self.retry_after_seconds,
        )

    def _fits(self, nbytes: int, reservation: Reservation) -> bool:
        # Alone (nothing held but its own bytes), a call is admitted whatever its size.
        return self.used + nbytes <= self.capacity or self.used == reservation.nbytes

    def _take(self, reservation: Reservation, nbytes: int) -> None:
        self.used += nbytes
        reservation.nbytes += nbytes

    def _wake(self) -> None:
        """Grant the waiters at the head of the queue that fit now, in order (so that a
        large call is not overtaken forever by small ones)."""
        while self._waiters:
            reservation, nbytes, waiter = self._waiters[0]
            if not self._fits(nbytes, reservation):
                break
            self._waiters.popleft()
            self._chosen = None
            self._take(reservation, nbytes)
            waiter.set_result(None)
