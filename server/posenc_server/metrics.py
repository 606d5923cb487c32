"""Prometheus metrics of the service, served over HTTP on ``metrics_port``.

With several server processes, prometheus-client's multiprocess mode aggregates them: the
supervisor points every worker at one directory (``PROMETHEUS_MULTIPROC_DIR``, read when
prometheus-client is imported) and serves the sum. A single process serves its own.
"""

from __future__ import annotations

import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from posenc_server.cache import CacheStats

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

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
STREAMS_IN_FLIGHT = Gauge(
    "posenc_streams_in_flight", "Streams being served now.", multiprocess_mode="livesum"
)
ROWS_COMPUTED = Counter("posenc_rows_computed_total", "Table rows computed (cache misses).")
CACHE_HITS = Counter("posenc_cache_hits_total", "Cache lookups that found their block.")
CACHE_MISSES = Counter("posenc_cache_misses_total", "Cache lookups that computed their block.")
CACHE_EVICTIONS = Counter("posenc_cache_evictions_total", "Blocks evicted to fit the budget.")
CACHE_BYTES = Gauge("posenc_cache_bytes", "Bytes held by the cache.", multiprocess_mode="livesum")
CACHE_BUDGET = Gauge("posenc_cache_budget_bytes", "Cache budget.", multiprocess_mode="livesum")


class MethodMetrics:
    """One method's metrics, with their label children bound once: recording a call costs
    no label lookups."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.latency = LATENCY.labels(method)
        self.payload_bytes = PAYLOAD_BYTES.labels(method)
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


def _advance(counter: Counter, published: int, current: int) -> int:
    if current > published:
        counter.inc(current - published)
        return current
    return published


def serve(host: str, port: int, multiprocess_dir: str | None = None) -> int:
    """Serve /metrics on ``host:port`` (0: a free port) in a thread; returns the port.

    With ``multiprocess_dir``, serves the sum of the worker processes writing there.
    """
    registry: CollectorRegistry = prometheus_client.REGISTRY
    if multiprocess_dir is not None:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
    server, _ = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def forget_process(pid: int, multiprocess_dir: str) -> None:
    """Drop a dead worker's live gauges (its counters stay: they happened)."""
    multiprocess.mark_process_dead(pid, multiprocess_dir)  # type: ignore[no-untyped-call]
