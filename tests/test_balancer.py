"""Three replicas behind a real gRPC load balancer: Debian's nginx running the shipped config.

Each test starts three ``python -m posenc_server`` processes on loopback ports and nginx with
``deploy/nginx/nginx.conf`` (the file docker-compose.yml mounts), rewritten only where a test
must differ: the replicas' loopback addresses instead of the compose service name, a free
loopback port, and log, pid and temp paths in the test's directory. The SDK talks to nginx;
each replica's own ``server_info()`` counters (read directly, not through nginx) show who
served what. Replicas are killed with SIGKILL under load from several threads, and every
result is compared with the engine's bytes.

The same scenario without a proxy, the SDK balancing over the replicas itself as it does over
a Kubernetes headless Service, is checked too.

nginx is installed with apt-get when missing (as root); the test is skipped only when the
package registry cannot be reached.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import ROOT, ServerProcess, apt_install, free_port, start_threads, wait_until
from reference import classic

import posenc
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc as pb_grpc
from posenc_server.engine import encode_positions, encode_range

# Each scenario's own loops take about 10 s; the margin covers installing nginx on first use.
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
Spawn = Callable[..., ServerProcess]

# -- nginx ---------------------------------------------------------------------------------


def _find_nginx() -> str | None:
    found = shutil.which("nginx")
    if found is None and os.access("/usr/sbin/nginx", os.X_OK):
        found = "/usr/sbin/nginx"
    return found


@pytest.fixture(scope="session")
def nginx_binary() -> str:
    """Debian's nginx, installed with apt-get when missing."""
    found = _find_nginx()
    if found:
        return found
    reason = apt_install(["nginx"], "nginx")
    if reason is not None:
        pytest.skip(reason)
    found = _find_nginx()
    assert found is not None, "apt-get installed nginx, which is nowhere to be found"
    return found


def render_nginx_conf(directory: Path, replicas: list[str], port: int) -> str:
    """The shipped nginx.conf with loopback replicas, a loopback port and local paths."""
    text = NGINX_CONF.read_text()

    def substitute(pattern: str, replacement: str) -> None:
        nonlocal text
        text, count = re.subn(pattern, lambda _: replacement, text, flags=re.MULTILINE)
        assert count == 1, f"deploy/nginx/nginx.conf has no single match of {pattern!r}"

    # Literal addresses need no `resolve` (nor nginx >= 1.27.3, which Debian 12 predates).
    substitute(
        r"^(\s*)server posenc:50051 resolve (.*);$",
        "\n".join(f"        server {target} max_fails=1 fail_timeout=5s;" for target in replicas),
    )
    substitute(r"^(\s*)listen 50051 http2;$", f"        listen 127.0.0.1:{port} http2;")
    substitute(
        r"^worker_processes auto;$",
        "worker_processes auto;\n"
        f"pid {directory}/nginx.pid;\n"
        f"error_log {directory}/error.log info;\n" + ("user root;\n" if os.geteuid() == 0 else ""),
        # As root, workers would otherwise run as nobody, outside the test's private tmp.
    )
    temp_paths = "".join(
        f"    {kind}_temp_path {directory}/{kind}_temp;\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    substitute(
        r"^(\s*)access_log /dev/stdout grpc;$",
        f"    access_log {directory}/access.log grpc;\n{temp_paths}",
    )
    return text


@dataclass
class Balancer:
    """An nginx master process (``daemon off``) in front of the replicas."""

    process: subprocess.Popen[bytes]
    port: int
    directory: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def error_log(self) -> str:
        path = self.directory / "error.log"
        return path.read_text() if path.exists() else ""

    def wait_for_log(self, calls: int) -> None:
        """Until the access log has ``calls`` lines: nginx writes one as a call ends."""
        log = self.directory / "access.log"
        deadline = time.monotonic() + 5
        while not log.exists() or len(log.read_text().splitlines()) < calls:
            assert time.monotonic() < deadline, f"nginx logged fewer than {calls} calls"
            time.sleep(0.02)

    def passed_on(self) -> list[str]:
        """Access log lines of calls nginx passed from a failed replica to another one."""
        log = self.directory / "access.log"
        lines = log.read_text().splitlines() if log.exists() else []
        return [line for line in lines if re.search(r" upstream=\S+, ", line)]

    def upstreams(self) -> Counter[str]:
        """Calls per replica address, from the access log (the replica that answered)."""
        counts: Counter[str] = Counter()
        log = self.directory / "access.log"
        for line in log.read_text().splitlines() if log.exists() else []:
            match = re.search(r" upstream=(\S+(?:, \S+)*) upstream_status=", line)
            if match:
                counts[match.group(1).split(", ")[-1]] += 1
        return counts


