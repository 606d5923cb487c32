"""Memory for large results: recycled from dropped results, or mapped by another thread.

A large result is a new array, whose pages the kernel maps at their first write: copying
rows into it pays a page fault per page, one after the other with the copies, and on a
virtual machine whose host takes back the memory its guest frees, faulting in a fresh
array of hundreds of MiB costs as much as receiving it. A worker that fetches a prefill
table or a range, uses it and drops it, then fetches the next, would pay that every time.

So results of ``LARGE_BYTES`` or more live in memory maps of their own, and a dropped
result's map (once no array, view or tensor of it is left) is kept for the next result of
about its size: its pages are mapped already, and a copy into it runs as fast as into an
array used before. At most ``keep_bytes()`` are kept (``POSENC_KEEP_RESULT_BYTES``, default
512 MiB; 0 keeps none), oldest given back first, and a map no result took for
``KEEP_SECONDS`` is given back to the system. (Marking kept maps ``MADV_FREE`` instead, so
that the kernel could take them under pressure, made the next copy into them three times
slower: as slow as fresh memory.)

A new map's pages are mapped by a thread of its own (``madvise(MADV_POPULATE_WRITE)``,
Linux 5.14 and later, which leaves their contents alone, so it may run beside the copies),
while the receiving thread waits on the network. Where a call is missing (another system,
an older kernel) the pages fault as before.

The maps are reported to ``tracemalloc`` under numpy's domain, as numpy reports its own
arrays, for as long as a result uses them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

import numpy as np

#: Results from this size on live in maps of their own (recycled, populated in the background).
LARGE_BYTES: Final = 16 << 20
_KEEP_ENV: Final = "POSENC_KEEP_RESULT_BYTES"
_DEFAULT_KEEP_BYTES: Final = 512 << 20
#: A kept map no result took for this long is given back to the system.
KEEP_SECONDS: Final = 10.0
# A kept map serves a result of at least this fraction of its size (the rest of its pages
# sit unused while the result lives).
_MIN_FILL: Final = 0.8
_MADV_POPULATE_WRITE: Final = 23
# Mapped a slice at a time, so that a dropped result stops the thread soon.
_SLICE_BYTES: Final = 32 << 20
_TRACEMALLOC_DOMAIN: Final = np.lib.tracemalloc_domain


def _find_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


_MADVISE = _find_madvise()


def keep_bytes() -> int:
    """Bytes of dropped results' maps kept for the next results (``POSENC_KEEP_RESULT_BYTES``)."""
    value = os.environ.get(_KEEP_ENV, "")
    try:
        return max(int(value), 0) if value else _DEFAULT_KEEP_BYTES
    except ValueError:
        return _DEFAULT_KEEP_BYTES


