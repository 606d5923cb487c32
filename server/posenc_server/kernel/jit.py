"""How the kernel's functions are compiled: entry points (``compiled``), the helpers they
call (``helper``), and the LLVM IR those call (``intrinsic``)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import numba
from numba.extending import intrinsic as _numba_intrinsic

_F = TypeVar("_F", bound=Callable[..., None])
_G = TypeVar("_G", bound=Callable[..., object])


def _sources_digest() -> str:
    """A digest of this package's modules (empty where their sources cannot be read)."""
    digest = hashlib.sha256()
    try:
        for path in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    except OSError:
        return ""
    return digest.hexdigest()[:16]


#: Part of every cached function's name, and so of its cache files' names: numba checks a
#: cached function against its own module's source alone, while the code it keeps holds
#: every helper the function calls, from every module here; a change to any of them so
#: compiles afresh instead of loading the code of the helpers as they were.
SOURCES: Final = _sources_digest()


def compiled(function: _F) -> _F:
    """``function`` compiled without the GIL, and kept in numba's on-disk cache when numba
    finds a writable place for it (beside this file, ``NUMBA_CACHE_DIR``, the user's cache
    directory); where none is (an installation read-only to the server's user, without a
    home), each process compiles it at start instead of failing to import."""
    function.__qualname__ = f"{function.__name__}.{SOURCES}" if SOURCES else function.__name__
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(function)  # type: ignore[return-value]
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, boundscheck=False)(function)  # type: ignore[return-value]


def named(function: _G, name: str) -> _G:
    """``function``, named ``name``: for each function a factory makes, a name of its own.
    numba names a function's compiled code by its qualified name and a number counting
    the functions the process has compiled; code cached by two processes can so hold two
    different functions of one name under one symbol, and a process that loads both
    calls one of them for the other."""
    function.__name__ = function.__qualname__ = name
    return function


def helper(function: _G) -> _G:
    """A loop's helper, compiled once per argument types and inlined where it is called by
    LLVM: numba's own inlining (``inline="always"``) types and lowers it again at every call
    site, which multiplies the kernels' compile time.

    Without numba's reference counting (a helper allocates nothing; its caller holds its
    arrays): where LLVM does not inline a helper (one that rounds half precision, with its
    rarely taken path of exact rounding), each call would count a reference to every array
    it is given, atomically, in and out: a fixed cost per row, which short rows (a rotary
    head's) would pay in full."""
    return numba.njit(_nrt=False)(function)  # type: ignore[call-overload,no-any-return]


def allocating_helper(function: _G) -> _G:
    """A helper that allocates arrays (so with numba's reference counting)."""
    return numba.njit(function)  # type: ignore[no-any-return]


def intrinsic(typing: Callable[..., object]) -> Callable[..., Any]:
    """numba's ``intrinsic`` (LLVM IR the loops call, typed by ``typing``), typed as what
    those loops call."""
    return _numba_intrinsic(typing)
