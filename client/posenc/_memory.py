"""New result arrays, their pages mapped by another thread while the rows arrive.

A large result is a new array, whose pages the kernel maps at their first write: copying a
stream's chunks into it pays a page fault per page (per 2 MiB with transparent huge pages)
in the thread that receives, one after the other with the copies. On a virtual machine whose
host takes back the memory its guest frees, a fresh 256 MiB array costs from tens to
hundreds of milliseconds to fault in, as much as receiving it (see the README's
Performance). So a thread asks the kernel to map the array's pages at once
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14 and later, which leaves their contents alone,
so it may run beside the copies), while the receiving thread waits on the network. Where
the call is missing (another system, an older kernel) the pages fault as before.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

import numpy as np

#: New results from this size on have their pages mapped in the background.
POPULATE_MIN_BYTES: Final = 16 << 20
_MADV_POPULATE_WRITE: Final = 23
# Mapped a slice at a time, so that a dropped result stops the thread soon.
_SLICE_BYTES: Final = 32 << 20


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


def new_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, np.dtype[Any]]:
    """An uninitialized array whose pages, when it is large, are being mapped by a thread
    of their own (see the module doc)."""
    array = np.empty(shape, dtype=dtype)
    if _MADVISE is not None and array.nbytes >= POPULATE_MIN_BYTES:
        threading.Thread(
            target=_populate, args=(weakref.ref(array),), name="posenc-populate", daemon=True
        ).start()
    return array


def _populate(result: weakref.ref[np.ndarray[Any, np.dtype[Any]]]) -> None:
    """Maps the pages of ``result`` a slice at a time, while the array lives: a call that
    fails (a deadline, an error) drops its result, and the thread stops at the next slice
    instead of mapping memory nobody will use (and delaying its release)."""
    assert _MADVISE is not None
    array = result()
    if array is None:
        return
    page = mmap.PAGESIZE
    address = -(-array.ctypes.data // page) * page  # madvise takes whole pages
    end = array.ctypes.data + array.nbytes
    del array
    for first in range(address, end, _SLICE_BYTES):
        array = result()  # held while the kernel maps its pages: their memory stays valid
        if array is None:
            return
        # ctypes releases the GIL for the call. A failure (EINVAL from a kernel without
        # the advice) leaves the pages to fault at their first write, as without it.
        if _MADVISE(first, min(_SLICE_BYTES, end - first), _MADV_POPULATE_WRITE) != 0:
            return
        del array
