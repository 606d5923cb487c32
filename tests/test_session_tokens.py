"""A region session's token, held by a process it was not handed to.

The server cannot tell which process sends a call on its unix socket (gRPC gives a handler
no credentials or descriptor of a unix-socket caller), so the token a GetEncoding call
carries is a bearer secret of its session. What a process holding another's token can do
is bounded, and these tests perform it: it learns where rows lie in memory it cannot map
(the descriptor is handed only to the admitted peer, on the region socket), it cannot end
the session's leases (releases are taken only on the session's own region connection), it
changes nothing any process reads, and once it holds every lease the session may hold, that
session's calls get their rows in responses, exact, as a client outside ``--shm-peers``
does.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from conftest import ServerProcess, wait_until
from test_operations import metric, metrics_port, scrape
from test_shared_memory import D_MODEL, ROWS, _session, unix_server

import posenc
from posenc_protocol import regions, wire
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_server import shm

__all__ = ["unix_server"]  # the fixture, used here by name


def _caller(target: str) -> tuple[grpc.Channel, Callable[[int, bytes], Any]]:
    """A connection of its own to ``target`` and a GetEncoding of ``ROWS`` rows from
    ``start`` that carries ``token``."""
    channel = grpc.insecure_channel(target)
    call = channel.unary_unary(
        "/posenc.v1.PositionalEncodingService/GetEncoding",
        request_serializer=pb.GetEncodingRequest.SerializeToString,
        response_deserializer=wire.decode_unary_response,
    )

    def get(start: int, token: bytes) -> Any:
        request = pb.GetEncodingRequest(
            spec=pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=D_MODEL)),
            range=pb.PositionRange(start=start, stop=start + ROWS),
            shared_memory_session=token,
        )
        return call(request, timeout=30)

    return channel, get


def _rows(fd: int, view: wire.SharedView) -> Any:
    size = view.rows * view.columns * 4
    memory = mmap.mmap(fd, view.offset + size, prot=mmap.PROT_READ)
    return np.frombuffer(memory, np.float32, view.rows * view.columns, view.offset).reshape(
        view.rows, view.columns
    )


def test_a_token_used_by_another_process_changes_nothing_it_reads(
    unix_server: Callable[..., tuple[ServerProcess, str]],
) -> None:
    server, target = unix_server("--shm-bytes", str(64 << 20))
    port = metrics_port(server)
    path = target.removeprefix("unix:") + ".shm"
    own, token, fd = _session(path)
    own_channel, own_get = _caller(target)
    thief_channel, thief_get = _caller(target)
    held = own_get(0, token)
    assert isinstance(held, wire.SharedView)
    rows = _rows(fd, held)
    before = rows.copy()
    with posenc.Client(server.target) as tcp:
        exact = tcp.get_range(0, ROWS, D_MODEL)
    assert np.array_equal(before, exact)

    # The thief's calls under the stolen token place rows it could ask for anyway, and say
    # where; it holds no descriptor of the memory, and its own session (the region socket
    # admits it too here) ends no lease of another's.
    stolen = thief_get(2 * ROWS, token)
    assert isinstance(stolen, wire.SharedView) and stolen.offset != held.offset
    two = 2 * ROWS * D_MODEL * 4
    wait_until(lambda: metric(scrape(port), "posenc_shm_leased_bytes") == two, "both leased")
    thief, _, thief_fd = _session(path)
    thief.send(regions.release([held.lease, stolen.lease]))
    time.sleep(0.5)  # the region socket has read the release: nothing may have ended
    assert metric(scrape(port), "posenc_shm_leased_bytes") == two
    assert np.array_equal(rows, before)

    # It takes every lease the session may hold: the session's next calls get their rows in
    # responses, exact, and what it holds stays as it was.
    for _ in range(shm.MAX_LEASES):
        thief_get(0, token)
    after = own_get(ROWS, token)
    assert not isinstance(after, wire.SharedView)
    assert np.array_equal(rows, before)
    with posenc.Client(server.target) as tcp:
        answered = np.frombuffer(after.data, np.float32).reshape(ROWS, D_MODEL)
        assert np.array_equal(answered, tcp.get_range(ROWS, 2 * ROWS, D_MODEL))

    # The session ends with its peer's region connection: every lease under its token too.
    own.close()
    thief.close()
    wait_until(lambda: metric(scrape(port), "posenc_shm_leased_bytes") == 0, "released")
    for channel in (own_channel, thief_channel):
        channel.close()
    os.close(fd)
    os.close(thief_fd)
