"""Clients on the server's machine: the unix socket, and ranges through shared memory.

A server started with ``--unix-socket PATH`` serves the same API there; a client of target
``unix:PATH`` gets large ranges placed in the server's shared memory (handed out on
``PATH.shm`` to peers whose kernel credentials ``--shm-peers`` admits), copied into its
result or, with ``copy=False``, as a read-only view that several processes share. Every
row is checked against the same server's rows over TCP, bit for bit; what the server holds
is read from its metrics.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, same_bits, wait_until
from test_operations import metric, metrics_port, scrape

import posenc
from posenc_protocol import regions, wire
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_server import shm

MIB = 1 << 20
SERVE = (sys.executable, "-m", "posenc_server", "--port", "0", "--metrics-port", "-1")
SERVE += ("--processes", "1")
D_MODEL = 512  # float32 rows of 2 KiB
ROWS = 1024  # 2 MiB a range


@pytest.fixture
def unix_server(
    spawn_server: Callable[..., ServerProcess], tmp_path: Path
) -> Iterator[Callable[..., tuple[ServerProcess, str]]]:
    """Start a server on a TCP port and a unix socket in ``tmp_path``; its unix target."""

    def start(*args: str) -> tuple[ServerProcess, str]:
        path = tmp_path / f"posenc-{len(list(tmp_path.iterdir()))}.sock"
        server = spawn_server(0, "--unix-socket", str(path), *args)
        return server, f"unix:{path}"

    yield start


def bits(rows: Any) -> Any:
    rows = np.ascontiguousarray(rows)
    return rows.view(f"u{rows.dtype.itemsize}")


def in_shared_memory(rows: Any) -> bool:
    """Whether ``rows`` are a view of a server's shared memory (``copy=False``)."""
    base = rows.base
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_ranges_over_the_unix_socket_are_the_servers_rows(
    unix_server: Callable[..., tuple[ServerProcess, str]], dtype: str
) -> None:
    server, target = unix_server("--shm-bytes", str(64 * MIB))
    port = metrics_port(server)
    with posenc.Client(server.target) as tcp, posenc.Client(target) as local:
        expected = tcp.get_range(10**6, 10**6 + ROWS, D_MODEL, dtype=dtype)
        copied = local.get_range(10**6, 10**6 + ROWS, D_MODEL, dtype=dtype)
        assert np.array_equal(bits(copied), bits(expected))
        assert copied.flags.writeable and not in_shared_memory(copied)
        view = local.get_range(10**6, 10**6 + ROWS, D_MODEL, dtype=dtype, copy=False)
        assert in_shared_memory(view) and not view.flags.writeable
        assert np.array_equal(bits(view), bits(expected))
        with pytest.raises(ValueError):
            view[0, 0] = 0
        # Small results, decode steps and streams over the unix socket as over TCP.
        assert np.array_equal(local.get_range(0, 3, D_MODEL), tcp.get_range(0, 3, D_MODEL))
        steps = [local.get_positions([7 + step, 90 + step], D_MODEL) for step in range(3)]
        assert np.array_equal(steps[-1], tcp.get_positions([9, 92], D_MODEL))
        slices = list(local.iter_range(0, 3000, D_MODEL, chunk_bytes=MIB))
        assert np.array_equal(
            np.concatenate([rows for _, rows in slices]), tcp.get_range(0, 3000, D_MODEL)
        )
        # The server publishes its metrics five times a second.
        wait_until(lambda: metric(scrape(port), "posenc_shm_sessions") == 1, "one session")
        leased = view.nbytes  # the view's lease
        wait_until(lambda: metric(scrape(port), "posenc_shm_leased_bytes") == leased, "leased")
        del view
        gc.collect()
        wait_until(lambda: metric(scrape(port), "posenc_shm_leased_bytes") == 0, "lease ended")
    wait_until(lambda: metric(scrape(port), "posenc_shm_sessions") == 0, "session closed")


