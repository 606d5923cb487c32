"""Process wiring: gRPC server, health, reflection, logging, signals and graceful drain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_reflection.v1alpha import reflection

from posenc_server import auth, health, heap, metrics, shm, supervisor, warmup
from posenc_server.admission import ByteBudget
from posenc_server.config import PROGRAM, ServerConfig, shm_peers, startup_fields, version
from posenc_server.interceptors import ServingInterceptor
from posenc_server.service import EncodingService
from posenc_server.servicer import (
    METHOD_NAMES,
    SERVICE_NAME,
    STREAMING_METHODS,
    PositionalEncodingServicer,
    add_to_server,
)
from posenc_server.specs import SpecTable

T = TypeVar("T")

log = logging.getLogger("posenc_server")

_CONNECTION_AGE_GRACE_MS = 30_000
# A connection's TCP, TLS and HTTP/2 handshakes must be over this long after it opened.
_HANDSHAKE_TIMEOUT_MS = 10_000
# HTTP/2 keepalive (see the server options): a ping this often on a connection with calls
# in flight, unanswered this long closes it; clients may ping down to every _MIN_CLIENT_PING_MS.
_KEEPALIVE_TIME_MS = 30_000
_KEEPALIVE_TIMEOUT_MS = 10_000
_MIN_CLIENT_PING_MS = 10_000
# The most a connection holds to read into (see the server options).
_READ_BUFFER_BYTES = 64 << 10
# How long a client turned away for lack of in-flight memory is told to wait.
_ADMISSION_RETRY_AFTER = 0.2
# A call whose request has not arrived this long after it was admitted to read it gives its
# reservation up to a call that needs it (RESOURCE_EXHAUSTED with RetryInfo): ample for any
# request on a network a decode loop would use (10 MB at 400 Mbit/s), and short enough that
# calls which never send their request cannot keep others waiting.
_READ_PREEMPT_AFTER = 0.5
# Methods of the health and reflection services: with the posenc ones, every metric label.
_OTHER_METHODS = frozenset(
    {
        *health.METHOD_NAMES,
        "ServerReflectionInfo",
    }
)
_TRIM_AFTER_RELEASED_BYTES = 16 << 20
# Memory beyond what the process accounts for, kept rather than trimmed (see housekeeping).
_HEAP_SLACK_BYTES = 32 << 20
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for gRPC servers, running in a thread of its own (started
    on first use; every server of the process shares it)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="posenc-loop", daemon=True).start()
        return _loop


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with any ``extra={"fields": {...}}`` merged in."""

    def __init__(self, static_fields: dict[str, object] | None = None) -> None:
        super().__init__()
        self.static_fields = static_fields or {}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(self.static_fields)
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, static_fields: dict[str, object] | None = None) -> None:
    """Send structured logs to stderr at ``level``, each line with ``static_fields``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(static_fields))
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


@dataclass
class RunningServer:
    """A started server and what is needed to drain and stop it."""

    config: ServerConfig
    port: int
    server: grpc.aio.Server
    service: EncodingService
    health: health.Health
    budget: ByteBudget
    pool: futures.ThreadPoolExecutor
    loop: asyncio.AbstractEventLoop
    publisher: metrics.ServicePublisher = field(default_factory=metrics.ServicePublisher)
    private: grpc.aio.Server | None = None
    """A worker's private health line for its supervisor (``health.serve_private``)."""
    shared: shm.SharedPool | None = None
    """Shared memory for results over the unix socket, and its region socket."""
    regions: shm.RegionServer | None = None

    def publish_metrics(self) -> None:
        """Bring the cache and computation metrics up to date (called now and then: on
        every call, it would cost the decode steps more than their rows)."""
        self.publisher.publish(self.service.cache_stats(), self.service.rows_computed)
        metrics.IN_FLIGHT_BYTES.set(self.budget.used)
        if self.shared is not None:
            metrics.SHM_SESSIONS.set(self.shared.sessions)
            metrics.SHM_LEASED_BYTES.set(self.shared.leased_bytes)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the server's event loop and return its result (TimeoutError,
        the coroutine cancelled, when the loop has not answered within ``timeout``)."""
        answer = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return answer.result(timeout)
        except TimeoutError:
            answer.cancel()
            raise

    def serving(self, timeout: float) -> bool:
        """Whether health says SERVING, as the event loop answers it within ``timeout``
        seconds: a loop that does not answer is not serving either."""

        async def status() -> bool:
            return bool(self.health.status("") == health.SERVING)

        try:
            return self.call(status(), timeout)
        except (TimeoutError, RuntimeError):  # RuntimeError: the loop is closed
            return False

    def not_serving(self) -> None:
        """Health says NOT_SERVING from now on (as at the start of a drain)."""
        self.call(self.health.enter_graceful_shutdown())

    def stop(self, grace: float | None) -> None:
        """Stop serving: calls in flight get ``grace`` seconds, then are cancelled."""
        self.call(self.server.stop(grace))
        if self.private is not None:
            self.call(self.private.stop(0))
        if self.regions is not None:
            self.regions.close()
        if self.shared is not None:
            self.shared.close()
        if self.config.unix_socket:
            with contextlib.suppress(OSError):
                os.unlink(self.config.unix_socket)
        self.pool.shutdown(wait=False, cancel_futures=True)

    @property
    def target(self) -> str:
        """Where clients on this machine reach the server."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    def shutdown(self, grace: float | None = None, hurry: threading.Event | None = None) -> bool:
        """Drain, then stop. Returns True when every in-flight call finished within the grace.

        Health turns NOT_SERVING first, so balancers and probes move traffic away; new encoding
        calls get UNAVAILABLE; calls in flight (streams included) get ``grace`` seconds to end,
        or until ``hurry`` is set (a second signal): then they are cancelled at once.
        """
        grace = self.config.grace_seconds if grace is None else grace
        hurry = hurry or threading.Event()
        deadline = time.monotonic() + grace
        self.not_serving()
        self.service.begin_drain()
        drained = False
        while not drained and not hurry.is_set() and (left := deadline - time.monotonic()) > 0:
            drained = self.service.wait_idle(min(left, supervisor.HURRY_CHECK_SECONDS))
        hurried = hurry.is_set()
        if hurried:
            log.info("stopping now: a second signal came during the drain")
        if self.service.in_flight:
            # What the grace (or the second signal) cuts: the operator's clue to a stream
            # longer than the grace, or to a call that never ends.
            log.warning(
                "calls in flight at the end of the drain are cancelled",
                extra={
                    "fields": {"calls": self.service.in_flight, "streams": self.service.streams}
                },
            )
        self.stop(0.0 if hurried else max(0.0, deadline - time.monotonic()))
        return drained


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files; mutual TLS with a client CA."""
    if not config.tls_cert_file:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as file:
            return file.read()

    client_ca = read(config.tls_client_ca_file) if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(read(config.tls_key_file), read(config.tls_cert_file))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


# How long /healthz waits for the event loop's answer (a probe's own timeout is seconds).
_PROBE_TIMEOUT = 1.0


def housekeeping(running: RunningServer, stop: threading.Event, prefaulted: int) -> None:
    """Publish the cache metrics five times a second, and trim the heap after evictions and
    after calls in flight gave memory back, when the process holds more than it should.

    glibc serves the 1 MiB blocks from its heap (see :mod:`posenc_server.heap`), where
    long-lived cached blocks pin the space freed between them: without trimming, RSS under
    cache churn creeps past the budget. Mapping every block on its own instead costs page
    faults on every chunk, so the heap is trimmed after evictions only: at the next tick, or
    at once when the service has evicted enough for memory to run ahead of the ticks
    (``EncodingService.trim_due``). gRPC receives requests in many small buffers, which
    fragment the heap the same way: the heap is trimmed too once calls in flight have given
    back ``_TRIM_AFTER_RELEASED_BYTES`` since the last trim.

    A trim also gives back the space the next blocks would reuse: under steady cache churn
    (cold tables, the cache full) every new block then costs page faults again. So the heap
    is trimmed only when the process holds more than it accounts for: its size at start
    (``prefaulted`` bytes of it the space the cache fills first), the cache beyond that, the
    bytes of calls in flight, the shared memory of the unix socket and ``_HEAP_SLACK_BYTES``.
    """
    service, budget = running.service, running.budget
    baseline = heap.resident_bytes()
    evictions = released = 0
    while not stop.is_set():
        due = service.trim_due.wait(0.2)
        service.trim_due.clear()
        running.publish_metrics()
        cache = service.cache_stats()
        freed = budget.released - released >= _TRIM_AFTER_RELEASED_BYTES
        if due or freed or cache.evictions != evictions:
            resident = heap.resident_bytes()
            if baseline is not None and resident is not None:
                cache_beyond = max(cache.bytes - prefaulted, 0)
                accounted = baseline + cache_beyond + budget.used + _HEAP_SLACK_BYTES
                if running.shared is not None:  # its pages count once written
                    accounted += running.shared.nbytes
                if resident <= accounted:
                    continue  # the space freed is reused by the next blocks
            evictions, released = cache.evictions, budget.released
            heap.trim()


def start_server(config: ServerConfig, *, reuse_port: bool = False) -> RunningServer:
    """Start serving ``config`` on the process's event loop and return the running server.

    ``reuse_port`` lets several processes listen on one port (the supervisor's workers);
    otherwise a busy port is an error rather than silently shared.
    """
    loop = event_loop()
    return asyncio.run_coroutine_threadsafe(_start(config, reuse_port, loop), loop).result()


async def _start(
    config: ServerConfig, reuse_port: bool, loop: asyncio.AbstractEventLoop
) -> RunningServer:
    service = EncodingService(config)
    # The CPU work of calls (parsing, specs, rows); calls waiting for I/O hold no thread.
    pool = futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="posenc")
    budget = ByteBudget(
        config.in_flight_bytes,
        config.admission_wait_seconds,
        _ADMISSION_RETRY_AFTER,
        _READ_PREEMPT_AFTER,
    )
    specs = SpecTable(config, max_bytes=config.spec_bytes)
    shared = shm.SharedPool(config.shm_bytes) if config.unix_socket and config.shm_bytes else None
    servicer = PositionalEncodingServicer(config, specs, service, version(), pool, budget, shared)
    server = grpc.aio.server(
        interceptors=[_interceptor(config)], options=_server_options(config, reuse_port)
    )
    health_servicer = _add_services(server, servicer, config)
    port, private = await _listen(server, config, health_servicer)
    await server.start()
    regions = await _serve_regions(server, config, shared)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health.SERVING)
    running = RunningServer(
        config,
        port,
        server,
        service,
        health_servicer,
        budget,
        pool,
        loop,
        private=private,
        shared=shared,
        regions=regions,
    )
    running.publish_metrics()
    return running


def _add_services(
    server: grpc.aio.Server, servicer: PositionalEncodingServicer, config: ServerConfig
) -> health.Health:
    """Serve ``servicer``, health (returned) and reflection on ``server``."""
    add_to_server(servicer, server)
    health_servicer = health.Health(
        config.max_receive_message_bytes,
        config.read_timeout_seconds,
        config.admission_wait_seconds,
    )
    health.add_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return health_servicer


def _interceptor(config: ServerConfig) -> ServingInterceptor:
    """Auth (the bearer token of ``auth_token_file``, if any), metrics and errors around
    every handler."""
    token = None
    if config.auth_token_file:
        token = auth.BearerToken(auth.read_token(config.auth_token_file))
    return ServingInterceptor(
        (SERVICE_NAME, health.SERVICE_NAME),
        frozenset(METHOD_NAMES) | _OTHER_METHODS,
        STREAMING_METHODS,
        config.read_timeout_seconds,
        token,
    )


def _server_options(config: ServerConfig, reuse_port: bool) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments: message sizes, the memory a connection may hold
    outside the in-flight budget, connection ages and limits, keepalive."""
    return [
        ("grpc.max_receive_message_length", config.max_receive_message_bytes),
        ("grpc.max_send_message_length", config.max_send_message_bytes),
        ("grpc.so_reuseport", int(reuse_port)),
        # Without BDP probing, a call's request occupies at most the initial 64 KiB window
        # until its handler reads it; with it, gRPC widens the window and lets every client
        # send megabytes per call before any handler asks, memory the in-flight budget
        # never sees.
        ("grpc.http2.bdp_probe", 0),
        # gRPC sizes a connection's read buffer by its largest recent reads and keeps it
        # while the connection lives, outside the in-flight budget: capped, a connection
        # that once sent a large request holds no more than the cap, and large requests
        # still arrive at full speed (the reads are only more of them).
        ("grpc.experimental.tcp_max_read_buffer_size", _READ_BUFFER_BYTES),
        # Clients re-resolve names only when a connection closes: closing connections
        # now and then lets them find replicas added since (the SDK resumes cut streams).
        ("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000)),
        ("grpc.max_connection_age_grace_ms", _CONNECTION_AGE_GRACE_MS),
        # Each connection holds memory the in-flight budget does not count (its state and
        # buffers), so a flood of them is capped: connections past the limit are closed as
        # they come (the supervisor's health line is not one), and one that has not
        # finished its handshake in time is closed too.
        *(
            [("grpc.max_allowed_incoming_connections", config.max_connections)]
            if config.max_connections
            else []
        ),
        ("grpc.server_handshake_timeout_ms", _HANDSHAKE_TIMEOUT_MS),
        # HTTP/2 keepalive: the server pings a connection with calls in flight, so that a
        # client (or a balancer's upstream connection) that vanished without a reset frees
        # its calls within a bound, and a balancer waiting on a stream hears from the
        # replica at least this often (its read timeout need only exceed it). The SDK's
        # own pings are accepted down to every _MIN_CLIENT_PING_MS.
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        # How long any ping's answer is waited for (gRPC's default ignores the keepalive
        # timeout).
        ("grpc.http2.ping_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", _MIN_CLIENT_PING_MS),
    ]


async def _listen(
    server: grpc.aio.Server, config: ServerConfig, health_servicer: health.Health
) -> tuple[int, grpc.aio.Server | None]:
    """Add the server's ports (TCP, and the unix socket if configured) and start the
    supervisor's private health line if this is a worker: the TCP port and that line."""
    credentials = server_credentials(config)
    private = None
    try:
        if address := os.environ.get(supervisor.HEALTH_SOCKET_ENV):
            # The supervisor's private line for health checks: it reaches this worker, not
            # whichever worker the kernel hands a TCP connection on the shared port, and
            # serves health alone, on a socket only the server's user can open.
            private = await health.serve_private(health_servicer, address)
        port = _add_port(server, config.address, credentials)
        if config.unix_socket:
            # The same service and credentials as the TCP port, for clients on this machine.
            shm.remove_stale_socket(config.unix_socket)
            _add_port(server, f"unix:{config.unix_socket}", credentials)
    except RuntimeError as error:
        raise OSError(f"cannot listen on {config.address}: {error}") from None
    return port, private


async def _serve_regions(
    server: grpc.aio.Server, config: ServerConfig, shared: shm.SharedPool | None
) -> shm.RegionServer | None:
    """Open the started server's unix socket to its group and hand out ``shared``'s
    regions beside it; on failure, stop the server and raise."""
    if not config.unix_socket:
        return None
    try:
        os.chmod(config.unix_socket, 0o660)  # its directory says who may reach it
        if shared is not None:
            peers = shm_peers(config.shm_peers)
            return shm.RegionServer(config.unix_socket + ".shm", shared, peers)
    except OSError:
        await server.stop(0)
        raise
    return None


def _add_port(server: grpc.aio.Server, address: str, credentials: Any) -> int:
    """Listen on ``address`` (with TLS when ``credentials``); OSError when it cannot."""
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return int(port)


# A warm-up still running after this long is said to be running: a first start compiles the
# kernels for a minute or more, and a server that prints nothing meanwhile looks hung.
_SLOW_WARM_UP_SECONDS = 2.0


@contextlib.contextmanager
def _said_when_slow(say: bool) -> Iterator[None]:
    """Logs what the server is doing when the warm-up inside takes longer than
    ``_SLOW_WARM_UP_SECONDS`` (if ``say``: one process of a supervisor's says it), and how
    long it took once done."""
    started = time.monotonic()
    said = threading.Event()

    def slow() -> None:
        said.set()
        log.info(
            "preparing the kernels: compiling them takes a minute or more on a first start "
            "(later starts load them from numba's cache) ..."
        )

    timer = threading.Timer(_SLOW_WARM_UP_SECONDS, slow)
    timer.daemon = True
    if say:
        timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            seconds = round(time.monotonic() - started, 1)
            log.info("kernels ready", extra={"fields": {"seconds": seconds}})


# Descriptors a process holds beside its client connections: listening sockets, the metrics
# port's connections, pipes, the libraries' own; the region socket's sessions come on top.
_FD_RESERVE = 256


def descriptors_needed(config: ServerConfig) -> int | None:
    """The file descriptors one server process of ``config`` may hold at once: its client
    connections (``max_connections``) and what it holds beside them; None without a
    connection limit (as many as the process may have)."""
    if not config.max_connections:
        return None
    sessions = shm.MAX_SESSIONS if config.unix_socket and config.shm_bytes else 0
    return config.max_connections + sessions + _FD_RESERVE


def raise_descriptor_limit(config: ServerConfig) -> None:
    """Raise this process's soft RLIMIT_NOFILE to what ``config`` needs (workers inherit
    it), up to the hard limit; OSError naming both numbers and the fix when the hard limit
    is lower.

    A soft limit below the connection limit (1,024 is common) lets a flood of connections
    that never authenticate take every descriptor: then no call, health check or region
    hello is served, and nothing says why.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    needed = descriptors_needed(config)
    if needed is None:  # no connection limit: as many as the hard limit allows
        needed = soft if hard == unlimited else hard
    elif hard != unlimited and hard < needed:
        raise OSError(
            f"--max-connections {config.max_connections} needs {needed} open files, and "
            f"this process may open at most {hard} (RLIMIT_NOFILE's hard limit): raise it "
            "(ulimit -Hn, systemd's LimitNOFILE, docker run --ulimit nofile=N) or lower "
            "--max-connections (POSENC_MAX_CONNECTIONS)"
        )
    if soft != unlimited and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _bring_up(
    config: ServerConfig,
    worker: int | None,
    serving: Callable[[], bool],
    alive: Callable[[], bool],
) -> tuple[RunningServer, int | None, int]:
    """Check the ports, serve metrics (unless a supervisor does), warm up and start the
    server: the running server, the metrics port (None for a worker) and the cache bytes
    faulted in."""
    metrics_port: int | None = None  # a worker's: its supervisor serves them
    if worker is None:
        # Both ports are checked before either listens: nothing serves half-started.
        # (A supervisor's workers share its port, and it serves their metrics.)
        supervisor.check_port_free(config.host, config.port, "--port (POSENC_PORT)")
        supervisor.check_unix_socket_free(config)
        metrics_port = supervisor.serve_metrics(config, serving, alive=alive)
    # Every dtype, kind and layout runs once before the server listens (the kernels
    # compiled or loaded from numba's cache, ml_dtypes imported), and the cache's memory
    # is faulted in: no request waits for either; nor for the collector walking what
    # start-up left alive.
    with _said_when_slow(worker in (None, 0)):
        warmup.warm_up()
    prefaulted = heap.prefault(config.cache_bytes)
    warmup.freeze()
    return start_server(config, reuse_port=worker is not None), metrics_port, prefaulted


def run(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then drain; the exit code of ``posenc serve``."""
    argv = list(argv or [])
    try:
        config = ServerConfig.from_args(argv)
    except ValueError as error:
        print(f"{PROGRAM}: {error}", file=sys.stderr)
        return 2
    try:
        raise_descriptor_limit(config)
    except OSError as error:
        print(f"{PROGRAM}: {error}", file=sys.stderr)
        return 1
    heap.one_heap()
    worker = supervisor.worker_index()
    if worker is None:  # once, before any process compiles
        warmup.seed_kernel_cache()
    configure_logging(config.log_level, None if worker is None else {"worker": worker})
    stop = threading.Event()
    hurry = threading.Event()  # a second signal: stop now, cancelling the calls in flight
    signals: list[str] = []
    _handle_signals(worker, stop, hurry, signals)
    if worker is None and config.process_count > 1:
        return supervisor.supervise(config, argv, stop, hurry, signals)
    return _serve(config, worker, stop, hurry, signals)


def _handle_signals(
    worker: int | None, stop: threading.Event, hurry: threading.Event, signals: list[str]
) -> None:
    """Set ``stop`` on SIGTERM or SIGINT (and ``hurry`` too on a second one, or on a
    worker's HURRY_SIGNAL), naming each signal in ``signals``."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals.append(signal.Signals(signum).name)
        if signum == supervisor.HURRY_SIGNAL or (stop.is_set() and worker is None):
            hurry.set()
        stop.set()

    # A worker takes its signals from its supervisor: SIGTERM to drain, HURRY_SIGNAL to stop
    # at once. A signal to the whole process group (Ctrl-C; SIGTERM from a shell, CI or
    # `timeout`) reaches the worker too, and would count twice: so a worker ignores SIGINT,
    # and a SIGTERM during its drain changes nothing.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal if worker is None else signal.SIG_IGN)
    if worker is not None:
        signal.signal(supervisor.HURRY_SIGNAL, on_signal)


def _serve(
    config: ServerConfig,
    worker: int | None,
    stop: threading.Event,
    hurry: threading.Event,
    signals: list[str],
) -> int:
    """Serve in this process (alone, or as a supervisor's ``worker``) until ``stop``, then
    drain; the exit code."""
    if worker is not None:
        supervisor.die_with_supervisor()
    started: list[RunningServer] = []  # the server, once it listens

    def alive() -> bool:
        return bool(started) and not stop.is_set() and started[0].serving(_PROBE_TIMEOUT)

    rooms: list[supervisor.ConnectionRoom] = []  # once the port is known

    def serving() -> bool:
        # A process at --max-connections closes every new connection: it serves no new call.
        return alive() and all(room.has_room(os.getpid()) for room in rooms)

    try:
        running, metrics_port, prefaulted = _bring_up(config, worker, serving, alive)
    except (OSError, RuntimeError, ValueError) as error:
        print(f"{PROGRAM}: {error}", file=sys.stderr)
        return 1
    rooms.append(supervisor.ConnectionRoom(config, running.port))
    started.append(running)
    threading.Thread(
        target=housekeeping,
        args=(running, stop, prefaulted),
        name="posenc-housekeeping",
        daemon=True,
    ).start()
    fields = startup_fields(config, running.port, metrics_port)
    log.info("listening" if worker is None else supervisor.WORKER_READY, extra={"fields": fields})
    # Any thread may receive the signal, and then a blocked main thread is not woken: poll, so
    # that the Python handler (which only runs on the main thread) runs within a moment.
    while not stop.wait(0.2):
        pass
    log.info("draining", extra={"fields": {"signal": signals[0], "grace": config.grace_seconds}})
    drained = running.shutdown(hurry=hurry)
    running.publish_metrics()
    log.info("stopped", extra={"fields": {"drained": drained}})
    return 0
