"""Several server processes on one port: all serve, drain together, die with the supervisor."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, Spawn, worker_pids
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reference import classic

import posenc
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc
from posenc_server import engine, supervisor

# Every test here starts server processes and waits on them.
pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "State:\tZ" not in status.read()
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_workers_share_the_port_and_each_serves(spawn_server: Spawn) -> None:
    process = spawn_server(0, "--processes", "2", "--cache-bytes", str(64 << 20))
    assert len(worker_pids(process.process.pid)) == 2
    startup = [entry for entry in process.logs() if entry["message"] == "listening"]
    assert len(startup) == 1 and startup[0]["processes"] == 2
    server_ids = set()
    expected = engine.encode_range(classic(64), 1000, 1100)
    # The kernel spreads connections over the workers; one client is one connection.
    for _ in range(24):
        with posenc.Client(process.target) as client:
            info = client.server_info()
            assert np.array_equal(client.get_range(1000, 1100, 64), expected)
        server_ids.add(info.server_id)
        # Each worker holds half the budget; info reports the whole server's.
        assert info.cache.budget_bytes == 64 << 20
        if len(server_ids) == 2:
            break
    assert len(server_ids) == 2


@pytest.mark.timeout(120)
def test_sigterm_drains_every_worker_and_exits_zero(spawn_server: Spawn) -> None:
    process = spawn_server(0, "--processes", "2", "--grace-seconds", "10")
    workers = worker_pids(process.process.pid)
    with posenc.Client(process.target) as client:
        stream = client.iter_range(0, 4096, 1024, chunk_bytes=64 * 1024)
        _, rows = next(stream)
        process.terminate()
        received = len(rows) + sum(len(rows) for _, rows in stream)
    assert received == 4096  # the stream in flight finished during the drain
    assert process.process.wait(30) == 0
    assert not any(alive(pid) for pid in workers)
    messages = [entry["message"] for entry in process.logs() if "worker" not in entry]
    assert messages[-2:] == ["draining", "stopped"]


def wait_for_log(process: ServerProcess, message: str, count: int) -> None:
    """Until ``process`` (its workers included) logged ``message`` ``count`` times (60 s at
    most: a hang guard, not a measure)."""
    deadline = time.monotonic() + 60

    def logged() -> int:
        return sum(entry["message"] == message for entry in process.logs())

    while logged() < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logged() >= count, process.log_lines[-20:]


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.timeout(180)
def test_ctrl_c_drains_and_a_second_ctrl_c_stops_without_waiting_for_the_grace(
    spawn_server: Spawn, processes: int
) -> None:
    """Ctrl-C signals every process of the terminal's group: once, the server drains (a
    stream in flight goes on); twice, it stops, cutting the stream instead of giving it the
    grace (an hour here: a process that exits at all did not wait for it)."""
    process = spawn_server(0, "--processes", str(processes), "--grace-seconds", "3600")
    group = [process.process.pid, *worker_pids(process.process.pid)]
    with posenc.Client(process.target, max_retries=0) as client:
        # 4 GiB, read a few chunks at a time: in flight for as long as the test lasts.
        stream = client.iter_range(0, 1 << 20, 1024, chunk_bytes=64 * 1024)
        next(stream)
        for pid in group:
            os.kill(pid, signal.SIGINT)
        wait_for_log(process, "draining", len(group))  # every process took the first signal
        for _ in range(32):
            next(stream)  # still streaming: one Ctrl-C drains
        assert process.process.poll() is None
        for pid in group:
            with contextlib.suppress(ProcessLookupError):  # a worker with nothing in flight
                os.kill(pid, signal.SIGINT)  # has drained and exited already
        assert process.process.wait(60) == 0  # a hang guard: the grace is an hour
        with pytest.raises(posenc.PosencError):
            for _ in stream:  # what the transport still held, then the cut
                pass
    assert not any(alive(pid) for pid in group)
    assert any(entry["message"].startswith("stopping now") for entry in process.logs())
    # The server's own account (the supervisor's, with several processes): not drained,
    # the stream was cut rather than finished.
    stopped = [e for e in process.logs() if e["message"] == "stopped" and "worker" not in e]
    assert [entry["drained"] for entry in stopped] == [False]
    # The process that served the stream says what it cut.
    (cut,) = [e for e in process.logs() if e["message"].startswith("calls in flight at the end")]
    assert (cut["calls"], cut["streams"]) == (1, 1)


@pytest.mark.timeout(120)
def test_workers_die_with_a_killed_supervisor_and_free_the_port(spawn_server: Spawn) -> None:
    process = spawn_server(0, "--processes", "2")
    workers = worker_pids(process.process.pid)
    process.kill()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers)
    # No SO_REUSEPORT: the bind fails while any process still listens on the port. (The
    # kernel may take a moment to close a killed process's sockets; SO_REUSEADDR only lets
    # the bind pass over connections left in TIME_WAIT.)
    while True:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", process.port))
                sock.listen()
                break
            except OSError:
                assert time.monotonic() < deadline + 5, "the port stayed taken"
                time.sleep(0.1)


def test_a_killed_supervisors_metrics_directory_is_removed_at_the_next_start(
    spawn_server: Spawn, tmp_path: Path
) -> None:
    env = {"TMPDIR": str(tmp_path)}
    first = spawn_server(0, "--processes", "2", env=env)
    (orphan,) = tmp_path.glob("posenc-metrics-*")
    first.kill()
    first.process.wait(30)
    assert orphan.exists()  # SIGKILL: nobody cleaned up
    second = spawn_server(0, "--processes", "2", env=env)
    assert not orphan.exists()
    (current,) = tmp_path.glob("posenc-metrics-*")
    assert current.name.startswith(f"posenc-metrics-{second.process.pid}-")


@pytest.mark.timeout(120)
def test_a_dead_worker_is_replaced(spawn_server: Spawn) -> None:
    process = spawn_server(0, "--processes", "2")
    victim = min(worker_pids(process.process.pid))
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        workers = worker_pids(process.process.pid)
        if victim not in workers and len(workers) == 2:
            break
        time.sleep(0.1)
    assert victim not in workers and len(workers) == 2
    assert any(entry["message"] == "worker exited; starting a new one" for entry in process.logs())
    with posenc.Client(process.target) as client:
        assert client.health() == "SERVING"


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_busy_port_is_an_error(spawn_server: Spawn, processes: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(RuntimeError, match=r"port \d+ is in use.*--port"):
            spawn_server(sock.getsockname()[1], "--processes", processes)


@pytest.mark.timeout(120)
def test_a_second_server_never_joins_a_running_one(spawn_server: Spawn) -> None:
    # The first server shares its port between its workers (SO_REUSEPORT); a second one
    # with the same port must not slip in beside them.
    first = spawn_server(0, "--processes", "2")
    for processes in ("1", "2"):
        with pytest.raises(RuntimeError, match=f"port {first.port} is in use"):
            spawn_server(first.port, "--processes", processes)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_busy_metrics_port_fails_before_anything_listens(
    spawn_server: Spawn, processes: str
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(RuntimeError) as caught:
            spawn_server(0, "--processes", processes, "--metrics-port", str(port))
    message = str(caught.value)
    assert f"port {port}" in message and "--metrics-port" in message
    assert "listening" not in message  # no worker, no server started first


@pytest.mark.parametrize("processes", ["1", "2"])
def test_the_default_metrics_port_yields_when_busy(spawn_server: Spawn, processes: str) -> None:
    # A second server on a developer's machine, where `make run` holds 9464: it serves its
    # metrics on a free port and says which. (If 9464 is already taken, so much the better.)
    with contextlib.ExitStack() as stack:
        holder = stack.enter_context(socket.socket())
        with contextlib.suppress(OSError):
            holder.bind(("127.0.0.1", 9464))
            holder.listen()
        process = spawn_server(0, "--processes", processes, "--metrics-port", "9464")
        startup = next(e for e in process.logs() if e["message"] == "listening")
        port = startup["metrics_port"]
        assert port not in (9464, -1)
        warning = next(e for e in process.logs() if e["message"].startswith("metrics port busy"))
        assert warning["busy_port"] == 9464 and warning["metrics_port"] == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert b"# HELP posenc_" in response.read()


def test_healthy_workers_pass_the_supervisors_health_checks(spawn_server: Spawn) -> None:
    # Three failed checks, one a second, replace a worker: a check that cannot reach healthy
    # workers would replace them every few seconds.
    process = spawn_server(0, "--processes", "2")
    workers = worker_pids(process.process.pid)
    time.sleep(5)
    assert worker_pids(process.process.pid) == workers


@pytest.mark.timeout(180)
def test_a_hung_worker_is_replaced(spawn_server: Spawn) -> None:
    """A worker that stops answering (SIGSTOP: alive, its port open, silent) fails the
    supervisor's health checks and is killed and replaced for it."""
    process = spawn_server(0, "--processes", "2")
    victim = min(worker_pids(process.process.pid))
    os.kill(victim, signal.SIGSTOP)
    try:
        # A hang guard only: the supervisor acts after three failed checks a second apart.
        deadline = time.monotonic() + 60
        while (
            victim in worker_pids(process.process.pid) or len(worker_pids(process.process.pid)) < 2
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = worker_pids(process.process.pid)
        assert victim not in workers and len(workers) == 2, "the hung worker was not replaced"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    # Replaced for its health checks (the supervisor's reason, with the worker's pid).
    assert any(
        entry["message"] == "worker stopped answering its health checks; replacing it"
        and entry["pid"] == victim
        for entry in process.logs()
    )
    # New connections reach live workers only: every call succeeds.
    deadline = time.monotonic() + 60
    while not any(entry.get("message") == "worker listening" for entry in process.logs()[-5:]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for _ in range(10):
        with posenc.Client(process.target, timeout=30) as client:
            assert client.health() == "SERVING"
            assert client.get_range(0, 4, 8).shape == (4, 8)


def _worker_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        entries = environ.read().split(b"\0")
    return dict(entry.decode().partition("=")[::2] for entry in entries if b"=" in entry)


@pytest.mark.timeout(120)
def test_the_workers_private_line_serves_health_alone_to_the_servers_user(
    spawn_server: Spawn,
) -> None:
    """Each worker's line to its supervisor is a socket file in a directory only the
    server's user may enter, and serves health alone: an abstract socket, which any process
    of the network namespace finds in /proc/net/unix and opens, served the whole API in
    plaintext, without the TLS or token the TCP port requires."""
    process = spawn_server(0, "--processes", "2")
    for pid in worker_pids(process.process.pid):
        address = _worker_environ(pid)[supervisor.HEALTH_SOCKET_ENV]
        assert address.startswith("unix:/"), address
        path = Path(address.removeprefix("unix:"))
        assert path.is_socket()
        assert path.parent.stat().st_mode & 0o077 == 0  # no one else may enter
        with grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            reply = check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
            request = pb.GetEncodingRequest(
                spec=pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=8)),
                range=pb.PositionRange(start=0, stop=4),
            )
            with pytest.raises(grpc.RpcError) as raised:
                stub.GetEncoding(request, timeout=10)
            assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.RpcError) as raised:
                list(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()))
            assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with open("/proc/net/unix") as sockets:
        assert "@posenc" not in sockets.read()