@pytest.fixture
def start_nginx(nginx_binary: str, tmp_path: Path) -> Iterator[Callable[[list[str]], Balancer]]:
    started: list[Balancer] = []

    def start(replicas: list[str]) -> Balancer:
        directory = tmp_path / f"nginx{len(started)}"
        directory.mkdir()
        port = free_port()
        (directory / "nginx.conf").write_text(render_nginx_conf(directory, replicas, port))
        process = subprocess.Popen(
            [nginx_binary, "-p", str(directory), "-c", "nginx.conf", "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        balancer = Balancer(process, port, directory)
        started.append(balancer)
        deadline = time.monotonic() + 10
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"nginx exited with {process.returncode}:\n{balancer.error_log()}"
                )
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return balancer
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nginx did not listen:\n{balancer.error_log()}") from None
                time.sleep(0.05)

    yield start
    for balancer in started:
        if balancer.process.poll() is None:
            balancer.process.send_signal(signal.SIGTERM)  # fast shutdown, workers included
            try:
                balancer.process.wait(10)
            except subprocess.TimeoutExpired:
                balancer.process.kill()
                balancer.process.wait(10)


@dataclass
class Replica:
    """A server process and the address it serves on."""

    server: ServerProcess
    target: str

    def kill(self) -> None:
        self.server.kill()


@pytest.fixture
def cluster(
    spawn_server: Spawn, start_nginx: Callable[[list[str]], Balancer]
) -> tuple[list[Replica], Balancer]:
    """Three replicas and nginx in front of them."""
    replicas = [Replica(server, server.target) for server in (spawn_server() for _ in range(3))]
    return replicas, start_nginx([replica.target for replica in replicas])


# -- counters and load


Target = str | list[str]


def info(target: str) -> posenc.ServerInfo:
    """One replica's own description and counters, asked directly."""
    with posenc.Client(target, max_retries=0, timeout=5) as client:
        return client.server_info()


def exact_call(client: posenc.Client, kind: str, rng: np.random.Generator) -> bool:
    """One SDK call of ``kind``; whether its result is the engine's, byte for byte."""
    # Fresh (d_model, position) pairs: mostly cache misses, so every call computes.
    d_model = int(rng.integers(8, 257))
    start = int(rng.integers(-(10**9), 10**9))
    if kind == "range":  # one unary GetEncoding, up to 200 KB
        table = client.get_range(start, start + 200, d_model)
        expected = encode_range(classic(d_model), start, start + 200)
    elif kind == "positions":  # one unary GetEncoding of scattered positions
        positions = rng.integers(-(2**40), 2**40, 64)
        table = client.get_positions(positions, d_model)
        expected = encode_positions(classic(d_model), positions)
    elif kind == "stream":  # get_range over StreamEncoding: 1.25 MB in 16 KiB chunks
        table = client.get_range(start, start + 5000, 64)
        expected = encode_range(classic(64), start, start + 5000)
    elif kind == "iter":  # iter_range: 1 MiB in 16 KiB slices, in order, no gap
        expected = encode_range(classic(128), start, start + 2048)
        table = np.empty_like(expected)
        position = start
        for first, rows in client.iter_range(start, start + 2048, 128):
            if first != position:
                return False
            table[first - start : first - start + len(rows)] = rows
            position += len(rows)
        if position != start + 2048:
            return False
    else:
        raise AssertionError(kind)
    return table.dtype == expected.dtype and bool(np.array_equal(table, expected))


@dataclass
class Load:
    """Client threads, one SDK client each, looping over calls until ``finish``."""

    target: Target
    kinds: tuple[str, ...]
    threads: int = 3
    calls: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        self._workers += start_threads(self._run, self.threads)  # a seed each
        return self

    def finish(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(30)
            assert not worker.is_alive(), "a client thread is stuck"

    def completed(self) -> int:
        """The calls that completed so far, exact or not."""
        with self._lock:
            return sum(self.calls.values())

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        # Small stream chunks: the streamed kinds are streams of 64 chunks and more.
        with posenc.Client(self.target, timeout=30, chunk_bytes=16 << 10) as client:
            n = seed
            while not self._stop.is_set():
                kind = self.kinds[n % len(self.kinds)]
                n += 1
                try:
                    exact = exact_call(client, kind, rng)
                except Exception as error:
                    with self._lock:
                        self.failures.append(f"{kind}: {type(error).__name__}: {error}")
                    continue
                with self._lock:
                    self.calls[kind] += 1
                    if not exact:
                        self.wrong.append(kind)


LONG_ROWS = 1 << 18
LONG_D_MODEL = 256  # 256 MiB of float32 in 4,096 chunks of 64 KiB
LONG_CHUNK_BYTES = 64 << 10


@dataclass
class LongStream:
    """One ``iter_range`` whose slow consumer (2 ms a chunk, 32 MB/s at most) keeps it
    running for 8 s and more, and which stops reading at a quarter of the table until
    ``killed`` is set. Socket and proxy buffers hold far less than the 192 MiB the replica
    then has yet to send, so the kill always cuts the replica's stream, however fast or
    slow the machine."""

    target: Target
    killed: threading.Event = field(default_factory=threading.Event)
    received: int = 0
    gaps: int = 0
    table: np.ndarray[Any, Any] | None = None
    error: str | None = None
    _thread: threading.Thread | None = None

    def start(self) -> LongStream:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join(50)
        assert not self._thread.is_alive(), "the long stream is stuck"

    def _run(self) -> None:
        table = np.empty((LONG_ROWS, LONG_D_MODEL), dtype=np.float32)
        try:
            with posenc.Client(self.target, timeout=45, chunk_bytes=LONG_CHUNK_BYTES) as client:
                for first, rows in client.iter_range(0, LONG_ROWS, LONG_D_MODEL):
                    if first != self.received:
                        self.gaps += 1
                    table[first : first + len(rows)] = rows
                    self.received = first + len(rows)
                    if self.received >= LONG_ROWS // 4:
                        self.killed.wait(30)  # a hang guard: the kill comes first
                    time.sleep(0.002)
        except Exception as error:
            self.error = f"{type(error).__name__}: {error}"
            return
        self.table = table

    def check_exact(self) -> None:
        assert self.error is None, f"the long stream failed: {self.error}"
        assert self.gaps == 0 and self.received == LONG_ROWS
        assert self.table is not None
        expected = encode_range(classic(LONG_D_MODEL), 0, LONG_ROWS)
        assert np.array_equal(self.table, expected)


def serving_replica(replicas: list[Replica]) -> Replica:
    """The only replica that has computed rows: the one serving the only call so far."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        busy = [r for r in replicas if info(r.target).rows_computed > 0]
        if busy:
            assert len(busy) == 1, "only one call should be running"
            return busy[0]
        time.sleep(0.01)
    raise TimeoutError("no replica started computing")


@dataclass
class Outcome:
    load: Load
    completed_at_kill: int  # calls completed when the victim had been killed
    before: dict[str, int]  # rows computed per replica just before the kill
    after: dict[str, int]  # rows computed per surviving replica at the end


def kill_under_load(
    replicas: list[Replica],
    target: Target,
    kinds: tuple[str, ...],
    victim: Replica,
    long_stream: LongStream | None = None,
) -> Outcome:
    """3 client threads call ``kinds`` through ``target``; ``victim`` is SIGKILLed once the
    load is under way (as many calls completed as there are kinds, every replica computed
    rows, the long stream if any is received in part), and the load goes on until 10 calls
    more completed, every kind 3 times, and each survivor computed rows since the kill."""
    load = Load(target, kinds).start()
    wait_until(
        lambda: (
            load.completed() >= len(kinds)
            and all(info(r.target).rows_computed > 0 for r in replicas)
            and (long_stream is None or long_stream.received > 0)
        ),
        "the load did not reach every replica",
    )
    before = {r.target: info(r.target).rows_computed for r in replicas}
    if long_stream is not None:
        # Well inside the stream, with the replica's rest of it not yet sent.
        print(f"killed after {long_stream.received} rows of the long stream were received")
        assert 0 < long_stream.received < LONG_ROWS // 2, "the kill must cut the long stream"
    victim.kill()
    completed_at_kill = load.completed()
    if long_stream is not None:
        long_stream.killed.set()
    survivors = [r for r in replicas if r is not victim]
    wait_until(
        lambda: (
            load.completed() >= completed_at_kill + 10
            and all(load.calls[kind] >= 3 for kind in kinds)
            and all(info(r.target).rows_computed > before[r.target] for r in survivors)
        ),
        "the survivors did not take the load over",
    )
    load.finish()
    after = {r.target: info(r.target).rows_computed for r in survivors}
    return Outcome(load, completed_at_kill, before, after)


def check_no_failed_call(outcome: Outcome) -> None:
    load = outcome.load
    after_kill = load.completed() - outcome.completed_at_kill
    print(f"calls {dict(load.calls)}, {after_kill} of them completed after the kill")
    print(f"rows computed: before the kill {outcome.before}, survivors at the end {outcome.after}")
    assert not load.failures, f"{len(load.failures)} failed SDK calls: {load.failures[:5]}"
    assert not load.wrong, f"inexact results: {Counter(load.wrong)}"
    assert all(load.calls[kind] >= 3 for kind in load.kinds), load.calls
    # Every replica served the load before the kill, the victim included ...
    assert all(rows > 0 for rows in outcome.before.values()), outcome.before
    # ... and the survivors served it after the kill.
    assert after_kill >= 10
    assert all(rows > outcome.before[t] for t, rows in outcome.after.items())


# -- tests ---------------------------------------------------------------------------------


def test_the_shipped_config_passes_nginx_t(nginx_binary: str, tmp_path: Path) -> None:
    conf = render_nginx_conf(tmp_path, ["127.0.0.1:1", "127.0.0.1:2"], free_port())
    (tmp_path / "nginx.conf").write_text(conf)
    check = subprocess.run(
        [nginx_binary, "-t", "-p", str(tmp_path), "-c", "nginx.conf"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr
    assert "syntax is ok" in check.stderr


def test_calls_spread_over_all_three_replicas(cluster: tuple[list[Replica], Balancer]) -> None:
    replicas, balancer = cluster
    # One connection: nginx balances each call whatever the connection, and the calls in its
    # log are then the test's own (a client of several connections first streams an empty
    # range over each, once, to learn which server process each reaches).
    with posenc.Client(balancer.target, timeout=30, chunk_bytes=64 << 10, connections=1) as client:
        # 30 calls, each one cache miss (a new d_model, one cached block): 18 unary calls
        # and 12 streams of 16+ chunks (1 MiB, the server's block size).
        for d_model in range(1, 31):
            if d_model % 5 in (1, 2, 4):
                table = client.get_range(0, 100, d_model)
            else:
                rows = (1 << 20) // (4 * d_model)
                slices = [block for _, block in client.iter_range(0, rows, d_model)]
                assert len(slices) >= 16
                table = np.concatenate(slices)
            assert np.array_equal(table, encode_range(classic(d_model), 0, len(table)))
    infos = {r.target: info(r.target) for r in replicas}
    misses = {target: i.cache.misses for target, i in infos.items()}
    balancer.wait_for_log(30)
    print(f"cache misses per replica {misses}")
    print(f"rows computed per replica { {t: i.rows_computed for t, i in infos.items()} }")
    print(f"calls per replica in nginx's access log {dict(balancer.upstreams())}")
    assert len({i.server_id for i in infos.values()}) == 3
    # Each call is one cache miss on the replica that served it: balanced per call.
    assert sum(misses.values()) == 30
    assert all(count >= 8 for count in misses.values()), misses
    assert all(i.rows_computed > 0 for i in infos.values())
    # nginx's own log tells the same story, replica by replica.
    assert balancer.upstreams() == misses


def test_the_largest_requests_and_results_pass_through_nginx(
    cluster: tuple[list[Replica], Balancer],
) -> None:
    replicas, balancer = cluster
    limits = info(replicas[0].target).limits
    # 1,048,576 negative positions: 10-byte varints, a 10.5 MB request.
    positions = -np.arange(1, limits.max_positions + 1, dtype=np.int64) * 4_000_000
    # The largest unary result the server allows: one message of nearly 4 MiB.
    unary_rows = limits.max_unary_bytes // (256 * 4)
    with posenc.Client(
        balancer.target, timeout=60, unary_max_bytes=limits.max_unary_bytes
    ) as client:
        table = client.get_positions(positions, 4)
        assert np.array_equal(table, encode_positions(classic(4), positions))
        table = client.get_range(0, unary_rows, 256)
        assert np.array_equal(table, encode_range(classic(256), 0, unary_rows))
        # 64 MiB streamed in the server's largest chunks (1 MiB).
        table = client.get_range(0, 1 << 16, 256)
        assert np.array_equal(table, encode_range(classic(256), 0, 1 << 16))


def test_nginx_passes_the_calls_of_a_dead_replica_to_live_ones(
    cluster: tuple[list[Replica], Balancer],
) -> None:
    """No help from the SDK (no retries): nginx itself sends a call whose replica refuses
    the connection to the next replica, and stops trying the dead one for a while."""
    replicas, balancer = cluster
    dead = replicas[0]
    dead.kill()
    time.sleep(0.5)  # nginx sees its idle connections to the dead replica close
    rng = np.random.default_rng(7)
    # One connection: the calls in nginx's log are the test's own (see above).
    with posenc.Client(balancer.target, timeout=10, max_retries=0, connections=1) as client:
        for n in range(30):
            assert exact_call(client, ("range", "positions", "stream")[n % 3], rng)
    balancer.wait_for_log(30)
    passed_on = balancer.passed_on()
    print(f"calls nginx passed on from the dead replica: {passed_on}")
    print(f"calls per replica in nginx's access log {dict(balancer.upstreams())}")
    assert passed_on and all(f"upstream={dead.target}, " in line for line in passed_on)
    assert balancer.upstreams()[dead.target] == 0
    assert sum(balancer.upstreams().values()) == 30


def test_nginx_resets_a_stream_whose_replica_dies_mid_stream_with_internal(
    cluster: tuple[list[Replica], Balancer],
) -> None:
    """Why the SDK retries INTERNAL "RST_STREAM" as well as UNAVAILABLE. Once a response has
    started, nginx cannot pass the call to another replica; when that replica dies, nginx
    resets the HTTP/2 stream (RST_STREAM, INTERNAL_ERROR), which gRPC reports as INTERNAL
    "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))", not as
    UNAVAILABLE."""
    replicas, balancer = cluster
    request = pb.StreamEncodingRequest(
        spec=pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=LONG_D_MODEL)),
        range=pb.PositionRange(start=0, stop=LONG_ROWS),
        max_chunk_bytes=LONG_CHUNK_BYTES,
    )
    with grpc.insecure_channel(balancer.target) as channel:
        stub = pb_grpc.PositionalEncodingServiceStub(channel)
        chunks = iter(stub.StreamEncoding(request, timeout=30))
        next(chunks)
        serving_replica(replicas).kill()
        with pytest.raises(grpc.RpcError) as failure:
            for _ in chunks:
                time.sleep(0.002)
    error: Any = failure.value
    print(f"after the kill: {error.code()}: {error.details()}")
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "RST_STREAM" in error.details()


def test_streams_survive_a_replica_killed_mid_stream_behind_nginx(
    cluster: tuple[list[Replica], Balancer],
) -> None:
    replicas, balancer = cluster
    long_stream = LongStream(balancer.target).start()
    victim = serving_replica(replicas)
    kinds = ("range", "positions", "stream", "iter")
    outcome = kill_under_load(replicas, balancer.target, kinds, victim, long_stream)
    long_stream.join()
    long_stream.check_exact()
    check_no_failed_call(outcome)


def test_client_side_round_robin_survives_a_replica_killed_mid_stream(
    spawn_server: Spawn,
) -> None:
    """The Kubernetes headless-Service path, no proxy: the SDK balances over three replicas on
    one port at three addresses (as over pods), and resumes what a dead one cut off."""
    port = free_port()
    replicas = []
    for i in (1, 2, 3):
        server = spawn_server(port, "--host", f"127.0.0.{i}")
        replicas.append(Replica(server, f"127.0.0.{i}:{port}"))
    targets = [r.target for r in replicas]
    long_stream = LongStream(targets).start()
    victim = serving_replica(replicas)
    kinds = ("range", "positions", "stream", "iter")
    outcome = kill_under_load(replicas, targets, kinds, victim, long_stream)
    long_stream.join()
    long_stream.check_exact()
    check_no_failed_call(outcome)