class _Map:
    """One anonymous private map and its address, in transparent huge pages where the
    kernel has them, as numpy asks for its own large arrays: 2 MiB pages take fewer faults
    to map and fewer TLB misses to copy into."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # a kernel without them: small pages
                self.memory.madvise(mmap.MADV_HUGEPAGE)
        # The address, through a buffer export released at once: the map is never resized.
        anchor = ctypes.c_char.from_buffer(self.memory)
        self.address = ctypes.addressof(anchor)
        del anchor


class _Owner:
    """What a result's arrays are views of: numpy takes the memory from its
    ``__array_interface__`` and holds this object as their base, so it lives exactly as
    long as an array, view or tensor of the result does."""

    def __init__(self, block: _Map, nbytes: int) -> None:
        # Bytes, viewed as the result's dtype after: the interface cannot name every dtype
        # (ml_dtypes' bfloat16 would come back as two opaque bytes).
        self.__array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (block.address, False),
        }


class _Kept:
    """The maps of dropped results, kept for the next ones; thread-safe. A thread of its
    own gives back the maps kept longer than ``KEEP_SECONDS``."""

    def __init__(self) -> None:
        self._maps: list[tuple[float, _Map]] = []  # (when kept, map), oldest first
        self._changed = threading.Condition()
        self._sweeper: threading.Thread | None = None

    def forget(self) -> None:
        """A forked child starts with none kept (the parent's thread is not its own, and
        its lock may have been held by another thread at the fork)."""
        self._maps = []
        self._changed = threading.Condition()
        self._sweeper = None

    def take(self, nbytes: int) -> _Map | None:
        """The smallest kept map that holds ``nbytes`` without wasting much of itself."""
        with self._changed:
            chosen = min(
                (e for e in self._maps if _MIN_FILL * e[1].size <= nbytes <= e[1].size),
                key=lambda entry: entry[1].size,
                default=None,
            )
            if chosen is None:
                return None
            self._maps.remove(chosen)
            return chosen[1]

    def give(self, block: _Map) -> None:
        """Keep ``block`` for a later result, within ``keep_bytes()``; close what is over."""
        limit = keep_bytes()
        if block.size > limit:
            block.memory.close()
            return
        closing = []
        with self._changed:
            self._maps.append((time.monotonic(), block))
            total = sum(entry[1].size for entry in self._maps)
            while total > limit:
                oldest = self._maps.pop(0)[1]
                total -= oldest.size
                closing.append(oldest)
            if self._sweeper is None:
                self._sweeper = threading.Thread(
                    target=self._sweep, name="posenc-kept-results", daemon=True
                )
                self._sweeper.start()
            self._changed.notify()
        for old in closing:  # outside the lock: unmapping takes a while
            old.memory.close()

    def _sweep(self) -> None:
        while True:
            with self._changed:
                while not self._maps:
                    self._changed.wait()
                due = self._maps[0][0] + KEEP_SECONDS - time.monotonic()
                expired = self._maps.pop(0)[1] if due <= 0 else None
                if expired is None:
                    self._changed.wait(due)
            if expired is not None:
                expired.memory.close()


_KEPT: Final = _Kept()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_KEPT.forget)


def _track(address: int, size: int) -> None:
    ctypes.pythonapi.PyTraceMalloc_Track(
        ctypes.c_uint(_TRACEMALLOC_DOMAIN), ctypes.c_size_t(address), ctypes.c_size_t(size)
    )


def _release(block: _Map) -> None:
    """A result's last array is gone: its map goes back to the kept ones."""
    ctypes.pythonapi.PyTraceMalloc_Untrack(
        ctypes.c_uint(_TRACEMALLOC_DOMAIN), ctypes.c_size_t(block.address)
    )
    _KEPT.give(block)


@functools.cache
def memory_limit() -> int | None:
    """The most memory this process may use: the machine's physical memory, or its control
    group's ``memory.max`` when lower (a container's limit); None where neither is known.
    Read once: every call that allocates a result asks."""
    limits = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(ValueError, OSError), open("/sys/fs/cgroup/memory.max") as file:
        limits.append(int(file.read().strip()))  # "max": no limit (ValueError)
    limits = [limit for limit in limits if limit > 0]
    return min(limits) if limits else None


def new_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, np.dtype[Any]]:
    """An uninitialized array; a large one in a kept map of a dropped result, or in a new
    map whose pages a thread of their own is mapping (see the module doc)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < LARGE_BYTES or not sys.platform.startswith("linux"):
        return np.empty(shape, dtype=dtype)
    kept = _KEPT.take(nbytes)
    block = kept or _Map(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    owner = _Owner(block, nbytes)
    array: np.ndarray[Any, np.dtype[Any]] = np.asarray(owner).view(dtype).reshape(shape)
    _track(block.address, nbytes)
    weakref.finalize(owner, _release, block).atexit = False
    if kept is None and _MADVISE is not None:  # a kept map's pages are mapped already
        threading.Thread(
            target=_populate, args=(weakref.ref(owner), block), name="posenc-populate", daemon=True
        ).start()
    return array


def _populate(result: weakref.ref[_Owner], block: _Map) -> None:
    """Maps the pages of a new map a slice at a time, while its result lives: a call that
    fails (a deadline, an error) drops its result, and the thread stops at the next slice
    instead of mapping memory nobody will use."""
    assert _MADVISE is not None
    end = block.address + block.size
    for first in range(block.address, end, _SLICE_BYTES):
        owner = result()  # held while the kernel maps its pages: the map stays in use
        if owner is None:
            return
        # ctypes releases the GIL for the call. A failure (EINVAL from a kernel without
        # the advice) leaves the pages to fault at their first write, as without it.
        if _MADVISE(first, min(_SLICE_BYTES, end - first), _MADV_POPULATE_WRITE) != 0:
            return
        del owner
