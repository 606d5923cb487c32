"""A client's side of a server's shared memory (``unix:`` targets).

A server with a unix socket at ``PATH`` hands out its shared memory on ``PATH.shm`` (its
region socket): it checks this process's credentials, and its hello gives a session token
and a read-only descriptor of its memory. A ``get_range`` that carries the token may get
its rows there: the response says where, under a lease. The rows are either copied into
the result (:meth:`Session.copy`), the lease released at once, or mapped
read-only and handed back as a view whose lease ends when the last array using the map is
collected (:meth:`Session.attach`).

The session (its socket) lives as long as its client, or as long as a view it handed out.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import struct
import threading
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from posenc_protocol import regions
from posenc_protocol.wire import SharedView


def region_socket(target: str) -> str | None:
    """The region socket of a ``unix:`` target (``unix:PATH``, ``unix://PATH``), else None."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix) :] + ".shm"
    return None


class Session:
    """A session on a server's region socket (see the module doc). Thread-safe."""

    def __init__(self, path: str, timeout: float | None) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket.settimeout(timeout)
        try:
            self._socket.connect(path)
            message, ancillary, _, _ = self._socket.recvmsg(
                regions.HELLO_BYTES, socket.CMSG_SPACE(struct.calcsize("i"))
            )
        except OSError:
            self._socket.close()
            raise
        fds = [
            int.from_bytes(data[:4], "little", signed=True)
            for level, kind, data in ancillary
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
        ]
        hello = regions.parse_hello(message)
        if hello is None or len(fds) != 1:
            for fd in fds:
                socket.close(fd)
            self._socket.close()
            raise OSError(f"{path} is not a posenc region socket (or refused this process)")
        self._socket.settimeout(None)
        self.token, self.size = hello
        self._fd = fds[0]
        self._pool = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        # Reentrant: a view's finalizer may run in a collection while this thread holds it.
        self._lock = threading.RLock()
        self._leases = 0  # held by maps still in use
        self._closing = False
        self._closed = False

    def attach(self, shared: SharedView, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        """The rows ``shared`` says the server placed, mapped read-only: their lease ends
        when the last array using the map is collected."""
        nbytes = shared.rows * shared.columns * dtype.itemsize
        self._check(shared, nbytes)
        # MAP_POPULATE: the pages, already the server's, are mapped in one go instead of
        # one fault at a time as the rows are read.
        region = mmap.mmap(
            self._fd,
            nbytes,
            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
            prot=mmap.PROT_READ,
            offset=shared.offset,
        )
        with self._lock:
            self._leases += 1
        weakref.finalize(region, self._release, shared.lease)
        return np.frombuffer(region, dtype=dtype).reshape(shared.rows, shared.columns)

    def copy(self, shared: SharedView, out: npt.NDArray[Any]) -> None:
        """Copies the rows ``shared`` says the server placed into ``out`` (an array of
        their size), then ends their lease. From the session's map of the whole pool, whose
        pages stay mapped from one call to the next: a range asked for again costs one
        copy, without a page fault."""
        nbytes = out.nbytes
        self._check(shared, nbytes)
        try:
            source = np.frombuffer(self._pool, np.uint8, nbytes, shared.offset)
            np.copyto(out.reshape(-1).view(np.uint8), source)
            del source  # the pool's map may close once no copy uses it
        finally:
            with self._lock:
                self._send_release(shared.lease)

    def _check(self, shared: SharedView, nbytes: int) -> None:
        """ValueError unless ``shared`` places ``nbytes`` at a page of the pool, within it."""
        if shared.offset % mmap.PAGESIZE or not 0 < shared.offset + nbytes <= self.size:
            raise ValueError(
                f"the server placed {nbytes} bytes at {shared.offset}: not in its memory"
            )

    def _release(self, lease: int) -> None:
        """A view's map was collected: its lease ends (and the session, if it was closed
        and this was its last view)."""
        with self._lock:
            self._leases -= 1
            self._send_release(lease)
            if self._closing and not self._leases:
                self._close()

    def _send_release(self, lease: int) -> None:
        if self._closed:
            return
        with contextlib.suppress(OSError):  # the server is gone: so is the lease
            self._socket.send(regions.release([lease]))

    def alive(self) -> bool:
        """Whether the server still holds the session (it closes the socket when it stops)."""
        try:
            return self._socket.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Ends the session once no view it handed out is left."""
        with self._lock:
            self._closing = True
            if not self._leases:
                self._close()

    def _close(self) -> None:
        self._closed = True
        self._socket.close()
        with contextlib.suppress(BufferError):  # a copy still under way: closed when it ends
            self._pool.close()
        socket.close(self._fd)