def test_processes_holding_the_same_range_share_one_copy(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    server, target = unix_server("--shm-bytes", str(64 * MIB))
    port = metrics_port(server)
    clients = [posenc.Client(target) for _ in range(3)]
    try:
        views = [c.get_range(0, 4 * ROWS, D_MODEL, copy=False) for c in clients]
        assert all(np.array_equal(v, views[0]) for v in views)
        # Three sessions, one region: its bytes leased once.
        wait_until(lambda: metric(scrape(port), "posenc_shm_sessions") == 3, "three sessions")
        leased = views[0].nbytes
        wait_until(lambda: metric(scrape(port), "posenc_shm_leased_bytes") == leased, "leased")
    finally:
        for c in clients:
            c.close()


def _session(path: str) -> tuple[socket.socket, bytes, int]:
    """A raw session on a region socket: the socket, the token, the pool's descriptor."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    message, ancillary, _, _ = connection.recvmsg(64, socket.CMSG_SPACE(4))
    hello = regions.parse_hello(message)
    assert hello is not None and len(ancillary) == 1
    return connection, hello[0], struct.unpack("i", ancillary[0][2][:4])[0]


def test_a_session_that_never_releases_fills_only_the_pool(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    """A peer that asks for ranges and never releases them pins the whole pool, no more:
    other clients still get every row (in responses), the server's memory stays within
    its budgets, and when the peer goes away its leases end."""
    pool = 8 * MIB
    server, target = unix_server("--shm-bytes", str(pool))
    port = metrics_port(server)
    path = target.removeprefix("unix:")
    hostile, token, fd = _session(path + ".shm")
    # The descriptor is read-only: the pool cannot be written, grown or shrunk through it.
    with pytest.raises(OSError):
        os.write(fd, b"x")
    with pytest.raises(OSError):
        os.ftruncate(fd, 0)
    with pytest.raises(OSError):
        mmap.mmap(fd, MIB, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    channel = grpc.insecure_channel(target)
    get = channel.unary_unary(
        "/posenc.v1.PositionalEncodingService/GetEncoding",
        request_serializer=pb.GetEncodingRequest.SerializeToString,
        response_deserializer=wire.decode_unary_response,
    )
    placed = 0
    for start in range(0, 40 * ROWS, ROWS):  # 40 ranges of 2 MiB: five times the pool
        request = pb.GetEncodingRequest(
            spec=pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=D_MODEL)),
            range=pb.PositionRange(start=start, stop=start + ROWS),
            shared_memory_session=token,
        )
        placed += isinstance(get(request, timeout=30), wire.SharedView)
    assert placed == pool // (ROWS * D_MODEL * 4)  # then the rows came in responses
    wait_until(lambda: metric(scrape(port), "posenc_shm_leased_bytes") == pool, "pool leased")
    with posenc.Client(target) as other, posenc.Client(server.target) as tcp:
        rows = other.get_range(0, 3 * ROWS, D_MODEL, copy=False)
        assert not in_shared_memory(rows)  # no room: in the response, as without a pool
        assert np.array_equal(rows, tcp.get_range(0, 3 * ROWS, D_MODEL))
        hostile.close()  # the peer goes away: its leases end
        wait_until(lambda: metric(scrape(port), "posenc_shm_leased_bytes") == 0, "released")
        again = other.get_range(0, 3 * ROWS, D_MODEL, copy=False)
        assert in_shared_memory(again) and np.array_equal(again, rows)
    os.close(fd)
    channel.close()


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_LIBC.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: the pages read as 0


def _native(failed: bool) -> None:
    if failed:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _attack(region_socket: str, size: int) -> dict[str, Any]:
    """What an admitted peer tries on the pool's descriptor: each attack's outcome,
    "refused: <error>" or "done" (it then wrote NaN, or zeros, over the whole pool)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(region_socket)
    _, ancillary, _, _ = connection.recvmsg(64, socket.CMSG_SPACE(4))
    fds = [int.from_bytes(data[:4], "little") for _, _, data in ancillary]
    outcomes: dict[str, Any] = {"uid": os.getuid(), "fds": len(fds)}

    def attempt(name: str, action: Callable[[], object]) -> None:
        try:
            action()
            outcomes[name] = "done"
        except OSError as error:
            outcomes[name] = f"refused: {error.strerror}"

    def mapped(fd: int) -> None:
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as pool:
            pool[:] = b"\xff" * size

    def protected(fd: int) -> None:
        address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        _native(address in (None, ctypes.c_void_p(-1).value))
        _native(_LIBC.mprotect(address, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0)
        ctypes.memset(address, 0xFF, size)

    def attack(fd: int, suffix: str) -> None:
        attempt("pwrite" + suffix, lambda: os.pwrite(fd, b"\xff" * mmap.PAGESIZE, 0))
        attempt("writable map" + suffix, lambda: mapped(fd))
        attempt("mprotect" + suffix, lambda: protected(fd))
        attempt(
            "punch hole" + suffix, lambda: _native(_LIBC.fallocate(fd, _PUNCH_HOLE, 0, size) != 0)
        )
        attempt("truncate" + suffix, lambda: os.ftruncate(fd, 0))

    if fds:
        attack(fds[0], "")
        try:
            reopened = os.open(f"/proc/self/fd/{fds[0]}", os.O_RDWR)
        except OSError as error:
            outcomes["reopen for writing"] = f"refused: {error.strerror}"
        else:
            outcomes["reopen for writing"] = "done"
            attack(reopened, " (reopened)")
    return outcomes


def _as_user(
    uid: int, gid: int, action: Callable[[], dict[str, Any]], groups: tuple[int, ...] = ()
) -> dict[str, Any]:
    """``action()``'s answer, run in a child process of ``uid``, ``gid`` and the
    supplementary ``groups`` (forked: the interpreter's own files need not be readable by
    that uid)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the action, then out without cleanup
        code = 1
        try:
            os.close(read)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            os.write(write, json.dumps(action()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        text = answer.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and text, "the attacker failed"
    outcome: dict[str, Any] = json.loads(text)
    return outcome


_NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid needs root")
def test_no_peer_can_write_the_pool_another_process_reads(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    """An admitted peer of another uid (no token, no certificate: the region socket asks
    for none) gets the pool's read-only descriptor and tries every way to write through it:
    pwrite, a writable shared map, mprotect of a read-only one to writing, punching holes,
    truncating, and reopening it read-write through /proc/self/fd to do all of that again.
    Each is refused, and what this process had read (a copy=False view, held throughout)
    and reads again is the server's rows, bit for bit. Root, who may open any inode,
    reopens it read-write too: the seals refuse its writes the same way."""
    pool = 4 * MIB
    directory = Path(tempfile.mkdtemp(prefix="posenc-peers-"))
    directory.chmod(0o755)  # the peer's way to the sockets (their group admits it)
    try:
        path = directory / "posenc.sock"
        server = spawn_server(
            0,
            *("--unix-socket", str(path), "--shm-bytes", str(pool)),
            *("--shm-peers", f"uid:{os.getuid()},uid:{_NOBODY}"),
        )
        os.chown(f"{path}.shm", -1, _NOBODY)
        with posenc.Client(server.target) as tcp, posenc.Client(f"unix:{path}") as local:
            expected = tcp.get_range(0, ROWS, D_MODEL)
            view = local.get_range(0, ROWS, D_MODEL, copy=False)
            assert in_shared_memory(view) and same_bits(view, expected)
            peer = _as_user(_NOBODY, _NOBODY, lambda: _attack(f"{path}.shm", pool))
            assert peer["uid"] == _NOBODY and peer["fds"] == 1, peer
            attacks = {k: v for k, v in peer.items() if k not in ("uid", "fds")}
            assert attacks["reopen for writing"] == "refused: Permission denied", peer
            assert len(attacks) == 6 and all(v.startswith("refused") for v in attacks.values())
            # Root may reopen any inode read-write: what it can do with that is what the
            # server's own uid could, and the seals refuse every write of it.
            root = _attack(f"{path}.shm", pool)
            assert root["reopen for writing"] == "done", root
            root_attacks = {k: v for k, v in root.items() if k.endswith("(reopened)")}
            assert len(root_attacks) == 5
            assert all(v.startswith("refused") for v in root_attacks.values()), root
            assert same_bits(view, expected)  # the view held throughout
            again = local.get_range(0, ROWS, D_MODEL, copy=False)  # the region cached
            assert in_shared_memory(again) and same_bits(again, expected)
            assert same_bits(local.get_range(0, ROWS, D_MODEL), expected)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_view_outlives_its_client_and_its_server(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    server, target = unix_server("--shm-bytes", str(16 * MIB))
    with posenc.Client(server.target) as tcp:
        expected = tcp.get_range(5, 5 + ROWS, D_MODEL)
    with posenc.Client(target) as local:
        view = local.get_range(5, 5 + ROWS, D_MODEL, copy=False)
    server.terminate()
    server.process.wait(30)
    assert np.array_equal(view, expected)  # the pages live while they are mapped


def test_a_peer_outside_shm_peers_gets_rows_but_no_memory(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    """Credentials are the kernel's (SO_PEERCRED): with --shm-peers naming another uid and
    gid than this process's, the region socket gives it no session and no descriptor, and
    its calls over the unix socket get every row in responses."""
    other = max(os.getuid(), os.getgid()) + 4242
    server, target = unix_server(
        "--shm-bytes", str(16 * MIB), "--shm-peers", f"uid:{other},gid:{other}"
    )
    path = target.removeprefix("unix:")
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    raw.connect(path + ".shm")
    message, ancillary, _, _ = raw.recvmsg(64, socket.CMSG_SPACE(4))
    assert (message, ancillary) == (b"", [])  # closed at once: nothing handed out
    raw.close()
    with posenc.Client(target) as local, posenc.Client(server.target) as tcp:
        rows = local.get_range(0, ROWS, D_MODEL, copy=False)
        assert not in_shared_memory(rows)
        assert np.array_equal(rows, tcp.get_range(0, ROWS, D_MODEL))
    # Two refusals in a moment: both counted, the first logged (then one line per 10 s).
    refusals = [e for e in server.logs() if e["message"] == "region socket: refused a peer"]
    assert len(refusals) == 1 and refusals[0]["uid"] == os.getuid()
    port = metrics_port(server)
    wait_until(lambda: metric(scrape(port), "posenc_shm_refused_total") == 2, "counted")


def _hello(path: str) -> tuple[bytes, int]:
    """What a new connection to the region socket ``path`` gets: its message and the
    number of descriptors beside it (a refusal: nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.connect(path)
        message, ancillary, _, _ = connection.recvmsg(64, socket.CMSG_SPACE(4))
        for _, _, data in ancillary:
            os.close(struct.unpack("i", data[:4])[0])
        return message, len(ancillary)


def test_a_peer_that_connects_in_a_loop_is_logged_once_and_counted_in_full(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    other = max(os.getuid(), os.getgid()) + 4242
    server, target = unix_server("--shm-bytes", str(MIB), "--shm-peers", f"uid:{other}")
    path = target.removeprefix("unix:") + ".shm"
    for _ in range(500):
        assert _hello(path) == (b"", 0)
    port = metrics_port(server)
    wait_until(lambda: metric(scrape(port), "posenc_shm_refused_total") == 500, "counted")
    refusals = [e for e in server.logs() if e["message"] == "region socket: refused a peer"]
    assert 1 <= len(refusals) <= 2, refusals  # 10 s apart at most: the loop takes less


def test_one_process_cannot_take_every_session(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    """A process that opens sessions and never closes them gets 16, its share: others
    still get theirs."""
    server, target = unix_server("--shm-bytes", str(MIB))
    path = target.removeprefix("unix:") + ".shm"
    held = [_session(path) for _ in range(shm.MAX_SESSIONS_PER_PEER)]
    try:
        assert _hello(path) == (b"", 0)  # this process: refused
        other = subprocess.run(
            [sys.executable, "-c", _OTHER_PEER, path],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert other.stdout.split() == [str(regions.HELLO_BYTES), "1"], other.stderr
    finally:
        for connection, _, fd in held:
            connection.close()
            os.close(fd)
    refusals = [e for e in server.logs() if e["message"] == "region socket: refused a peer"]
    assert "16 sessions" in str(refusals[0]["reason"]), refusals


# Another process's hello: its length and the descriptors beside it.
_OTHER_PEER = """
import socket, sys
connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
connection.connect(sys.argv[1])
message, ancillary, _, _ = connection.recvmsg(64, socket.CMSG_SPACE(4))
print(len(message), len(ancillary))
"""


def test_a_release_longer_than_any_ends_the_session_instead_of_being_cut(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    """513 leases (4,105 bytes) are more than a release carries: the message is refused
    whole (the session ends), not cut to its first 512 leases and taken."""
    server, target = unix_server("--shm-bytes", str(MIB))
    port = metrics_port(server)
    connection, _, fd = _session(target.removeprefix("unix:") + ".shm")
    try:
        wait_until(lambda: metric(scrape(port), "posenc_shm_sessions") == 1, "session")
        connection.send(b"R" + struct.pack("<513Q", *range(1, 514)))
        connection.settimeout(30)
        assert connection.recv(1) == b""  # the server closed it
        wait_until(lambda: metric(scrape(port), "posenc_shm_sessions") == 0, "session ended")
        again, _, again_fd = _session(target.removeprefix("unix:") + ".shm")
        again.send(regions.release(list(range(1, 513))))  # the longest release is taken
        wait_until(lambda: metric(scrape(port), "posenc_shm_sessions") == 1, "served")
        again.close()
        os.close(again_fd)
    finally:
        connection.close()
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid needs root")
def test_a_supplementary_member_of_a_peer_group_is_admitted(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    """``--shm-peers gid:N`` admits a process whose supplementary groups hold N, as the
    kernel gives them (SO_PEERGROUPS), not only one whose primary group is N."""
    group = 4242
    directory = Path(tempfile.mkdtemp(prefix="posenc-peers-"))
    directory.chmod(0o755)
    try:
        path = directory / "posenc.sock"
        spawn_server(
            0,
            *("--unix-socket", str(path), "--shm-bytes", str(MIB), "--shm-peers", f"gid:{group}"),
        )
        # Open to every uid, so that the credentials alone decide who is served.
        os.chmod(f"{path}.shm", 0o666)

        def hello() -> dict[str, Any]:
            message, descriptors = _hello(f"{path}.shm")
            return {"hello": len(message), "descriptors": descriptors}

        member = _as_user(_NOBODY, _NOBODY, hello, groups=(group,))
        assert member == {"hello": regions.HELLO_BYTES, "descriptors": 1}
        outsider = _as_user(_NOBODY, _NOBODY, hello, groups=(group + 1,))
        assert outsider == {"hello": 0, "descriptors": 0}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_several_processes_serve_the_unix_socket_from_the_first(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    server, target = unix_server("--processes", "2", "--shm-bytes", str(16 * MIB))
    with posenc.Client(target) as local, posenc.Client(server.target) as tcp:
        view = local.get_range(0, ROWS, D_MODEL, copy=False)
        assert in_shared_memory(view) and np.array_equal(view, tcp.get_range(0, ROWS, D_MODEL))


def test_the_unix_socket_is_refused_when_taken_or_not_a_socket(
    unix_server: Callable[..., tuple[ServerProcess, str]], tmp_path: Path
) -> None:
    server, target = unix_server("--shm-bytes", str(16 * MIB))
    path = target.removeprefix("unix:")
    taken = subprocess.run(
        [*SERVE, "--unix-socket", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert taken.returncode == 1 and path in taken.stderr and "--unix-socket" in taken.stderr
    regular = tmp_path / "file"
    regular.write_text("keep me")
    refused = subprocess.run(
        [*SERVE, "--unix-socket", str(regular)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "not a socket" in refused.stderr
    assert regular.read_text() == "keep me"
    bad = subprocess.run(
        [sys.executable, "-m", "posenc_server", "--shm-peers", "everyone"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--shm-peers" in bad.stderr
    assert server.process.poll() is None  # the first server serves on


def test_the_async_client_takes_ranges_through_shared_memory(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    server, target = unix_server("--shm-bytes", str(16 * MIB))

    async def fetch() -> tuple[Any, Any]:
        async with posenc.AsyncClient(target) as local:
            copied = await local.get_range(0, ROWS, D_MODEL)
            view = await local.get_range(0, ROWS, D_MODEL, copy=False)
            return copied, view

    copied, view = asyncio.run(fetch())
    assert copied.flags.writeable and in_shared_memory(view)
    with posenc.Client(server.target) as tcp:
        expected = tcp.get_range(0, ROWS, D_MODEL)
    assert np.array_equal(copied, expected) and np.array_equal(view, expected)
