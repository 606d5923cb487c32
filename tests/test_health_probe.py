"""The probe for kubelets: ``GET /healthz`` on the metrics port.

It must answer while an unauthenticated client holds every connection the gRPC port allows
(where a probe of gRPC health then fails), and while the client floods the metrics port
itself with connections that never speak; it must turn 503 when a drain starts.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import ServerProcess, fresh_probe, worker_pids
from grpc_health.v1 import health_pb2
from rawh2 import RawConnection
from test_cli import posenc_cli
from test_operations import metrics_port

import posenc


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
def flooded(spawn_server: Callable[..., ServerProcess]) -> Iterator[ServerProcess]:
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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_connection_flood_fails_the_http_probe(flooded: ServerProcess) -> None:
    before = worker_pids(flooded.process.pid)
    assert len(before) == 2
    # The flood is real: a probe of the gRPC port finds no place.
    assert fresh_probe(flooded.target) != health_pb2.HealthCheckResponse.SERVING
    port = metrics_port(flooded)
    # Probes the way the kubelet runs them (a liveness period is 10 s; here back to back, for
    # longer than the supervisor takes to replace a worker that fails its checks).
    answers = [healthz(port) for _ in range(50)]
    # Longer than the supervisor takes to replace a worker that fails its checks (3, each
    # up to 2 s); the metrics port's silent connections are closed after 5 s: open them anew.
    time.sleep(8)
    again = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        answers += [healthz(port) for _ in range(50)]
    finally:
        for sock in again:
            sock.close()
    assert set(answers) == {(200, b"SERVING\n")}
    assert worker_pids(flooded.process.pid) == before
    # The containers' health check, `posenc health --http`, passes the same way.
    url = f"http://127.0.0.1:{port}/healthz"
    probe = posenc_cli("health", "--http", url, "--timeout", "10")
    assert (probe.returncode, probe.stdout.strip()) == (0, "SERVING"), probe.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_healthz_turns_503_while_no_worker_answers_and_200_once_replaced(
    spawn_server: Callable[..., ServerProcess],
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
def test_healthz_turns_503_when_the_drain_starts(
    spawn_server: Callable[..., ServerProcess],
) -> None:
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
