"""Operations: Prometheus metrics move with traffic, stream cap, cancellation stops work."""

from __future__ import annotations

import logging
import time
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from conftest import ServerProcess, wait_until
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import posenc
from posenc._retry import map_rpc_error
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc
from posenc_server.app import RunningServer

MIB = 1 << 20


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the /metrics page, keyed by name and sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return float(samples.get((name, tuple(sorted(labels.items()))), 0.0))


def metrics_port(process: ServerProcess) -> int:
    startup = next(entry for entry in process.logs() if entry["message"] == "listening")
    return int(startup["metrics_port"])  # type: ignore[call-overload]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.timeout(120)
def test_metrics_move_with_traffic(
    spawn_server: Callable[..., ServerProcess], processes: int
) -> None:
    process = spawn_server(0, "--processes", str(processes))
    port = metrics_port(process)
    before = scrape(port)
    # One connection each (4 clients reach the workers): the calls counted are the test's
    # own (a client of several connections first streams an empty range over each, once).
    clients = [posenc.Client(process.target, connections=1) for _ in range(4)]
    try:
        for client in clients:
            client.get_range(0, 100, 256)  # unary, misses then hits
            client.get_range(0, 100, 256)
            client.get_range(0, 8192, 256)  # 8 MiB: streamed
            with pytest.raises(posenc.InvalidArgumentError):
                client.get_range(0, 10, 0)
    finally:
        for client in clients:
            client.close()
    # Cache and row counters are published five times a second by each process, not on every
    # call: wait until every process has published what it did.
    deadline = time.monotonic() + 5
    while True:
        after = scrape(port)
        published = metric(after, "posenc_rows_computed_total") - metric(
            before, "posenc_rows_computed_total"
        )
        hits = metric(after, "posenc_cache_hits_total") - metric(before, "posenc_cache_hits_total")
        if hits > 0 and published >= 8192:
            break
        assert time.monotonic() < deadline, "cache metrics were not published"
        time.sleep(0.1)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("posenc_requests_total", method="GetEncoding", code="OK") == 8
    assert grew("posenc_requests_total", method="GetEncoding", code="INVALID_ARGUMENT") == 4
    assert grew("posenc_requests_total", method="StreamEncoding", code="OK") == 4
    assert grew("posenc_request_duration_seconds_count", method="StreamEncoding") == 4
    assert grew("posenc_payload_bytes_total", method="StreamEncoding") >= 4 * 8 * MIB
    assert grew("posenc_cache_hits_total") > 0
    assert grew("posenc_cache_misses_total") > 0
    assert grew("posenc_rows_computed_total") >= 8192
    assert metric(after, "posenc_cache_bytes") > 0
    assert metric(after, "posenc_cache_budget_bytes") == 512 * MIB
    assert metric(after, "posenc_streams_in_flight") == 0


def stream_request(rows: int, chunk: int = 64 * 1024) -> pb.StreamEncodingRequest:
    return pb.StreamEncodingRequest(
        spec=pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=1024)),
        range=pb.PositionRange(start=0, stop=rows),
        max_chunk_bytes=chunk,
    )


def test_concurrent_streams_over_the_cap_get_resource_exhausted(
    server_factory: Callable[..., RunningServer],
) -> None:
    server = server_factory(max_concurrent_streams=2, workers=4)
    with grpc.insecure_channel(server.target) as channel:
        stub = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
        # Two big streams, each read once and then left waiting: both stay in flight.
        held = [stub.StreamEncoding(stream_request(1 << 16)) for _ in range(2)]
        for call in held:
            next(call)
        with pytest.raises(grpc.RpcError) as raised:
            next(stub.StreamEncoding(stream_request(16)))
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "streams" in raised.value.details()
        # Unary calls still find a thread.
        stub.GetEncoding(
            pb.GetEncodingRequest(
                spec=pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=8)),
                range=pb.PositionRange(stop=2),
            )
        )
        for call in held:
            call.cancel()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert sum(m.chunk.rows for m in stub.StreamEncoding(stream_request(16))) == 16
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "cancelled streams were never released"
                time.sleep(0.05)


def requests_total(method: str, code: str) -> float:
    """The in-process servers' ``posenc_requests_total`` for ``method`` and ``code``."""
    return (
        REGISTRY.get_sample_value("posenc_requests_total", {"method": method, "code": code}) or 0.0
    )


