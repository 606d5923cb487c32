"""Hostile and heavy clients (issue 10): raw HTTP/2 and raw protobuf, as an attacker sends them.

Each test reproduces one attack against a real server process and checks what the server
promises: health answers, memory stays within the cache budget plus 128 MiB, refusals are
clear (UNAUTHENTICATED, RESOURCE_EXHAUSTED with RetryInfo, DEADLINE_EXCEEDED), and the
metrics do not grow with what a caller invents.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import pytest
from conftest import (
    SERVER_HEADROOM_MIB,
    Spawn,
    closing_all,
    current_rss_mib,
    fresh_probe,
    peak_rss_mib,
    sizing_rule_mib,
    worker_pids,
)
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from rawh2 import RawConnection
from reference import classic
from test_operations import metric, metrics_port, scrape

import posenc
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_server import admission
from posenc_server.app import RunningServer
from posenc_server.engine import encode_positions, encode_range

MIB = 1 << 20
GET_ENCODING = "/posenc.v1.PositionalEncodingService/GetEncoding"
SERVER_INFO = "/posenc.v1.PositionalEncodingService/GetServerInfo"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
UNAUTHENTICATED, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED = 16, 8, 4
# What a memory test allows above the process's own memory at its start.
HEADROOM_MIB = 128


def settled_rss_mib(pid: int, bound: float, seconds: float = 3.0) -> float:
    """The resident memory of process ``pid`` once it is within ``bound`` MiB, or after
    ``seconds``: the server trims its heap five times a second, not at once."""
    deadline = time.monotonic() + seconds
    while (rss := current_rss_mib(pid)) > bound and time.monotonic() < deadline:
        time.sleep(0.1)
    return rss


def encoding_request(start: int, stop: int, d_model: int) -> bytes:
    """A serialized GetEncodingRequest for a float32 sinusoidal range."""
    request = pb.GetEncodingRequest(
        spec=pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=d_model)),
        range=pb.PositionRange(start=start, stop=stop),
    )
    return request.SerializeToString()


def pump_until(connections: list[RawConnection], done: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        for connection in connections:
            connection.pump(0.02)


def assert_health_serving(target: str, checks: int = 5) -> None:
    """Each of ``checks`` health checks, every one on a new channel, answers SERVING."""
    statuses = [fresh_probe(target) for _ in range(checks)]
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * checks, statuses


@functools.cache
def refused_list() -> bytes:
    """A request no spec can hold (an M-RoPE section of 10**7 counts): 10 MB to refuse.
    Built once, when first asked for (it takes about a second)."""
    return pb.GetEncodingRequest(
        spec=pb.EncodingSpec(mrope=pb.MRopeTable(head_dim=64, mrope_section=[1] * 10**7)),
        range=pb.PositionRange(start=0, stop=4),
    ).SerializeToString()


def send_refused_lists(target: str, codes: list[grpc.StatusCode]) -> None:
    """Sends ``refused_list()`` twice on one new channel; the codes answered go into
    ``codes``."""
    options = [("grpc.max_send_message_length", 16 << 20)]
    request = refused_list()
    with grpc.insecure_channel(target, options=options) as channel:
        for _ in range(2):
            try:
                channel.unary_unary(GET_ENCODING)(request, timeout=60)
            except grpc.RpcError as error:
                codes.append(error.code())  # type: ignore[attr-defined]


def upper_case_connection(port: int) -> RawConnection:
    """A connection that sends header names as given, upper case included (HTTP/2 forbids)."""
    connection = RawConnection("127.0.0.1", port)
    connection.conn.config.validate_outbound_headers = False
    connection.conn.config.normalize_outbound_headers = False
    return connection


# -- 0: connection floods ---------------------------------------------------------------------


def _flood(port: int, count: int, open_at_most: int) -> list[RawConnection]:
    """``count`` idle HTTP/2 connections (preface and settings sent, no call), read from
    until no more than ``open_at_most`` are open (30 s at most, a hang guard), so that the
    ones the server closed know it."""
    connections = [RawConnection("127.0.0.1", port) for _ in range(count)]
    deadline = time.monotonic() + 30
    while (
        sum(not connection.closed for connection in connections) > open_at_most
        and time.monotonic() < deadline
    ):
        for connection in connections:
            connection.pump(0.005)
    return connections


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_connections_past_the_limit_are_closed_as_they_come(spawn_server: Spawn) -> None:
    """Each connection holds memory that no budget counts (about 17 KiB idle): 900 of them
    grew a server without a limit by 15 MiB. Past ``--max-connections`` they are closed at
    once, and when the flood ends, clients connect again."""
    server = spawn_server(0, "--max-connections", "32")
    before = current_rss_mib(server.process.pid)
    connections = _flood(server.port, 300, 32)
    try:
        assert sum(not connection.closed for connection in connections) <= 32
        assert sum(connection.closed for connection in connections) >= 268
        assert current_rss_mib(server.process.pid) - before < 3
    finally:
        for connection in connections:
            connection.close()
    with posenc.Client(server.target, timeout=10) as client:
        np.testing.assert_array_equal(
            client.get_range(5, 9, 16), client.get_positions([5, 6, 7, 8], 16)
        )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_connection_flood_leaves_the_supervisor_its_health_line(spawn_server: Spawn) -> None:
    """The supervisor checks its workers over a line of their own, which the connection
    limit does not count: a flood that fills the limit restarts no worker."""
    server = spawn_server(0, "--processes", "2", "--max-connections", "16")
    workers = worker_pids(server.process.pid)
    assert len(workers) == 2
    connections = _flood(server.port, 200, 32)
    try:
        assert sum(not connection.closed for connection in connections) <= 32
        time.sleep(5)  # the supervisor restarts a worker after 3 failed checks a second apart
        assert worker_pids(server.process.pid) == workers
    finally:
        for connection in connections:
            connection.close()
    assert_health_serving(server.target)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_connection_that_never_speaks_is_closed_by_the_handshake_timeout(
    spawn_server: Spawn,
) -> None:
    """A TCP connection that sends nothing would hold one of the limited places for as long
    as the attacker likes: one whose handshakes are not over within 10 s is closed, with a
    GOAWAY that says why. A connection that finished its handshake is not closed by that
    rule, and the place the silent one held serves clients again."""
    server = spawn_server(0, "--max-connections", "4")
    spoke = RawConnection("127.0.0.1", server.port)  # its preface and settings sent
    try:
        first = spoke.call(SERVER_INFO, b"")
        pump_until([spoke], lambda: spoke.closed or spoke.replies[first].status is not None, 30)
        assert spoke.replies[first].status == 0, spoke.replies[first]
        silent = socket.create_connection(("127.0.0.1", server.port))
        received = bytearray()
        try:
            silent.settimeout(60)  # a hang guard only: six times the handshake timeout
            while chunk := silent.recv(4096):  # the server's own settings, then its end
                received += chunk
        except ConnectionResetError:
            pass  # closed all the same
        finally:
            silent.close()
        # Accepted (the server's SETTINGS frame came: the limit did not turn it away), then
        # closed by gRPC's handshake timeout, which its GOAWAY's debug data names.
        assert received[3:4] == b"\x04", bytes(received)
        assert b"handshake timeout" in received, bytes(received)
        later = spoke.call(SERVER_INFO, b"")
        pump_until([spoke], lambda: spoke.closed or spoke.replies[later].status is not None, 30)
        assert not spoke.closed and spoke.replies[later].status == 0, spoke.replies[later]
    finally:
        spoke.close()
    with posenc.Client(server.target, timeout=30) as client:
        assert client.server_info().version


def _open_files_limit(pid: int) -> int:
    """The soft RLIMIT_NOFILE of process ``pid``."""
    with open(f"/proc/{pid}/limits") as limits:
        line = next(line for line in limits if line.startswith("Max open files"))
    return int(line.split()[3])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_connection_flood_under_a_low_soft_limit_takes_no_descriptor_calls_need(
    spawn_server: Spawn,
) -> None:
    """Started with a soft RLIMIT_NOFILE of 1,024 (a common default) under the default
    --max-connections of 4,096, the server raises the soft limit to what that needs, so
    2,048 raw connections that never speak leave health, calls and /healthz answering."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"the flood needs 8192 open files here, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the server inherits
    try:
        server = spawn_server(0)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 8192), hard))
    assert _open_files_limit(server.process.pid) >= 4096 + 256
    flood = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2048)]
    try:
        assert_health_serving(server.target)
        with posenc.Client(server.target, timeout=30) as client:
            assert client.get_range(0, 4, 16).shape == (4, 16)
        url = f"http://127.0.0.1:{metrics_port(server)}/healthz"
        with urllib.request.urlopen(url, timeout=30) as answer:
            assert answer.status == 200
    finally:
        for connection in flood:
            connection.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(120)
