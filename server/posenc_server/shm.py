"""Shared memory for clients on this machine: over the unix socket, a large result travels
as its place in memory, not as bytes.

A server started with ``--unix-socket PATH`` also listens on ``PATH.shm``, a
``SOCK_SEQPACKET`` unix socket: the region socket. A peer that connects there is admitted
when its credentials match ``--shm-peers`` (``SO_PEERCRED``: what the kernel says of the
peer, not what the peer says), and gets a hello: a session token, the pool's size, and a
read-only file descriptor of the pool (:class:`SharedPool`), a memfd of ``--shm-bytes`` that
only this server writes. A GetEncoding call over the unix socket that carries the session
token gets its rows placed in the pool, and the response says where (``SharedTensor``),
under a lease the session holds until it releases it (a message on the region socket) or
closes. The peer maps those pages read-only; peers asking for the same range share one
copy.

Nothing else reaches the pool: it has no name, its descriptor goes only to admitted peers,
read-only, and no peer can write, resize or punch holes in it, through that descriptor or
any other: the memfd is sealed against every write but the server's own map
(``F_SEAL_FUTURE_WRITE``), and its mode lets no other uid reopen it. Regions are placed by
the server, never where a client says. The pool is the whole budget: a table that does not
fit in what leases leave free is answered in the response as without shared memory, after
regions that no lease holds were evicted to make room. A session holds at most
``MAX_LEASES`` leases, the server at most ``MAX_SESSIONS`` sessions, one peer process at most
``MAX_SESSIONS_PER_PEER``; refused peers and sessions are counted, and logged at most once
every ``_REFUSAL_LOG_SECONDS``.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from posenc_protocol import regions
from posenc_server import metrics

log = logging.getLogger("posenc_server")

MAX_SESSIONS: Final = 256
#: The most sessions one peer process holds: a process that opens every session would turn
#: every other admitted peer to bytes.
MAX_SESSIONS_PER_PEER: Final = 16
MAX_LEASES: Final = 4096
# SO_PEERGROUPS (Linux 4.13): the peer's supplementary groups, as the kernel had them when
# it connected; not in every Python's socket module.
_SO_PEERGROUPS: Final = getattr(socket, "SO_PEERGROUPS", 59)
_GROUPS_BYTES: Final = 1024  # the most Python's getsockopt reads: 256 groups
# Refused peers are logged once, then at most once per this many seconds, each line with
# the count refused since the last: a peer that connects in a loop must not fill the log.
_REFUSAL_LOG_SECONDS: Final = 10.0
_PAGE: Final = mmap.PAGESIZE
_PEERCRED: Final = struct.Struct("3i")  # pid, uid, gid
# F_SEAL_FUTURE_WRITE (Linux 5.1) is not in every Python's fcntl.
_SEAL_FUTURE_WRITE: Final = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


@dataclass(eq=False)
class _Region:
    """Bytes of the pool holding one table: ``key`` (None: placed for one lease) at
    ``offset``, ``size`` bytes (whole pages) of which ``nbytes`` are rows."""

    key: Hashable | None
    offset: int
    size: int
    leases: int = 0
    ready: threading.Event = field(default_factory=threading.Event)
    failed: bool = False


@dataclass(eq=False)
class _Session:
    """An admitted peer's session: its leases, by number, and the peer's pid."""

    token: bytes
    peer: int = 0
    leases: dict[int, _Region] = field(default_factory=dict)
    next_lease: int = 1


class SharedPool:
    """The pool of shared memory: a sealed memfd of ``nbytes`` mapped here for writing,
    regions placed in it first-fit (page-aligned), tables by key, leases by session.
    Thread-safe."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes // _PAGE * _PAGE
        self._fd = os.memfd_create("posenc-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, self.nbytes)
        # A peer holds a descriptor of this inode, and /proc/<pid>/fd/N reopens it with
        # whatever access the inode's mode grants (a memfd's is 0777): readable by its owner
        # alone, it cannot be reopened for writing by any other uid.
        os.fchmod(self._fd, 0o400)
        self._map = mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED)
        # The server's own map, made above, is the last writable one: F_SEAL_FUTURE_WRITE
        # refuses every later write(), writable shared map, mprotect to writing and hole
        # punch, whoever asks and through whichever descriptor, the server's uid and root
        # included. (F_SEAL_WRITE would refuse the server's own map.)
        try:
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
        except OSError as error:
            self._map.close()
            os.close(self._fd)
            raise OSError(
                f"--shm-bytes: cannot seal shared memory against peers' writes ({error}): "
                "it needs Linux 5.1 or later; or serve without it (--shm-bytes 0)"
            ) from None
        # Peers get a descriptor opened for reading only: it maps nothing writable either.
        self.read_only_fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), by offset
        # Regions of tables, least recently used first; those no lease holds are evictable.
        self._tables: collections.OrderedDict[Hashable, _Region] = collections.OrderedDict()
        self._sessions: dict[bytes, _Session] = {}
        self.leased_bytes = 0  # bytes of regions some lease holds
        self.evictions = 0

    # -- sessions

    def open_session(self, peer: int = 0) -> bytes | str:
        """A new session's token for the peer process ``peer`` (its pid), or why not: when
        ``MAX_SESSIONS`` are open, or the peer holds ``MAX_SESSIONS_PER_PEER``."""
        with self._lock:
            if len(self._sessions) >= MAX_SESSIONS:
                return f"{MAX_SESSIONS} sessions open"
            held = sum(session.peer == peer for session in self._sessions.values())
            if held >= MAX_SESSIONS_PER_PEER:
                return f"the peer holds {held} sessions, the most one process may"
            token = secrets.token_bytes(regions.TOKEN_BYTES)
            self._sessions[token] = _Session(token, peer)
            return token

    def close_session(self, token: bytes) -> None:
        """Ends a session: its leases are released."""
        with self._lock:
            session = self._sessions.pop(token, None)
            if session is not None:
                for region in session.leases.values():
                    self._unlease(region)

    def release(self, token: bytes, leases: Iterable[int]) -> None:
        """The session's leases ``leases`` end (unknown numbers are ignored)."""
        with self._lock:
            session = self._sessions.get(token)
            if session is None:
                return
            for number in leases:
                region = session.leases.pop(number, None)
                if region is not None:
                    self._unlease(region)

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    # -- placing tables

    def place(
        self,
        token: bytes,
        key: Hashable | None,
        nbytes: int,
        fill: Callable[[memoryview], None],
    ) -> tuple[int, int] | None:
        """``(offset, lease)`` of ``nbytes`` that ``fill`` wrote (or that were written for
        ``key`` before), leased to the session ``token``; None when the session is unknown
        or at its lease limit, or no room can be made."""
        size = max(-(-nbytes // _PAGE) * _PAGE, _PAGE)
        with self._lock:
            session = self._sessions.get(token)
            if session is None or len(session.leases) >= MAX_LEASES or size > self.nbytes:
                return None
            region = self._tables.get(key) if key is not None else None
            owner = region is None
            if region is None:
                offset = self._allocate(size)
                if offset is None:
                    return None
                region = _Region(key, offset, size)
                if key is not None:
                    self._tables[key] = region
            else:
                self._tables.move_to_end(key)
            lease = self._lease(session, region)
        if owner:
            self._fill(region, session, lease, nbytes, fill)
        else:
            region.ready.wait()
            if region.failed:
                self.release(token, (lease,))
                return None
        return region.offset, lease

    def _fill(
        self,
        region: _Region,
        session: _Session,
        lease: int,
        nbytes: int,
        fill: Callable[[memoryview], None],
    ) -> None:
        """Have ``fill`` write the first ``nbytes`` of the new ``region``, then mark it
        ready; if ``fill`` raises, drop the region and ``session``'s ``lease`` of it (the
        callers waiting on it see it failed) and raise."""
        try:
            with memoryview(self._map) as pool:
                fill(pool[region.offset : region.offset + nbytes])
        except BaseException:
            region.failed = True
            with self._lock:
                self._drop(region)
                self._release_locked(session, lease)
            region.ready.set()
            raise
        region.ready.set()

    def _release_locked(self, session: _Session, lease: int) -> None:
        region = session.leases.pop(lease, None)
        if region is not None:
            self._unlease(region)

    def _lease(self, session: _Session, region: _Region) -> int:
        number = session.next_lease
        session.next_lease += 1
        session.leases[number] = region
        if region.leases == 0:
            self.leased_bytes += region.size
        region.leases += 1
        return number

    def _unlease(self, region: _Region) -> None:
        region.leases -= 1
        if region.leases == 0:
            self.leased_bytes -= region.size
            if region.key is None:
                self._free_region(region)

    def _drop(self, region: _Region) -> None:
        """Forget a keyed region (its leases keep it until they end)."""
        if region.key is not None and self._tables.get(region.key) is region:
            del self._tables[region.key]
            region.key = None
            if region.leases == 0:
                self._free_region(region)

    def _allocate(self, size: int) -> int | None:
        """First fit; tables no lease holds are evicted, oldest first, until ``size`` fits."""
        while True:
            for index, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + size, free - size)
                    return offset
            victim = next((r for r in self._tables.values() if r.leases == 0), None)
            if victim is None:
                return None
            self.evictions += 1
            self._drop(victim)

    def _free_region(self, region: _Region) -> None:
        """Give ``region``'s bytes back to the free list, merged with its neighbours."""
        self._free.append((region.offset, region.size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for offset, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self._free = merged

    def close(self) -> None:
        """Gives the pool back (peers' maps keep their pages); a fill still running keeps
        the map until it ends."""
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)
        os.close(self.read_only_fd)


class RegionServer:
    """The region socket (see the module doc): admits peers, hands out sessions and the
    pool's descriptor, takes releases, and ends a session when its peer's connection
    closes. One thread."""

    def __init__(self, path: str, pool: SharedPool, peers: tuple[frozenset[int], frozenset[int]]):
        self.path = path
        self._pool = pool
        self._uids, self._gids = peers
        remove_stale_socket(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(path)
        os.chmod(path, 0o660)  # the directory says who reaches it; credentials who is served
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._refused_quietly = 0  # refusals since the last one logged
        self._next_refusal_log = 0.0
        self._thread = threading.Thread(target=self._serve, name="posenc-regions", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj, key.data)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            connection, _ = self._listener.accept()
        except OSError:
            return
        pid, uid, gid = _PEERCRED.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid not in self._uids and self._gids.isdisjoint({gid, *_peer_groups(connection, pid)}):
            self._refuse(connection, {"pid": pid, "uid": uid, "gid": gid})
            return
        token = self._pool.open_session(pid)
        if isinstance(token, str):
            self._refuse(connection, {"pid": pid, "uid": uid, "gid": gid, "reason": token})
            return
        try:
            connection.sendmsg(
                [regions.hello(token, self._pool.nbytes)],
                [
                    (
                        socket.SOL_SOCKET,
                        socket.SCM_RIGHTS,
                        array.array("i", [self._pool.read_only_fd]),
                    )
                ],
            )
        except OSError:
            self._pool.close_session(token)
            connection.close()
            return
        connection.setblocking(False)
        self._selector.register(connection, selectors.EVENT_READ, token)

    def _refuse(self, connection: socket.socket, fields: dict[str, object]) -> None:
        """Close a refused peer's connection, count it, and log it unless a refusal was
        logged less than ``_REFUSAL_LOG_SECONDS`` ago (the next line counts the ones
        between)."""
        connection.close()
        metrics.SHM_REFUSED.inc()
        self._refused_quietly += 1
        now = time.monotonic()
        if now < self._next_refusal_log:
            return
        self._next_refusal_log = now + _REFUSAL_LOG_SECONDS
        fields = {**fields, "refused": self._refused_quietly}
        self._refused_quietly = 0
        log.warning("region socket: refused a peer", extra={"fields": fields})

    def _read(self, connection: socket.socket, token: bytes) -> None:
        try:
            message, _, flags, _ = connection.recvmsg(regions.MAX_RELEASE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            message, flags = b"", 0
        # A message longer than any release is no release: cut to the buffer, the rest
        # would be parsed as if it were all.
        leases = None if flags & socket.MSG_TRUNC else regions.parse_release(message)
        if leases is None:
            # The peer went away, or sent what no client sends: its session ends.
            self._selector.unregister(connection)
            connection.close()
            self._pool.close_session(token)
            return
        self._pool.release(token, leases)


def _peer_groups(connection: socket.socket, pid: int) -> tuple[int, ...]:
    """The supplementary groups of ``connection``'s peer, process ``pid``: as the kernel
    gave them when it connected (``SO_PEERGROUPS``), else (more than Python's getsockopt
    holds, an older kernel) as the process has them now; none when neither says."""
    try:
        data = connection.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _GROUPS_BYTES)
        return tuple(array.array("I", data[: len(data) // 4 * 4]))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return tuple(int(group) for group in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def remove_stale_socket(path: str) -> None:
    """Remove a socket file no process listens on (left by a server that died); refuse to
    touch anything else, or a socket another server listens on."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{path} exists and is not a socket")
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        with socket.socket(socket.AF_UNIX, kind) as probe:
            try:
                probe.connect(path)
            except OSError:  # refused (nobody listens), or not this kind of socket
                continue
            raise OSError(f"{path}: another server listens there")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def rows_of(view: memoryview, dtype: np.dtype[Any], columns: int) -> npt.NDArray[Any]:
    """``view`` (a region's bytes) as writable rows of ``columns`` ``dtype`` values."""
    return np.frombuffer(view, dtype=dtype).reshape(-1, columns)
