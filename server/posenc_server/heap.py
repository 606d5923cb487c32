"""The process's glibc heap: where table blocks and response messages live.

Blocks (about 1 MiB each) and messages (at most a 4 MiB chunk) are ``bytes`` objects that
glibc's ``malloc`` serves. Three settings keep their memory fast to reuse and within the
budget:

- one arena for every thread (:func:`one_heap`): a block computed on one pool thread and
  evicted on another frees its space where the next block can take it;
- blocks and messages come from the heap, never a map of their own, and glibc does not give
  back the free space at the heap's top on its own (:func:`prefault`): ``app.housekeeping``
  decides when to trim, by what the process accounts for;
- the cache's budget is faulted in before the server reports SERVING (:func:`prefault`): a
  fresh server's first calls fill the cache, and on fresh pages each page costs a fault,
  while later calls reuse the pages of evicted blocks.

Elsewhere (another C library, another system) these are no-ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from typing import Any, Final

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
_M_ARENA_MAX: Final = -8
_MADV_POPULATE_WRITE: Final = 23
#: Allocations from this size on are maps of their own; below it (every block and message),
#: from the heap. glibc's own ceiling for its adaptive threshold on 64-bit systems.
MMAP_THRESHOLD: Final = 32 << 20
# mallopt takes a C int (ctypes would pass a larger value wrapped around).
_MAX_C_INT: Final = (1 << 31) - 1
# Faulted in a piece at a time: pieces under the threshold, so from the heap.
_PIECE_BYTES: Final = 1 << 20
PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc() -> Any:
    """The C library, where it is glibc (Linux), else None. ctypes calls it without the GIL."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            if libc.mallopt and libc.malloc_trim:
                return libc
    return None


def one_heap() -> None:
    """Make every thread of this process allocate from one arena (before they start).

    glibc gives threads arenas of their own: a block computed on one pool thread and evicted
    on another frees its space in the first's arena, which the second cannot reuse, so the
    process grows under cache churn until the housekeeping trims it, and the space given
    back costs page faults when the next blocks take it again. On one arena a cold stream's
    freed space is reused. The threads' allocations are few and large (a block's message,
    numpy's passes), so one arena's lock costs nothing measurable here.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_ARENA_MAX, 1)


def prefault(nbytes: int) -> int:
    """Fault in ``nbytes`` of heap (the cache's budget) and leave them free for the blocks to
    come; returns how many bytes were faulted in (0 where glibc is not the allocator).

    Also fixes glibc's thresholds, which it otherwise adapts: allocations under
    ``MMAP_THRESHOLD`` come from the heap, and the heap keeps its free space at the top
    rather than giving it back at every free (housekeeping trims it when the process holds
    more than it accounts for).
    """
    libc = _libc()
    if libc is None or nbytes < _PIECE_BYTES:
        return 0
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, min(nbytes + MMAP_THRESHOLD, _MAX_C_INT))
    malloc, free, madvise = libc.malloc, libc.free, libc.madvise
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    pieces = [malloc(_PIECE_BYTES) for _ in range(nbytes // _PIECE_BYTES)]
    try:
        for piece in pieces:
            if piece is None:
                continue
            # The kernel maps the pages (Linux 5.14 and later) without the GIL; else writes.
            first = -piece % PAGE_BYTES
            pages = (_PIECE_BYTES - first) // PAGE_BYTES * PAGE_BYTES
            if madvise(piece + first, pages, _MADV_POPULATE_WRITE) != 0:
                ctypes.memset(piece, 0, _PIECE_BYTES)
    finally:
        for piece in pieces:
            free(piece)
    return sum(_PIECE_BYTES for piece in pieces if piece is not None)


def trim() -> None:
    """Give the heap's free pages back to the system."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), else None."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None
