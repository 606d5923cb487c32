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

import numpy as np

from posenc_server.errors import OverloadedError

# A request parses into at most one position per byte whose high bit is clear (each varint
# ends in one), and each position costs this much while it is parsed and gathered: the
# protobuf's int64, the numpy copy, block ids, offsets and the sort order of the gather.
POSITION_WORKING_BYTES = 48
# What computing rows takes besides the request and response, whatever their sizes: the
# engine computes position lists in bounded slices (service.POSITION_SLICE_ELEMENTS).
FIXED_WORKING_BYTES = 4 << 20
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
    return len(request) + POSITION_WORKING_BYTES * position_bound(request) + FIXED_WORKING_BYTES


def response_cost(result_bytes: int, chunk_bytes: int | None) -> int:
    """Bytes the response holds at once: all of a unary result (built once, then copied into
    the message), or a stream's chunks in hand (``chunk_bytes``)."""
    if chunk_bytes is None:
        return 2 * result_bytes
    return STREAM_CHUNKS_HELD * min(result_bytes, chunk_bytes)


_Waiter = tuple["Reservation", int, "asyncio.Future[None]"]


class Reservation:
    """Bytes one call holds in the budget; ``grow`` adds more once the call knows them."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.nbytes = 0

    async def grow(self, nbytes: int) -> None:
        """Hold ``nbytes`` more, waiting for room as admission does; OverloadedError if
        none comes within the wait."""
        await self._budget.acquire(self, nbytes)


class ByteBudget:
    """``capacity`` bytes shared by the calls in flight, first come first served."""

    def __init__(self, capacity: int, wait_seconds: float, retry_after_seconds: float) -> None:
        self.capacity = capacity
        self.wait_seconds = wait_seconds
        self.retry_after_seconds = retry_after_seconds
        self.used = 0
        self.refused = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @asynccontextmanager
    async def admitted(self, nbytes: int) -> AsyncIterator[Reservation]:
        """Hold ``nbytes`` (and whatever the call grows by) until the block ends."""
        reservation = Reservation(self)
        try:
            await self.acquire(reservation, nbytes)
            yield reservation
        finally:
            self._release(reservation.nbytes)

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
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (reservation, nbytes, waiter)
        self._waiters.append(entry)
        try:
            # Shielded: a wait that runs out just as the bytes are granted keeps them.
            await asyncio.wait_for(asyncio.shield(waiter), self.wait_seconds)
        except (TimeoutError, asyncio.CancelledError) as error:
            if waiter.done():  # granted (_wake took the bytes for this call)
                if isinstance(error, asyncio.CancelledError):
                    raise
                return
            waiter.cancel()
            self._waiters.remove(entry)
            self._wake()  # the calls queued behind this one may fit now
            if isinstance(error, asyncio.CancelledError):
                raise
            self.refused += 1
            raise OverloadedError(
                f"this server process has {self.capacity} bytes for calls in flight "
                "(--in-flight-bytes) and they are in use: retry later or on another replica",
                retry_after_seconds=self.retry_after_seconds,
            ) from None

    def _fits(self, nbytes: int, reservation: Reservation) -> bool:
        # Alone (nothing held but its own bytes), a call is admitted whatever its size.
        return self.used + nbytes <= self.capacity or self.used == reservation.nbytes

    def _take(self, reservation: Reservation, nbytes: int) -> None:
        self.used += nbytes
        reservation.nbytes += nbytes

    def _release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._wake()

    def _wake(self) -> None:
        """Grant the waiters at the head of the queue that fit now, in order (so that a
        large call is not overtaken forever by small ones)."""
        while self._waiters:
            reservation, nbytes, waiter = self._waiters[0]
            if not self._fits(nbytes, reservation):
                break
            self._waiters.popleft()
            self._take(reservation, nbytes)
            waiter.set_result(None)