@pytest.mark.timeout(120)
def test_sigterm_to_the_process_group_drains(spawn_server: Spawn) -> None:
    """SIGTERM to the whole process group (a shell's, CI's or `timeout`'s way) reaches each
    worker twice: from the group and from the supervisor. The second must not be taken for
    a second signal: a stream in flight goes on to its end, and the server says it drained."""
    process = spawn_server(0, "--processes", "2", "--grace-seconds", "60")
    group = [process.process.pid, *worker_pids(process.process.pid)]
    rows = 1 << 18
    with posenc.Client(process.target, max_retries=0) as client:
        # 1 GiB: in flight well after the signals arrive.
        stream = client.iter_range(0, rows, 1024, chunk_bytes=64 * 1024)
        received = len(next(stream)[1])
        for pid in group:
            os.kill(pid, signal.SIGTERM)
        # Past the moment both signals reached each worker (the supervisor's forwarded one
        # follows the group's within its 0.2 s poll); the stream is still in flight.
        time.sleep(1.0)
        received += sum(len(chunk) for _, chunk in stream)
    assert received == rows
    assert process.process.wait(60) == 0
    assert not any(entry["message"].startswith("stopping now") for entry in process.logs())
    stopped = [entry for entry in process.logs() if entry["message"] == "stopped"]
    cut = [entry for entry in process.logs() if entry["message"].startswith("calls in flight")]
    assert stopped and all(entry["drained"] for entry in stopped), (stopped, cut)
