"""Prometheus metrics of the service, and its health for probes, served over HTTP on
``metrics_port``.

With several server processes, prometheus-client's multiprocess mode aggregates them: the
supervisor points every worker at one directory (``PROMETHEUS_MULTIPROC_DIR``, read when
prometheus-client is imported) and serves the sum. A single process serves its own.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
import prometheus_client.values
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from posenc_protocol.stats import CacheStats

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Set by the supervisor in a worker's environment: the worker's index (supervisor.py; not
# imported from there, which imports this module).
_WORKER_INDEX_ENV = "POSENC_WORKER_INDEX"
METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"
#: Liveness: 200 while the server's processes answer, whatever holds its connections.
LIVE_PATH = "/livez"

if os.environ.get(MULTIPROCESS_DIR_ENV) and os.environ.get(_WORKER_INDEX_ENV):
    # A worker's metric files are named after its index, not its pid: a replaced worker
    # goes on with its predecessor's files (and counts), so the directory holds one set of
    # files per worker however often workers are replaced. Set before any metric exists.
    _worker_files = f"worker{os.environ[_WORKER_INDEX_ENV]}"
    prometheus_client.values.ValueClass = prometheus_client.values.MultiProcessValue(  # type: ignore[no-untyped-call]
        lambda: _worker_files
    )

REQUESTS = Counter(
    "posenc_requests_total", "Finished calls by method and status code.", ["method", "code"]
)
LATENCY = Histogram(
    "posenc_request_duration_seconds",
    "Call duration by method, from the request to the last byte handed to gRPC.",
    ["method"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
             0.5, 1, 2.5, 5, 10, 30, 60, 300),
)  # fmt: skip
PAYLOAD_BYTES = Counter("posenc_payload_bytes_total", "Table bytes sent, by method.", ["method"])
OVERLOAD_REFUSALS = Counter(
    "posenc_overload_refusals_total",
    "Calls refused at a concurrency limit (no in-flight memory within the wait, the stream "
    "cap, the Watch cap): RESOURCE_EXHAUSTED with RetryInfo, worth retrying. By method.",
    ["method"],
)
STREAMS_IN_FLIGHT = Gauge(
    "posenc_streams_in_flight", "Streams being served now.", multiprocess_mode="livesum"
)
IN_FLIGHT_BYTES = Gauge(
    "posenc_in_flight_bytes",
    "Bytes held by encoding calls in flight (admitted against --in-flight-bytes).",
    multiprocess_mode="livesum",
)
ROWS_COMPUTED = Counter("posenc_rows_computed_total", "Table rows computed (cache misses).")
CACHE_HITS = Counter("posenc_cache_hits_total", "Cache lookups that found their block.")
CACHE_MISSES = Counter("posenc_cache_misses_total", "Cache lookups that computed their block.")
CACHE_EVICTIONS = Counter("posenc_cache_evictions_total", "Blocks evicted to fit the budget.")
CACHE_BYTES = Gauge("posenc_cache_bytes", "Bytes held by the cache.", multiprocess_mode="livesum")
CACHE_BUDGET = Gauge("posenc_cache_budget_bytes", "Cache budget.", multiprocess_mode="livesum")
CACHE_ENTRIES = Gauge(
    "posenc_cache_entries", "Blocks held by the cache.", multiprocess_mode="livesum"
)
SHM_SESSIONS = Gauge(
    "posenc_shm_sessions",
    "Sessions open on the region socket (clients on this machine using shared memory).",
    multiprocess_mode="livesum",
)
SHM_LEASED_BYTES = Gauge(
    "posenc_shm_leased_bytes",
    "Bytes of shared memory that clients hold leases on (at most --shm-bytes).",
    multiprocess_mode="livesum",
)
SHM_REFUSED = Counter(
    "posenc_shm_refused_total",
    "Peers the region socket refused (credentials outside --shm-peers, or too many sessions).",
)


class MethodMetrics:
    """One method's metrics, with their label children bound once: recording a call costs
    no label lookups."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.latency = LATENCY.labels(method)
        self.payload_bytes = PAYLOAD_BYTES.labels(method)
        self.overload_refusals = OVERLOAD_REFUSALS.labels(method)
        self._requests: dict[str, Counter] = {}

    def record(self, code: str, seconds: float | None) -> None:
        """Count one finished call with its status code name and duration (None: a call
        refused before it started, as an unauthenticated one)."""
        if seconds is not None:
            self.latency.observe(seconds)
        requests = self._requests.get(code)
        if requests is None:
            requests = self._requests[code] = REQUESTS.labels(self.method, code)
        requests.inc()


