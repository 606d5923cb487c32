"""A server that vanishes mid-stream without a reset (its host or its container network gone:
no FIN, no RST, nothing) is seen within a bound by HTTP/2 keepalive pings, and the SDK's
stream resumes on a new connection instead of waiting forever.

The vanishing is a TCP relay in the test that stops relaying one connection, both ways,
while keeping its sockets open: what a client sees when the replica's network disappears.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import ServerProcess
from reference import classic

import posenc
from posenc_server import engine


class Relay:
    """Relays TCP connections from a port of its own to ``target``; ``vanish()`` makes the
    connections relayed so far go silent (their sockets stay open, nothing passes)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.connections: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            self._accept_until_stopped()

    def _accept_until_stopped(self) -> None:
        while not self.stopped.is_set():
            readable, _, _ = select.select([self.listener], [], [], 0.1)
            if not readable:
                continue
            client, _ = self.listener.accept()
            upstream = socket.create_connection(self.target)
            silent = threading.Event()
            self.connections.append((client, upstream, silent))
            threading.Thread(
                target=self._relay, args=(client, upstream, silent), daemon=True
            ).start()

    def _relay(
        self, client: socket.socket, upstream: socket.socket, silent: threading.Event
    ) -> None:
        peers = {client: upstream, upstream: client}
        with contextlib.suppress(OSError):
            while not self.stopped.is_set() and not silent.is_set():
                readable, _, _ = select.select(list(peers), [], [], 0.1)
                for sock in readable:
                    if silent.is_set():
                        break
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    peers[sock].sendall(data)

    def vanish(self) -> int:
        """Silence every connection relayed so far; how many."""
        for _, _, silent in self.connections:
            silent.set()
        return len(self.connections)

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()
        for client, upstream, _ in self.connections:
            client.close()
            upstream.close()


@pytest.fixture
def relay(spawn_server: Callable[..., ServerProcess]) -> Iterator[Relay]:
    server = spawn_server(0)
    relay = Relay(("127.0.0.1", server.port))
    yield relay
    relay.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stream_whose_server_vanishes_resumes_on_a_new_connection(relay: Relay) -> None:
    """Without keepalive the stream waited on the silent connection for ever (a vanished
    replica behind nginx: still hung after 10 minutes). With the SDK's pings (every 20 s,
    10 s to answer) the dead connection is given up, and the stream resumes: all its rows
    arrive, exact, well within 120 s."""
    rows, width = 1 << 16, 1024
    outcome: dict[str, object] = {}

    def fetch() -> None:
        try:
            with posenc.Client(f"127.0.0.1:{relay.port}", connections=1) as client:
                stream = client.iter_range(0, rows, width, chunk_bytes=64 * 1024)
                _, first = next(stream)
                outcome["connections"] = relay.vanish()
                parts = [first, *(chunk for _, chunk in stream)]
                outcome["table"] = np.concatenate(parts)
        except Exception as error:  # reported by the test below
            outcome["error"] = error

    fetcher = threading.Thread(target=fetch, daemon=True)
    fetcher.start()
    fetcher.join(120)
    assert not fetcher.is_alive(), "the stream still waits on a vanished server"
    assert "error" not in outcome, outcome.get("error")
    assert len(relay.connections) > outcome["connections"]  # it reconnected
    table = outcome["table"]
    assert isinstance(table, np.ndarray) and table.shape == (rows, width)
    np.testing.assert_array_equal(table[-4:], engine.encode_range(classic(width), rows - 4, rows))
