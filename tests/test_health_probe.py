"""The probe for kubelets: ``GET /healthz`` on the metrics port.

It says whether a new call is served: NOT_SERVING while an unauthenticated client holds
every connection the gRPC port allows (where a probe of gRPC health then fails too), or while
the unix socket's worker is stopped; ``/livez`` answers 200 all the same, so the flood
restarts nothing. Both answer while the client floods the metrics port itself with
connections that never speak; both turn 503 when a drain starts.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ServerProcess, Spawn, closing_all, fresh_probe, worker_pids
from grpc_health.v1 import health_pb2
from rawh2 import RawConnection
from test_cli import posenc_cli
from test_operations import metrics_port

import posenc
from posenc_server.metrics import HEALTH_PATH as HEALTHZ
from posenc_server.metrics import LIVE_PATH as LIVEZ


def healthz(port: int, path: str = "/healthz") -> tuple[int, bytes]:
    """One probe on a new connection, as a kubelet's: the status and the body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.fixture
def flooded(spawn_server: Spawn) -> Iterator[ServerProcess]:
    """A 2-process server whose gRPC port holds all the connections it allows (16 each),
    all idle HTTP/2 connections of one client, and whose metrics port has 200 connections
    that never send a request."""
    server = spawn_server(0, "--processes", "2", "--max-connections", "16")
    grpc_flood = [RawConnection("127.0.0.1", server.port) for _ in range(200)]
    metrics_flood = [
        socket.create_connection(("127.0.0.1", metrics_port(server))) for _ in range(200)
    ]
    try:
        yield server
    finally:
        for connection in grpc_flood:
            connection.close()
        for sock in metrics_flood:
            sock.close()