class ServicePublisher:
    """Brings the cache and computation metrics up to date with one service's counters.

    The service counts for itself (its own tests read those counts); this adds what changed
    since the last call to the process's Prometheus counters.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._rows = 0

    def publish(self, stats: CacheStats, rows_computed: int) -> None:
        """Report the service's counters, as read by the caller.

        Concurrent calls may arrive with their snapshots out of order: a counter only ever
        moves forward, to the largest value seen.
        """
        with self._lock:
            self._hits = _advance(CACHE_HITS, self._hits, stats.hits)
            self._misses = _advance(CACHE_MISSES, self._misses, stats.misses)
            self._evictions = _advance(CACHE_EVICTIONS, self._evictions, stats.evictions)
            self._rows = _advance(ROWS_COMPUTED, self._rows, rows_computed)
            CACHE_BYTES.set(stats.bytes)
            CACHE_BUDGET.set(stats.budget_bytes)
            CACHE_ENTRIES.set(stats.entries)


def server_totals(stats: CacheStats, rows_computed: int) -> tuple[CacheStats, int]:
    """The cache statistics and rows computed of the whole server.

    In a supervisor's worker, the sums over every worker's metric files (the workers publish
    their counters there five times a second, and this one's are ``stats`` as of now);
    in a single process, ``stats`` and ``rows_computed`` themselves.
    """
    directory = os.environ.get(MULTIPROCESS_DIR_ENV)
    if not directory or not os.environ.get(_WORKER_INDEX_ENV):
        return stats, rows_computed
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, directory)  # type: ignore[no-untyped-call]
    totals: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value

    def total(name: str) -> int:
        return int(totals.get(name, 0.0))

    summed = CacheStats(
        hits=total("posenc_cache_hits_total"),
        misses=total("posenc_cache_misses_total"),
        evictions=total("posenc_cache_evictions_total"),
        bytes=total("posenc_cache_bytes"),
        entries=total("posenc_cache_entries"),
        budget_bytes=total("posenc_cache_budget_bytes"),
    )
    return summed, total("posenc_rows_computed_total")


def _advance(counter: Counter, published: int, current: int) -> int:
    if current > published:
        counter.inc(current - published)
        return current
    return published


# Scrapers and probes are few and quick: at most this many connections are served at once
# (a thread each, so silent connections cannot pile up threads), and a connection silent this
# long is closed. When every place is taken, a new connection takes the place of the oldest
# one that has not sent its request yet (a scraper or a probe sends it at once): turning new
# connections away instead would let a client holding silent ones fail every scrape.
_MAX_SCRAPES = 32
_SCRAPE_TIMEOUT_SECONDS = 5.0
# How long a new connection waits for the place of a silent one it closed.
_TAKE_OVER_SECONDS = 1.0


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    # The kernel's queue of connections not yet accepted (socketserver's default is 5): a
    # burst of connections must not crowd a probe's out before it is accepted.
    request_queue_size = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(_MAX_SCRAPES)
        self._lock = threading.Lock()
        # Connections served that have not sent a request yet, by when they came.
        self._silent: dict[Any, float] = {}
        self.taken_over = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection in a thread of its own, in a free place or in the place of
        the oldest silent connection."""
        placed = self._slots.acquire(blocking=False) or (
            self._close_oldest_silent() and self._slots.acquire(timeout=_TAKE_OVER_SECONDS)
        )
        if not placed:
            self.shutdown_request(request)
            return
        with self._lock:
            self._silent[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection closed or timed out (a silent one whose place was taken, a scraper
        gone) is not worth a traceback; anything else is."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def spoke(self, request: Any) -> None:
        """``request``'s connection sent its request: its place is its own until served."""
        self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._lock:
            self._silent.pop(request, None)

    def _close_oldest_silent(self) -> bool:
        with self._lock:
            if not self._silent:
                return False
            oldest = min(self._silent, key=self._silent.__getitem__)
            del self._silent[oldest]
        self.taken_over += 1
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its thread's read ends, and frees the place
        return True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = _SCRAPE_TIMEOUT_SECONDS  # on the connection's socket: reads and writes

    def parse_request(self) -> bool:
        """Once the request line and headers have come, the connection keeps its place."""
        parsed = bool(super().parse_request())
        spoke = getattr(self.server, "spoke", None)
        if spoke is not None:
            spoke(self.request)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line."""


_WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _routes(app: _WsgiApp, serving: Callable[[], bool], alive: Callable[[], bool]) -> _WsgiApp:
    """``app`` at /metrics, the server's health at /healthz, its liveness at /livez; 404
    everywhere else."""

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO")
        if path in (HEALTH_PATH, LIVE_PATH):
            up = serving() if path == HEALTH_PATH else alive()
            start_response(
                "200 OK" if up else "503 Service Unavailable", [("Content-Type", "text/plain")]
            )
            return [b"SERVING\n" if up else b"NOT_SERVING\n"]
        if path != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [
                b"not found: the metrics are at /metrics, the health at /healthz, the "
                b"liveness at /livez\n"
            ]
        return app(environ, start_response)

    return serve


def serve(
    host: str,
    port: int,
    serving: Callable[[], bool],
    multiprocess_dir: str | None = None,
    alive: Callable[[], bool] | None = None,
) -> int:
    """Serve /metrics, /healthz and /livez, and nothing else, on ``host:port`` (0: a free
    port) in a thread; returns the port.

    /healthz answers 200 ``SERVING`` while ``serving()`` is true (a new call would be
    served), else 503 ``NOT_SERVING``: the readiness probe. /livez answers the same way by
    ``alive()`` (default ``serving``): the liveness probe, which a server at its connection
    limit still passes. Both share this server's connection handling, where a new
    connection takes the place of a silent one, so no flood of idle connections to this
    port fails them.
    With ``multiprocess_dir``, /metrics serves the sum of the worker processes writing there.
    """
    registry: CollectorRegistry = prometheus_client.REGISTRY
    if multiprocess_dir is not None:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
    app = _routes(prometheus_client.make_wsgi_app(registry), serving, alive or serving)
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="posenc-metrics", daemon=True).start()
    return int(server.server_port)


def forget_worker(index: int, multiprocess_dir: str) -> None:
    """Drop a dead worker's live gauges (its counters stay: they happened)."""
    multiprocess.mark_process_dead(f"worker{index}", multiprocess_dir)  # type: ignore[no-untyped-call]