@pytest.mark.slow
def test_the_sdk_waits_at_the_stream_cap_as_the_server_asks(
    server_factory: Callable[..., RunningServer], caplog: pytest.LogCaptureFixture
) -> None:
    """At the stream cap the server refuses a stream with RESOURCE_EXHAUSTED and a RetryInfo
    delay: the SDK waits at least that delay before each retry, and gets its stream once
    the stream that held the cap is gone (cancelled when the SDK first says it retries)."""
    server = server_factory(max_concurrent_streams=1, workers=4)
    caplog.set_level(logging.INFO, logger="posenc")
    refusals = "posenc_overload_refusals_total"
    refused_before = REGISTRY.get_sample_value(refusals, {"method": "StreamEncoding"}) or 0.0
    with grpc.insecure_channel(server.target) as channel:
        stub = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
        held = stub.StreamEncoding(stream_request(1 << 16))
        next(held)
        with pytest.raises(grpc.RpcError) as raised:
            next(stub.StreamEncoding(stream_request(16)))
        # The RetryInfo delay the server sent, read by the SDK's own mapping of the status.
        retry_after = map_rpc_error(raised.value).retry_after
        assert retry_after is not None and retry_after > 0

        class ReleaseOnRetry(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.getMessage().startswith("retrying"):
                    held.cancel()

        release = ReleaseOnRetry()
        logging.getLogger("posenc").addHandler(release)
        try:
            # Retries enough to outlast the held stream's release on a loaded machine.
            with posenc.Client(server.target, max_retries=20, timeout=120) as client:
                table = client.get_range(0, 4096, 1024)  # 16 MiB: a stream
        finally:
            logging.getLogger("posenc").removeHandler(release)
    assert table.shape == (4096, 1024)
    retries = [record for record in caplog.records if record.getMessage().startswith("retrying")]
    assert retries, "the SDK never met the cap"
    assert all("RESOURCE_EXHAUSTED" in record.getMessage() for record in retries)
    # The SDK's own delay before each retry (its log's first argument): what the server asked.
    delays = [record.args[0] for record in retries if isinstance(record.args, tuple)]
    assert len(delays) == len(retries), retries
    assert all(isinstance(delay, float) and delay >= retry_after for delay in delays), delays
    refused = REGISTRY.get_sample_value(refusals, {"method": "StreamEncoding"}) or 0.0
    assert refused - refused_before >= 1 + len(retries)


@pytest.mark.slow
def test_a_cancelled_stream_stops_computing(server: RunningServer) -> None:
    rows_total = 1 << 20  # 4 GiB at d_model 1024
    with posenc.Client(server.target) as client:
        before = client.server_info().rows_computed
        stream = client.iter_range(0, rows_total, 1024, chunk_bytes=MIB)
        next(stream)
        stream.close()  # the SDK cancels the call
        # The server closes a cancelled stream once a step computing meanwhile is over:
        # from then on, nothing computes for it.
        wait_until(lambda: server.service.streams == 0, "the stream never ended on the server")
        computed = client.server_info().rows_computed - before
    # A handful of 1 MiB blocks at most (what gRPC buffered), not the 4 GiB asked for.
    assert computed < 64 * 1024, computed


@pytest.mark.slow
def test_deadlines_are_honoured_by_server_and_sdk(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A call whose deadline passes ends in the SDK with DEADLINE_EXCEEDED, not retried;
    the server ends its stream too, and stops computing the table long before its end."""
    caplog.set_level(logging.INFO, logger="posenc")
    rows_total = 1 << 20
    before = server.service.rows_computed
    cancelled = requests_total("StreamEncoding", "CANCELLED")
    client = posenc.Client(server.target, max_retries=0)
    with client, pytest.raises(posenc.DeadlineExceededError):
        client.get_range(0, rows_total, 1024, timeout=0.5)  # 4 GiB cannot arrive in 0.5 s
    assert not any("retrying" in record.message for record in caplog.records)
    # The server saw the call end (its deadline passed: counted CANCELLED) and closed its
    # stream once a step computing meanwhile was over: from then on, nothing computes.
    wait_until(
        lambda: (
            server.service.streams == 0
            and requests_total("StreamEncoding", "CANCELLED") > cancelled
        ),
        "the server did not end the stream",
    )
    computed = server.service.rows_computed - before
    assert computed < rows_total // 4, computed


def test_metrics_publishing_tolerates_snapshots_out_of_order() -> None:
    from posenc_protocol.stats import CacheStats
    from posenc_server import metrics

    publisher = metrics.ServicePublisher()
    before = metrics.CACHE_HITS._value.get()
    newer = CacheStats(hits=11, misses=2, evictions=0, bytes=10, entries=1, budget_bytes=100)
    older = CacheStats(hits=10, misses=2, evictions=0, bytes=10, entries=1, budget_bytes=100)
    publisher.publish(newer, rows_computed=5)
    publisher.publish(older, rows_computed=4)  # a slower thread's earlier snapshot
    assert metrics.CACHE_HITS._value.get() - before == 11


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_server_info_counts_every_worker(spawn_server: Callable[..., ServerProcess]) -> None:
    process = spawn_server(0, "--processes", "2")
    server_ids: set[str] = set()
    calls = 0
    # New connections until both workers served (the kernel picks); each call computes one
    # block of its own (the ranges are 10**6 apart).
    while len(server_ids) < 2:
        with posenc.Client(process.target) as client:
            server_ids.add(client.server_info().server_id)
            client.get_range(10**6 * calls, 10**6 * calls + 10, 8)
        calls += 1
        assert calls < 100, "the kernel never picked the second worker"
    # Workers publish their counters five times a second: the sum catches up at once, and it
    # is the whole server's, as /metrics says, not the answering worker's share.
    deadline = time.monotonic() + 5
    with posenc.Client(process.target) as client:
        while True:
            info = client.server_info()
            misses = metric(scrape(metrics_port(process)), "posenc_cache_misses_total")
            if info.cache.misses == misses == calls:
                break
            assert time.monotonic() < deadline, (info.cache, misses, calls)
            time.sleep(0.1)


@pytest.mark.slow
def test_a_server_process_has_loaded_every_dtype_before_it_serves(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    # Importing ml_dtypes takes most of a second: a process loads it (its extension shows in
    # the process's memory maps) during its warm-up, before it reports SERVING, so no caller's
    # first bfloat16 table pays for it, and that table is served exactly.
    server = spawn_server(0)
    with open(f"/proc/{server.process.pid}/maps") as maps:
        assert "_ml_dtypes_ext" in maps.read()
    with posenc.Client(server.target, timeout=30) as client:
        rows = client.get_range(0, 8, 16, dtype="bfloat16")
        assert rows.dtype.name == "bfloat16"
        assert (rows.astype("float32") == client.get_range(0, 8, 16).astype(rows.dtype)).all()