def _until(path: str, port: int, answer: tuple[int, bytes]) -> list[tuple[int, bytes]]:
    """Probes of ``path`` until one gets ``answer`` (the pytest timeout is the hang
    guard); the answers before it."""
    before = []
    while (got := healthz(port, path)) != answer:
        before.append(got)
        time.sleep(0.05)
    return before


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_connection_flood_fails_readiness_not_liveness(flooded: ServerProcess) -> None:
    """While a client holds every connection the gRPC port allows, a new call finds no
    place: /healthz says NOT_SERVING, as a probe of the gRPC port finds, so a balancer
    moves traffic away; /livez still answers 200, so nothing restarts the server for it,
    and no worker is replaced."""
    before = worker_pids(flooded.process.pid)
    assert len(before) == 2
    # The flood is real: a probe of the gRPC port finds no place.
    assert fresh_probe(flooded.target) != health_pb2.HealthCheckResponse.SERVING
    port = metrics_port(flooded)
    _until(HEALTHZ, port, (503, b"NOT_SERVING\n"))
    # Probes the way the kubelet runs them (a liveness period is 10 s; here back to back, for
    # longer than the supervisor takes to replace a worker that fails its checks).
    answers = [(healthz(port, LIVEZ), healthz(port)) for _ in range(50)]
    # Longer than the supervisor takes to replace a worker that fails its checks (3, each
    # up to 2 s); the metrics port's silent connections are closed after 5 s: open them anew.
    time.sleep(8)
    with closing_all([socket.create_connection(("127.0.0.1", port)) for _ in range(200)]):
        answers += [(healthz(port, LIVEZ), healthz(port)) for _ in range(50)]
    assert set(answers) == {((200, b"SERVING\n"), (503, b"NOT_SERVING\n"))}
    assert worker_pids(flooded.process.pid) == before
    # The containers' liveness check, `posenc health --http` of /livez, passes the same way.
    probe = posenc_cli("health", "--http", f"http://127.0.0.1:{port}{LIVEZ}", "--timeout", "10")
    assert (probe.returncode, probe.stdout.strip()) == (0, "SERVING"), probe.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_healthz_serves_again_once_a_flood_ends(spawn_server: Spawn) -> None:
    """One process at --max-connections 8: /healthz turns NOT_SERVING under 50 idle
    connections, whose probe of gRPC health fails too, and SERVING once they close."""
    server = spawn_server(0, "--max-connections", "8")
    port = metrics_port(server)
    assert healthz(port) == (200, b"SERVING\n")
    with closing_all([RawConnection("127.0.0.1", server.port) for _ in range(50)]):
        _until(HEALTHZ, port, (503, b"NOT_SERVING\n"))
        assert fresh_probe(server.target, timeout=10) != health_pb2.HealthCheckResponse.SERVING
        assert healthz(port, LIVEZ) == (200, b"SERVING\n")
    _until(HEALTHZ, port, (200, b"SERVING\n"))
    assert fresh_probe(server.target) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_healthz_fails_while_the_unix_sockets_worker_is_stopped(
    spawn_server: Spawn, tmp_path: Path
) -> None:
    """The first of two workers serves the unix socket alone: stopped, its clients get
    nothing, so /healthz says NOT_SERVING within a health check (not 200 while the other
    worker answers), /livez stays 200, and /healthz serves again once it is replaced."""
    socket_path = tmp_path / "posenc.sock"
    server = spawn_server(0, "--processes", "2", "--unix-socket", str(socket_path))
    port = metrics_port(server)
    first = worker_pids(server.process.pid)[0]
    with open(f"/proc/{first}/environ", "rb") as environ:
        assert b"POSENC_WORKER_INDEX=0\0" in environ.read()  # the unix socket's worker
    os.kill(first, signal.SIGSTOP)
    try:
        _until(HEALTHZ, port, (503, b"NOT_SERVING\n"))
        assert healthz(port, LIVEZ) == (200, b"SERVING\n")
    finally:
        os.kill(first, signal.SIGCONT)
    _until(HEALTHZ, port, (200, b"SERVING\n"))
    with posenc.Client(f"unix:{socket_path}", timeout=30) as client:
        assert client.health() == "SERVING"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_healthz_turns_503_while_no_worker_answers_and_200_once_replaced(
    spawn_server: Spawn,
) -> None:
    server = spawn_server(0, "--processes", "2")
    port = metrics_port(server)
    hung = worker_pids(server.process.pid)
    for pid in hung:
        os.kill(pid, signal.SIGSTOP)  # alive, but answering nothing: hung
    status = 200
    while status == 200:  # the pytest timeout is the hang guard
        status, body = healthz(port)
    assert (status, body) == (503, b"NOT_SERVING\n")
    while status == 503:  # the supervisor replaces both
        status, body = healthz(port)
    assert (status, body) == (200, b"SERVING\n")
    assert set(worker_pids(server.process.pid)).isdisjoint(hung)


@pytest.mark.timeout(60)
def test_healthz_turns_503_when_the_drain_starts(spawn_server: Spawn) -> None:
    server = spawn_server(0, "--grace-seconds", "60")
    port = metrics_port(server)
    assert healthz(port) == (200, b"SERVING\n")
    assert healthz(port, "/health")[0] == 404
    elsewhere = posenc_cli("health", "--http", f"http://127.0.0.1:{port}/health")
    assert (elsewhere.returncode, elsewhere.stdout.strip()) == (1, "HTTP 404")
    with posenc.Client(server.target) as client:
        # A stream left unread keeps the drain going while the probe is asked.
        rows = client.iter_range(0, 1 << 18, 4096)
        next(rows)
        server.terminate()
        status = 200
        while status == 200:
            status, body = healthz(port)
        assert (status, body) == (503, b"NOT_SERVING\n")
        probe = posenc_cli("health", "--http", f"http://127.0.0.1:{port}/healthz")
        assert (probe.returncode, probe.stdout.strip()) == (1, "NOT_SERVING")
        assert server.process.poll() is None  # still draining
        server.process.send_signal(signal.SIGTERM)  # a second signal ends the drain
    assert server.process.wait(30) == 0