def test_a_hard_limit_below_the_connection_limit_refuses_to_start() -> None:
    """A hard limit of 1,024 cannot hold 4,096 connections: the server says so, naming
    both numbers and what to change, instead of serving until a flood takes its files."""
    serve = ("-m", "posenc_server", "--port", "0", "--metrics-port", "-1")
    refused = subprocess.run(
        ["prlimit", "--nofile=1024:1024", sys.executable, *serve, "--processes", "1"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert refused.returncode == 1, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "--max-connections 4096 needs 4352" in lines[0], lines
    assert "at most 1024" in lines[0] and "RLIMIT_NOFILE" in lines[0], lines


def flood_stalled_calls(
    port: int,
    method: str,
    stop: threading.Event,
    opened: list[int],
    pause: float,
    flooding: threading.Event | None = None,
) -> int:
    """Opens calls of ``method`` that send their headers and never their request, over 8
    connections to ``port``, one per open connection a round with ``pause`` seconds between
    them, until ``stop`` is set; ``opened[0]`` counts them, and ``flooding`` is set once 200
    are open. Returns how many of the connections were still open at the end."""
    with closing_all([RawConnection("127.0.0.1", port) for _ in range(8)]) as connections:
        while not stop.is_set():
            for connection in connections:
                if not connection.closed:
                    connection.call(method, None, end=False)
                    opened[0] += 1
                connection.pump(pause)
            if flooding is not None and opened[0] >= 200:
                flooding.set()
        return sum(not connection.closed for connection in connections)


# -- 1: stalled calls ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_512_stalled_calls_starve_neither_health_nor_real_calls(spawn_server: Spawn) -> None:
    """8 connections carry 64 GetEncoding calls each that send headers and never a message
    (the threaded server gave each one of its 64 threads: everything else timed out)."""
    server = spawn_server()
    with closing_all([RawConnection("127.0.0.1", server.port) for _ in range(8)]) as connections:
        streams = [
            (connection, connection.call(GET_ENCODING, None, end=False))
            for connection in connections
            for _ in range(64)
        ]
        for connection in connections:
            connection.pump(0.2)
        assert_health_serving(server.target)
        # Starved, the call would be refused (RESOURCE_EXHAUSTED) after the admission wait;
        # the timeout only guards against a hang.
        with posenc.Client(server.target, timeout=30, max_retries=0) as client:
            rows = client.get_range(1000, 1004, 8)
        positions = np.arange(1000, 1004)[:, None]
        inv_freq = 10000.0 ** (-np.arange(0, 8, 2) / 8)
        expected = np.empty((4, 8))
        expected[:, 0::2], expected[:, 1::2] = (
            np.sin(positions * inv_freq),
            np.cos(positions * inv_freq),
        )
        np.testing.assert_allclose(rows, expected, atol=1e-6)
        # Stalled calls that found no memory to read a request into were told to retry
        # (RESOURCE_EXHAUSTED with RetryInfo); the others are still open: the attack held.
        for connection in connections:
            connection.pump(0)
        ended = [connection.replies[stream] for connection, stream in streams]
        assert {reply.status for reply in ended if reply.ended} <= {RESOURCE_EXHAUSTED}
        assert sum(not reply.ended for reply in ended) >= 4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_request_that_never_arrives_is_cancelled(spawn_server: Spawn) -> None:
    """A call whose request message does not come (none of it, or half of it) is ended by
    the server's read timeout: DEADLINE_EXCEEDED with a message naming
    --read-timeout-seconds, counted under that code, and nothing stays in flight."""
    server = spawn_server(0, "--read-timeout-seconds", "0.5")
    port = metrics_port(server)
    before = scrape(port)
    connection = RawConnection("127.0.0.1", server.port)
    try:
        stalled = connection.call(GET_ENCODING, None, end=False)
        # Half a message: the length prefix promises 100 bytes, 10 come.
        partial = connection.call(GET_ENCODING, None, end=False)
        connection.conn.send_data(partial, b"\0\0\0\0\x64" + b"\0" * 10)
        connection.sock.sendall(connection.conn.data_to_send())
        # A hang guard only: far longer than the read timeout.
        pump_until(
            [connection],
            lambda: all(connection.replies[s].status is not None for s in (stalled, partial)),
            60,
        )
        for stream in (stalled, partial):
            reply = connection.replies[stream]
            assert reply.status == DEADLINE_EXCEEDED, reply
            assert "--read-timeout-seconds" in reply.trailers.get(
                "grpc-message", reply.headers.get("grpc-message", "")
            )
    finally:
        connection.close()

    def timed_out(samples: dict) -> float:  # type: ignore[type-arg]
        labels = {"method": "GetEncoding", "code": "DEADLINE_EXCEEDED"}
        return metric(samples, "posenc_requests_total", **labels)

    assert timed_out(scrape(port)) - timed_out(before) == 2  # the server counted both
    # Their reads' reservations were given back (the gauge is published five times a second).
    deadline = time.monotonic() + 30
    while in_flight_bytes(port) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert in_flight_bytes(port) == 0


# -- 13: authentication --------------------------------------------------------------------


@pytest.fixture
def token_server(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> tuple[RunningServer, str]:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    return server_factory(auth_token_file=str(token_file)), "s3cret"


@pytest.mark.timeout(60)
def test_unauthenticated_calls_are_refused_without_waiting_for_their_message(
    token_server: tuple[RunningServer, str],
) -> None:
    """Headers alone get UNAUTHENTICATED (no thread or coroutine waits for their message),
    streams included, and a reflection call that sends no message at all too (it got
    UNIMPLEMENTED)."""
    server, _ = token_server
    connection = RawConnection("127.0.0.1", server.port)
    try:
        open_calls = [connection.call(GET_ENCODING, None, end=False) for _ in range(200)]
        empty_reflection = connection.call(REFLECTION, None, end=True)
        # A hang guard only: a server that waited for the messages would end the calls
        # with DEADLINE_EXCEEDED at its read timeout, not UNAUTHENTICATED.
        pump_until(
            [connection],
            lambda: all(reply.status is not None for reply in connection.replies.values()),
            30,
        )
        for stream in [*open_calls, empty_reflection]:
            assert connection.replies[stream].status == UNAUTHENTICATED
        assert_health_serving(server.target)
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("headers", "allowed"),
    [
        ([("authorization", "Bearer s3cret")], True),
        ([("authorization", "bearer s3cret")], True),  # the scheme is case-insensitive
        ([("authorization", "BEARER  s3cret")], True),
        ([("authorization", "Bearer s3cret"), ("authorization", "Bearer s3cret")], False),
        ([("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")], False),
        ([("authorization", "Bearer s3cret"), ("authorization", "Bearer wrong")], False),
        ([("authorization", "Basic s3cret")], False),
        ([("authorization", "s3cret")], False),
        ([], False),
    ],
)
@pytest.mark.timeout(60)
def test_authorization_headers_on_the_wire(
    token_server: tuple[RunningServer, str], headers: list[tuple[str, str]], allowed: bool
) -> None:
    server, _ = token_server
    connection = RawConnection("127.0.0.1", server.port)
    try:
        stream = connection.call(SERVER_INFO, b"", metadata=headers)
        pump_until([connection], lambda: connection.replies[stream].status is not None, 10)
        reply = connection.replies[stream]
        assert reply.status == (0 if allowed else UNAUTHENTICATED), reply
    finally:
        connection.close()


def test_the_sdk_sends_a_token_only_over_protected_channels(
    token_server: tuple[RunningServer, str],
) -> None:
    server, token = token_server
    with pytest.raises(ValueError, match="local_channel_credentials"):
        posenc.Client(server.target, token=token)
    # The explicit opt-out for this machine: plaintext over loopback, checked by gRPC.
    local = grpc.local_channel_credentials()
    with posenc.Client(server.target, token=token, credentials=local, max_retries=0) as client:
        assert client.server_info().version
    with posenc.Client(server.target, token="wrong", credentials=local, max_retries=0) as client:
        with pytest.raises(posenc.PosencError) as refused:
            client.server_info()
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


# -- 7: metrics ----------------------------------------------------------------------------


def _invent_methods(target: str, count: int) -> None:
    with grpc.insecure_channel(target) as channel:
        for index in range(count):
            call = channel.unary_unary(f"/evil.v1.Made{index}/Up{index}")
            with pytest.raises(grpc.RpcError):
                call(b"", timeout=5)


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_made_up_methods_do_not_grow_the_metrics(
    spawn_server: Spawn,
    tmp_path: Path,
    processes: int,
) -> None:
    """Unauthenticated calls to invented methods all count under method="unknown": the
    /metrics page and the workers' multiprocess files stay the same size (2,000 methods grew
    the page by 8 MB before)."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    temp = tmp_path / "temp"  # where a supervisor makes its metrics directory
    temp.mkdir()
    server = spawn_server(
        0,
        *("--auth-token-file", str(token_file), "--processes", str(processes)),
        env={"TMPDIR": str(temp)},
    )
    port = metrics_port(server)
    _invent_methods(server.target, 10)

    def page_bytes() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            return len(page.read())

    def directory_bytes() -> int:  # blocks written, not the files' (sparse) lengths
        return sum(file.stat().st_blocks * 512 for file in temp.glob("*/*.db"))

    before_page, before_dir = page_bytes(), directory_bytes()
    _invent_methods(server.target, 2000)
    samples = scrape(port)
    refused = metric(samples, "posenc_requests_total", method="unknown", code="UNAUTHENTICATED")
    assert refused >= 2010
    assert page_bytes() - before_page < 1024
    assert directory_bytes() - before_dir < 64 * 1024
    assert not any("Made" in str(labels) for _, labels in samples)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_metrics_listen_on_their_own_host_and_serve_only_metrics(spawn_server: Spawn) -> None:
    server = spawn_server(0, "--host", "0.0.0.0")
    port = metrics_port(server)
    startup = next(entry for entry in server.logs() if entry["message"] == "listening")
    assert startup["metrics_host"] == "127.0.0.1"  # the default, whatever --host says
    assert scrape(port)
    for path in ("/", "/metricsx", "/favicon.ico", "/metrics/../debug"):
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
        assert missing.value.code == 404


def _closed(connection: socket.socket) -> bool:
    connection.settimeout(0.05)
    try:
        return connection.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def thread_count(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


@pytest.mark.slow
def test_silent_metrics_connections_are_bounded_and_closed(spawn_server: Spawn) -> None:
    """Connections to the metrics port that never finish a request took a thread each, for
    as long as they stayed open (2,000 connections: 2,000 threads): at most 32 are served
    at once (the others are closed as they come), and a silent one is closed after 5 s."""
    server = spawn_server(0, "--processes", "1")
    port = metrics_port(server)
    pid = server.process.pid
    # The threads of a server that has answered a scrape, counted once they stop changing:
    # a thread a fresh server starts late (on a busy machine) is not a connection's.
    assert scrape(port)
    baseline, previous = thread_count(pid), -1
    while baseline != previous:  # the pytest timeout is the hang guard
        time.sleep(0.5)
        previous, baseline = baseline, thread_count(pid)
    with closing_all(
        [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
    ) as silent:
        for connection in silent:
            connection.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never ended
        time.sleep(1)
        assert thread_count(pid) <= baseline + 32
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the served ones time out; a scrape gets in
            try:
                assert scrape(port)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        else:
            raise AssertionError("no scrape served while the silent connections stayed")
        open_ones = list(silent)
        deadline = time.monotonic() + 15
        while open_ones and time.monotonic() < deadline:
            readable, _, _ = select.select(open_ones, [], [], 0.5)
            open_ones = [c for c in open_ones if c not in readable or not _closed(c)]
        assert not open_ones, f"{len(open_ones)} silent connections still open"
    deadline = time.monotonic() + 10
    while thread_count(pid) > baseline + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert thread_count(pid) <= baseline + 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_health_calls_cannot_make_the_server_hold_memory(spawn_server: Spawn) -> None:
    """Health answers everyone, outside admission: 40 Check calls naming 10 MB services at
    once held 1.2 GiB, 20 such Watch calls (a Watch keeps its request while it is open) 840
    MiB, and 60,000 small Watch calls 417 MiB. Health reads one request at a time, a service
    name over 256 characters gets INVALID_ARGUMENT, a Watch past 1,024 open ones
    RESOURCE_EXHAUSTED, a call whose request does not come is ended by the read timeout,
    and the process stays within its memory bound (a Check that finds the read taken answers
    without reading its request)."""
    server = spawn_server(0, "--processes", "1", "--read-timeout-seconds", "2")
    pid = server.process.pid
    baseline = current_rss_mib(pid)

    async def attack() -> tuple[list[grpc.StatusCode], grpc.StatusCode, grpc.StatusCode]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            codes = []
            for index in range(20):
                call = stub.Watch(health_pb2.HealthCheckRequest(service=f"{index}" + "x" * 10**7))
                try:
                    await call.read()
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
            with pytest.raises(grpc.aio.AioRpcError) as long_check:
                await stub.Check(health_pb2.HealthCheckRequest(service="x" * 257))
            large = [
                stub.Check(health_pb2.HealthCheckRequest(service=f"{index}" + "x" * 10**7))
                for index in range(40)
            ]
            for outcome in await asyncio.gather(*large, return_exceptions=True):
                # Refused once read, or answered unread while another read (the server's
                # status: see health.Health.Check).
                if isinstance(outcome, grpc.aio.AioRpcError):
                    codes.append(outcome.code())
                else:
                    assert outcome.status == health_pb2.HealthCheckResponse.SERVING
            silent = channel.stream_stream("/grpc.health.v1.Health/Check")()
            with pytest.raises(grpc.aio.AioRpcError) as no_request:
                await asyncio.wait_for(silent.read(), 10)
            assert no_request.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(1024)]
            first = await asyncio.gather(*(watch.read() for watch in watches))
            assert all(reply.status == health_pb2.HealthCheckResponse.SERVING for reply in first)
            extra = stub.Watch(health_pb2.HealthCheckRequest())
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await extra.read()
            served = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert served.status == health_pb2.HealthCheckResponse.SERVING
            for watch in watches:
                watch.cancel()
            return codes, long_check.value.code(), refused.value.code()

    codes, long_check, refused = asyncio.run(attack())
    assert codes[:20] == [grpc.StatusCode.INVALID_ARGUMENT] * 20
    assert set(codes[20:]) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert peak_rss_mib(pid) <= baseline + HEADROOM_MIB
    assert long_check == grpc.StatusCode.INVALID_ARGUMENT
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert settled_rss_mib(pid, baseline + HEADROOM_MIB) <= baseline + HEADROOM_MIB
    assert_health_serving(server.target)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_health_watcher_that_never_reads_cannot_hold_up_the_drain(spawn_server: Spawn) -> None:
    """A Watch whose client announces a zero window: gRPC's own health servicer wrote the
    status while holding the lock that setting a status takes, so the drain's NOT_SERVING
    waited on that write forever (health stayed SERVING and the process never exited)."""
    server = spawn_server(0, "--grace-seconds", "5")
    watcher = RawConnection("127.0.0.1", server.port, window=0)
    try:
        watcher.call(
            "/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest().SerializeToString()
        )
        watcher.pump(0.5)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=20) == 0
    finally:
        watcher.close()


@pytest.mark.slow
def test_a_reflection_call_whose_request_never_comes_ends(spawn_server: Spawn) -> None:
    """Reflection's calls lasted as long as their connection when no request came; each
    request message is now due within --read-timeout-seconds, and reflection still works."""
    from grpc_reflection.v1alpha import reflection_pb2

    server = spawn_server(0, "--read-timeout-seconds", "2")

    async def calls() -> tuple[grpc.StatusCode, list[str]]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            info = channel.stream_stream(
                REFLECTION,
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            silent = info()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(silent.read(), 15)
            asked = info()
            await asked.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            reply = await asked.read()
            await asked.done_writing()
            names = [service.name for service in reply.list_services_response.service]
            return ended.value.code(), names

    code, names = asyncio.run(calls())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "posenc.v1.PositionalEncodingService" in names


# -- 3: unread responses ------------------------------------------------------------------


def in_flight_bytes(port: int) -> float:
    return metric(scrape(port), "posenc_in_flight_bytes")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_responses_nobody_reads_stay_within_the_budget(spawn_server: Spawn) -> None:
    """A client announces a zero flow-control window and asks for 250 unary results of
    4,177,920 bytes (the threaded server held all of them: 2.2 GiB). Calls beyond the
    in-flight budget get RESOURCE_EXHAUSTED with RetryInfo; the memory is given back when the
    client leaves."""
    cache_mib = 64
    server = spawn_server(0, "--cache-bytes", f"{cache_mib}MiB")
    port = metrics_port(server)
    baseline = current_rss_mib(server.process.pid)
    request = encoding_request(0, 1024, 1020)  # 1024 rows of 1020 float32: 4,177,920 bytes
    connection = RawConnection("127.0.0.1", server.port, window=0)
    try:
        streams = [connection.call(GET_ENCODING, request) for _ in range(250)]
        pump_until(
            [connection],
            lambda: sum(connection.replies[s].status is not None for s in streams) >= 200,
            60,
        )
        refused = [s for s in streams if connection.replies[s].status == RESOURCE_EXHAUSTED]
        assert len(refused) >= 200
        assert all(
            "grpc-status-details-bin" in connection.replies[s].headers
            or "grpc-status-details-bin" in connection.replies[s].trailers
            for s in refused
        )
        assert in_flight_bytes(port) > 0
        assert peak_rss_mib(server.process.pid) <= cache_mib + SERVER_HEADROOM_MIB
    finally:
        connection.close()
    deadline = time.monotonic() + 10
    while in_flight_bytes(port) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert in_flight_bytes(port) == 0
    with posenc.Client(server.target, timeout=10) as client:
        assert client.get_range(0, 1024, 1020).shape == (1024, 1020)
    assert current_rss_mib(server.process.pid) <= baseline + cache_mib + 32


# -- 4: legitimate clients at the limits -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_64_clients_with_a_million_positions_each_all_succeed_within_the_budget(
    spawn_server: Spawn,
) -> None:
    """64 default SDK clients at once, each with 1,048,576 positions (10.5 MB requests: the
    threaded server reached 2.3 GiB). Every client gets its exact rows: calls beyond the
    in-flight budget wait, or are told to retry, which the SDK does."""
    cache_mib = 64
    server = spawn_server(0, "--cache-bytes", f"{cache_mib}MiB")
    # Negative positions take 10 bytes each on the wire; two cached blocks hold them all.
    positions = -np.arange(1, (1 << 20) + 1, dtype=np.int64)
    np.random.default_rng(0).shuffle(positions)
    expected = np.sin(positions.astype(np.float64)).astype(np.float16)[:, None]
    results: list[np.ndarray | BaseException] = []

    def fetch() -> None:
        try:
            with posenc.Client(server.target) as client:
                results.append(client.get_positions(positions, 1, dtype="float16"))
        except BaseException as error:  # reported below
            results.append(error)

    threads = [threading.Thread(target=fetch) for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert peak_rss_mib(server.process.pid) <= cache_mib + SERVER_HEADROOM_MIB
    assert len(results) == 64
    for result in results:
        assert isinstance(result, np.ndarray), result
        # Within one float16 ulp of float64's sine (the exact value is within 2**-50 of it).
        steps = np.abs(result.view(np.int16).astype(np.int32) - expected.view(np.int16))
        assert steps.max() <= 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_connections_that_sent_large_requests_do_not_keep_large_read_buffers(
    spawn_server: Spawn,
) -> None:
    """64 clients of 4 connections each send a million positions (the SDK sends them as 16
    requests of 650 KB over its connections), one client after the other, and stay open.
    The in-flight budget frees each call's memory when it ends, but gRPC sized each
    connection's read buffer by its largest reads and kept it, counted nowhere: the 192
    connections the calls opened held 68 MiB. Capped, 22 MiB, most of it the connections'
    own state."""
    server = spawn_server(0)
    positions = np.arange(1 << 20, dtype=np.int64)
    with closing_all(
        [posenc.Client(server.target, timeout=60, connections=4) for _ in range(64)]
    ) as clients:
        for client in clients:  # one connection of each open before
            client.get_range(0, 1, 8)
        before = current_rss_mib(server.process.pid)
        for client in clients:
            assert client.get_positions(positions, 1, dtype="float16").shape == (1 << 20, 1)
        # One call's own memory is given back when it ends (and the heap trimmed after).
        assert settled_rss_mib(server.process.pid, before + 40) <= before + 40


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_64_raw_calls_of_a_million_positions_stay_within_the_budget(spawn_server: Spawn) -> None:
    """The same lists from raw clients, one 10.5 MB request each (the SDK would split them):
    every call gets its exact rows or RESOURCE_EXHAUSTED with RetryInfo, and the requests of
    refused calls do not linger (they once did, in a reference cycle with the call, until
    Python's cyclic collector ran: 370-710 MiB)."""
    cache_mib = 64
    server = spawn_server(0, "--cache-bytes", f"{cache_mib}MiB")
    baseline = current_rss_mib(server.process.pid)
    positions = -np.arange(1, (1 << 20) + 1, dtype=np.int64)
    request = pb.GetEncodingRequest(
        spec=pb.EncodingSpec(dtype=pb.DTYPE_FLOAT16, sinusoidal=pb.SinusoidalTable(d_model=1)),
        positions=pb.PositionList(positions=positions.tolist()),
    ).SerializeToString()
    assert len(request) > 10 << 20
    expected = np.sin(positions.astype(np.float64)).astype(np.float16)
    outcomes: list[str] = []

    def fetch() -> None:
        options = [("grpc.max_send_message_length", 16 << 20)]
        with grpc.insecure_channel(server.target, options=options) as channel:
            try:
                reply = pb.GetEncodingResponse.FromString(
                    channel.unary_unary(GET_ENCODING)(request, timeout=120)
                )
                rows = np.frombuffer(reply.tensor.data, dtype=np.float16)
                steps = np.abs(rows.view(np.int16).astype(np.int32) - expected.view(np.int16))
                outcomes.append("exact" if steps.max() <= 1 else "wrong")
            except grpc.RpcError as error:
                status = rpc_status.from_call(error)  # type: ignore[arg-type]
                retry = status is not None and any(
                    detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for detail in status.details
                )
                outcomes.append(f"{error.code().name}{' with RetryInfo' * retry}")  # type: ignore[attr-defined]

    threads = [threading.Thread(target=fetch) for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 64
    assert set(outcomes) <= {"exact", "RESOURCE_EXHAUSTED with RetryInfo"}, outcomes
    assert "exact" in outcomes
    assert peak_rss_mib(server.process.pid) <= cache_mib + SERVER_HEADROOM_MIB
    assert settled_rss_mib(server.process.pid, baseline + 64) <= baseline + 64


def test_the_cli_sends_a_token_over_loopback_only_when_told(
    token_server: tuple[RunningServer, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from posenc.cli import main

    server, token = token_server
    token_file = tmp_path / "client-token"
    token_file.write_text(token)
    argv = ["info", "--target", server.target, "--token-file", str(token_file)]
    assert main(argv) != 0
    assert "local_channel_credentials" in capsys.readouterr().err
    assert main([*argv, "--local"]) == 0


# -- all of them, in waves ----------------------------------------------------------------------

SOAK = os.environ.get("POSENC_SOAK") == "1"


@dataclass
class Watched:
    """What the clients beside the attacks saw: their calls, wrong results and errors."""

    calls: int = 0
    wrong: int = 0
    errors: list[BaseException] = field(default_factory=list)


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_every_attack_at_once_leaves_the_clients_served_and_memory_bounded(
    spawn_server: Spawn,
) -> None:
    """The attacks of this file together, in rounds on new connections dropped at each
    round's end, against a 2-process server: 256 stalled GetEncoding calls, 64 stalled
    health checks, 100 unread 4 MB results, 200 idle connections, 10 silent /metrics
    connections, 10 MB lists the server must refuse and calls with an upper-case header.
    Beside them a decode loop, a streaming client and a kubelet-like prober (a new channel
    each time) run: every result is exact, every probe answers SERVING, no worker is
    replaced, the replica's memory (sampled ten times a second) stays within the sizing
    rule and nothing stays admitted once the attackers are gone. 10 minutes in `make soak`,
    10 s in `make test`."""
    cache_mib = 128
    server = spawn_server(
        0, "--processes", "2", "--cache-bytes", f"{cache_mib}MiB", "--read-timeout-seconds", "5"
    )
    workers = worker_pids(server.process.pid)
    assert len(workers) == 2
    port = metrics_port(server)
    duration = 600.0 if SOAK else 10.0
    stop = threading.Event()
    decode, stream = Watched(), Watched()
    probes: list[object] = []

    def decode_loop() -> None:
        spec = classic(64)
        with posenc.Client(server.target, row_cache_bytes=0) as client:
            position = 0
            while not stop.is_set():
                positions = [position, position + 1, 7 * position + 2**40]
                try:
                    rows = client.get_positions(positions, 64)
                    decode.wrong += rows.tobytes() != encode_positions(spec, positions).tobytes()
                except BaseException as error:  # reported below
                    decode.errors.append(error)
                decode.calls += 1
                position += 2

    # Ranges of 8 to 16 MiB in three dtypes, their bytes known before the attacks start.
    ranges = [
        (start, stop, d_model, dtype, encode_range(classic(d_model, dtype=dtype), start, stop))
        for start, stop, d_model, dtype in [
            (0, 8192, 512, "float32"),
            (2**40, 2**40 + 4096, 1024, "bfloat16"),
            (-5000, 3192, 128, "float64"),
        ]
    ]

    def stream_loop() -> None:
        with posenc.Client(server.target) as client:
            while not stop.is_set():
                start, stop_, d_model, dtype, expected = ranges[stream.calls % len(ranges)]
                try:
                    rows = client.get_range(start, stop_, d_model, dtype=dtype, timeout=120)
                    stream.wrong += rows.tobytes() != expected.tobytes()
                except BaseException as error:  # reported below
                    stream.errors.append(error)
                stream.calls += 1

    def probe_loop() -> None:
        while not stop.wait(0.5):
            probes.append(fresh_probe(server.target))

    refusals: list[grpc.StatusCode] = []
    pids = [server.process.pid, *workers]
    memory = [0.0]

    def memory_loop() -> None:
        while not stop.wait(0.1):
            memory[0] = max(memory[0], replica_mib(pids))

    loops = (decode_loop, stream_loop, probe_loop, memory_loop)
    threads = [threading.Thread(target=run) for run in loops]
    for thread in threads:
        thread.start()
    unread_request = encoding_request(0, 1024, 1020)
    deadline = time.monotonic() + duration
    rounds = 0
    try:
        while time.monotonic() < deadline:
            stalled = [RawConnection("127.0.0.1", server.port) for _ in range(4)]
            for connection in stalled:
                for _ in range(64):
                    connection.call(GET_ENCODING, None, end=False)
                for _ in range(16):
                    connection.call("/grpc.health.v1.Health/Check", None, end=False)
            unread = RawConnection("127.0.0.1", server.port, window=0)
            for _ in range(100):
                unread.call(GET_ENCODING, unread_request)
            upper = upper_case_connection(server.port)
            for _ in range(10):
                upper.call(GET_ENCODING, encoding_request(0, 4, 8), metadata=[("X-Upper", "1")])
            idle = [RawConnection("127.0.0.1", server.port) for _ in range(200)]
            silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(10)]
            for held in silent:
                held.sendall(b"G")  # the start of a request line, never ended
            refusing = threading.Thread(target=send_refused_lists, args=(server.target, refusals))
            refusing.start()
            pump_until([*stalled, unread, upper, *idle], lambda: False, 2.0)
            refusing.join(60)
            for connection in [*stalled, unread, upper, *idle]:
                connection.close()
            for held in silent:
                held.close()
            rounds += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(180)
    print(
        f"{rounds} rounds in {duration:.0f} s: {decode.calls} decode steps, {stream.calls} "
        f"streams, {len(probes)} probes; memory {memory[0]:.0f} MiB at most (peak RSS: "
        f"{', '.join(f'{peak_rss_mib(pid):.0f}' for pid in pids)} MiB)"
    )
    assert not decode.errors and not stream.errors, (decode.errors[:3], stream.errors[:3])
    assert decode.wrong == stream.wrong == 0
    assert decode.calls > 10 and stream.calls >= 1 and rounds >= 2
    assert probes and set(probes) == {health_pb2.HealthCheckResponse.SERVING}, probes
    assert set(refusals) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(refusals) == 2 * rounds
    assert worker_pids(server.process.pid) == workers
    assert memory[0] <= sizing_rule_mib(cache_mib, 2)
    settle = time.monotonic() + 10
    while in_flight_bytes(port) > 0 and time.monotonic() < settle:
        time.sleep(0.2)
    assert in_flight_bytes(port) == 0


def replica_mib(pids: list[int]) -> float:
    """The memory of processes ``pids`` as their container's memory limit counts it, in MiB:
    each one's private pages, and the pages they share (the libraries and the compiled
    kernels, mapped by all of them) once. Adding their RSS counts those once per process;
    adding their PSS divides them with any other process mapping the same files."""
    private, shared = 0, 0
    for pid in pids:
        fields = {}
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                name, _, value = line.partition(":")
                if name.startswith(("Private_", "Shared_")):
                    fields[name] = int(value.split()[0])
        private += fields["Private_Clean"] + fields["Private_Dirty"]
        shared = max(shared, fields["Shared_Clean"] + fields["Shared_Dirty"])
    return (private + shared) / 1024


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_flood_of_stalled_health_checks_starves_no_probe_and_kills_no_worker(
    spawn_server: Spawn,
) -> None:
    """Health Checks that send their headers and never their request, 50 a second: they
    held health's one read at a time in turn, so outside probes failed (RESOURCE_EXHAUSTED)
    and the supervisor's own checks queued behind them until it killed both healthy workers.
    Now a probe never waits for that read, and the supervisor asks each worker on a line of
    its own: every probe answers SERVING, and no worker is replaced."""
    server = spawn_server(0, "--processes", "2")
    workers = worker_pids(server.process.pid)
    stop = threading.Event()
    opened = [0]

    health_check = "/grpc.health.v1.Health/Check"
    flood = (server.port, health_check, stop, opened, 0.02)
    flooder = threading.Thread(target=flood_stalled_calls, args=flood, daemon=True)
    flooder.start()
    statuses = []
    try:
        # The supervisor replaces a worker after 3 failed checks, one a second: 8 s of
        # flood (and at least 200 stalled calls, however slow the machine) gave it every
        # chance to.
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline or opened[0] < 200:
            statuses.append(fresh_probe(server.target))
            time.sleep(0.25)
    finally:
        stop.set()
        flooder.join(10)
    assert statuses and set(statuses) == {health_pb2.HealthCheckResponse.SERVING}, statuses
    assert worker_pids(server.process.pid) == workers
    assert not any("health checks" in str(entry["message"]) for entry in server.logs())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_refused_lists_cost_no_more_than_they_brought(spawn_server: Spawn) -> None:
    """16 clients at once sending 10 MB lists a spec cannot hold (an M-RoPE section of
    10**7 counts): converted before their length was checked, each refusal cost a tuple of
    every value and a message listing them, and the process peaked at +182 to +292 MiB
    against a 64 MiB in-flight budget (496 MiB here). The length is checked first now, and
    the process holds no more than admission counts for one such request."""
    server = spawn_server(0)
    pid = server.process.pid
    baseline = current_rss_mib(pid)
    cost = admission.request_cost(refused_list())  # built here, once, not by 16 threads
    codes: list[grpc.StatusCode] = []
    threads = [
        threading.Thread(target=send_refused_lists, args=(server.target, codes)) for _ in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    grown = peak_rss_mib(pid) - baseline
    assert len(codes) == 32
    assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert grpc.StatusCode.INVALID_ARGUMENT in codes
    # Such a request is admitted alone (its cost is over the budget): what admission
    # counts for it, and no more, besides the heap's slack.
    assert grown <= cost / MIB + 32
    assert_health_serving(server.target)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_client_holding_metrics_connections_fails_no_scrape(spawn_server: Spawn) -> None:
    """One client holding 40 connections to /metrics open and silent, reopening each one
    the server closes: with every place taken, new connections were closed as they came,
    and 23 of 40 scrapes failed. A new connection now takes the place of the oldest silent
    one: every scrape is served."""
    server = spawn_server(0, "--processes", "1")
    port = metrics_port(server)
    stop = threading.Event()

    def connect() -> socket.socket:
        connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        connection.sendall(b"G")  # the start of a request line, never ended
        time.sleep(0.01)  # one at a time, as the server accepts them
        return connection

    held: list[socket.socket] = []

    def hold() -> None:
        held.extend(connect() for _ in range(40))
        while not stop.is_set():
            readable, _, _ = select.select(held, [], [], 0.05)
            for connection in readable:
                if _closed(connection):
                    connection.close()
                    held[held.index(connection)] = connect()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    failures = []
    try:
        deadline = time.monotonic() + 30
        while len(held) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(20):
            try:
                assert b"posenc_requests_total" in _get(port)
            except OSError as error:
                failures.append(repr(error))
            time.sleep(0.1)
    finally:
        stop.set()
        holder.join(10)
        for connection in held:
            connection.close()
    assert not failures, failures


def _get(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
        return body


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_upper_case_header_is_answered_by_grpc_and_harms_nothing(spawn_server: Spawn) -> None:
    """HTTP/2 forbids upper-case header names: gRPC's core refuses such a call itself
    (INTERNAL, or a reset stream) before posenc sees it, so posenc's metrics cannot count it
    (deploy/prometheus/rules.yml says so and where to look instead). What posenc promises:
    the call never reaches a handler, and the server goes on serving."""
    server = spawn_server(0)
    port = metrics_port(server)
    before = scrape(port)
    connection = upper_case_connection(server.port)
    try:
        streams = [
            connection.call(GET_ENCODING, encoding_request(0, 4, 8), metadata=[("X-Upper", "1")])
            for _ in range(50)
        ]
        pump_until(
            [connection],
            lambda: connection.closed or all(connection.replies[s].ended for s in streams),
            10,
        )
        replies = [connection.replies[stream] for stream in streams]
        assert connection.closed or all(reply.ended for reply in replies)
        assert not any(reply.status == 0 or reply.data for reply in replies)
    finally:
        connection.close()
    ok = metric(scrape(port), "posenc_requests_total", method="GetEncoding", code="OK")
    assert ok == metric(before, "posenc_requests_total", method="GetEncoding", code="OK")
    assert_health_serving(server.target)
    with posenc.Client(server.target, timeout=10) as client:
        assert client.get_range(0, 4, 8).shape == (4, 8)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stalled_call_flood_lets_every_sdk_call_through(spawn_server: Spawn) -> None:
    """8 connections opening GetEncoding calls that never send their request, without end:
    each holds a read's room until a waiting call takes it over, and the takeover went to the
    newest waiter, which under a flood is nearly always another stalled call (5 SDK calls
    in 20 s got through, one hit its deadline). The room now goes to the waiter whose
    connection has the fewest calls reading or waiting: every SDK call gets through."""
    server = spawn_server(0)
    stop = threading.Event()
    opened = [0]
    flooding = threading.Event()
    open_at_the_end: list[int] = []

    def flood() -> None:
        flooded = flood_stalled_calls(server.port, GET_ENCODING, stop, opened, 0.01, flooding)
        open_at_the_end.append(flooded)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    outcomes: list[str] = []
    try:
        # The SDK calls start once the flood is in full swing, however fast the machine.
        assert flooding.wait(60), "the flood did not start"
        for index in range(10):
            with posenc.Client(server.target, timeout=10) as client:
                try:
                    rows = client.get_range(index, index + 4, 8)
                    outcomes.append("ok" if rows.shape == (4, 8) else "wrong")
                except posenc.PosencError as error:
                    outcomes.append(type(error).__name__)
    finally:
        stop.set()
        flooder.join(10)
    # ...and it still ran, on open connections, when the last of them returned.
    assert open_at_the_end and open_at_the_end[0] > 0, "the flood had stopped"
    assert outcomes == ["ok"] * 10, outcomes


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_parameter_is_refused_by_the_sdk_naming_its_field(value: float) -> None:
    """``Spec(rope_theta=nan)`` and a config whose linear factor is NaN were accepted and
    sent; each is refused where it is made, naming the field."""
    with pytest.raises(posenc.InvalidArgumentError) as spec:
        posenc.Spec("rotary", head_dim=64, rope_theta=value)
    assert spec.value.field_violations[0][0] == "spec.rotary.rope_theta"
    config = {"hidden_size": 512, "num_attention_heads": 8, "rope_theta": 10000.0}
    config["rope_scaling"] = {"rope_type": "linear", "factor": value}
    with pytest.raises(posenc.InvalidArgumentError) as read:
        posenc.Spec.from_config(config)
    assert read.value.field_violations == [
        ("spec.rotary.linear.factor", f"must be a finite number, got {value}")
    ]
    with pytest.raises(posenc.InvalidArgumentError, match=r"spec\.rotary\.rope_theta"):
        posenc.Spec.from_config({**config, "rope_theta": value, "rope_scaling": None})
