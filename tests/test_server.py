"""The service over real gRPC: chunks, cache, memory bound, health, reflection, drain."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from conftest import Spawn, peak_rss_mib
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from reference import engine_range

from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc
from posenc_server.app import RunningServer

MIB = 1 << 20


def classic(d_model: int, dtype: int = 0, **table: object) -> pb.EncodingSpec:
    """The classic sinusoidal table's spec."""
    return pb.EncodingSpec(
        dtype=dtype,  # type: ignore[arg-type]
        sinusoidal=pb.SinusoidalTable(d_model=d_model, **table),  # type: ignore[arg-type]
    )


def stream_request(d_model: int, start: int, stop: int, chunk: int = 0) -> pb.StreamEncodingRequest:
    return pb.StreamEncodingRequest(
        spec=classic(d_model), range=pb.PositionRange(start=start, stop=stop), max_chunk_bytes=chunk
    )


def info(stub: posenc_pb2_grpc.PositionalEncodingServiceStub) -> pb.GetServerInfoResponse:
    return stub.GetServerInfo(pb.GetServerInfoRequest())


@pytest.mark.parametrize("chunk", [0, 10_000, 4096])
def test_stream_chunks_are_row_aligned_ordered_and_within_the_chunk_limit(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub, chunk: int
) -> None:
    d_model, start, stop = 1024, -777, 3000
    expected_offset = 0
    parts = []
    for message in stub.StreamEncoding(stream_request(d_model, start, stop, chunk)):
        tensor = message.chunk
        assert tensor.row_offset == expected_offset
        assert tensor.columns == d_model and tensor.dtype == pb.DTYPE_FLOAT32
        assert len(tensor.data) == tensor.rows * d_model * 4
        assert len(tensor.data) <= (chunk or MIB)
        parts.append(np.frombuffer(tensor.data, "<f4").reshape(tensor.rows, d_model))
        expected_offset += tensor.rows
    assert expected_offset == stop - start
    table = np.concatenate(parts)
    np.testing.assert_array_equal(table, engine_range(classic(d_model), start, stop))


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT64])
def test_unary_and_stream_and_list_agree_with_the_engine(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub, dtype: int
) -> None:
    wire = classic(
        96, dtype, base=500000.0, layout=pb.LAYOUT_SPLIT, schedule=pb.SCHEDULE_TENSOR2TENSOR
    )
    expected = engine_range(wire, 2**40, 2**40 + 50)
    unary = stub.GetEncoding(
        pb.GetEncodingRequest(spec=wire, range=pb.PositionRange(start=2**40, stop=2**40 + 50))
    ).tensor
    assert unary.dtype == dtype
    assert unary.data == expected.tobytes()
    positions = [2**40 + 49, 2**40, 2**40 + 7]
    listed = stub.GetEncoding(
        pb.GetEncodingRequest(spec=wire, positions=pb.PositionList(positions=positions))
    ).tensor
    assert listed.data == expected[[49, 0, 7]].tobytes()
    streamed = stub.StreamEncoding(
        pb.StreamEncodingRequest(
            spec=wire,
            range=pb.PositionRange(start=2**40, stop=2**40 + 50),
            max_chunk_bytes=7 * expected[0].nbytes,
        )
    )
    assert b"".join(message.chunk.data for message in streamed) == expected.tobytes()


@pytest.mark.parametrize(
    "dtype", [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16]
)
def test_a_long_cold_range_streams_the_engines_rows_in_every_dtype(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub, dtype: int
) -> None:
    # Dozens of blocks: after the first, a lone stream computes them on the event loop.
    wire = classic(384, dtype, base=20000.0)
    start, stop = -(2**41) - 1234, -(2**41) + 30_000
    streamed = stub.StreamEncoding(
        pb.StreamEncodingRequest(spec=wire, range=pb.PositionRange(start=start, stop=stop))
    )
    offsets, data = [], []
    for message in streamed:
        offsets.append(message.chunk.row_offset)
        data.append(message.chunk.data)
    assert offsets == sorted(offsets) and len(offsets) > 20
    assert b"".join(data) == engine_range(wire, start, stop).tobytes()


def test_a_repeated_request_is_served_from_the_cache(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    before = info(stub)
    first = b"".join(m.chunk.data for m in stub.StreamEncoding(stream_request(512, 0, 5000)))
    after_first = info(stub)
    second = b"".join(m.chunk.data for m in stub.StreamEncoding(stream_request(512, 0, 5000)))
    after_second = info(stub)
    assert first == second
    assert after_first.cache.misses > before.cache.misses
    assert after_first.rows_computed >= 5000
    # The second request computed nothing: every block was a hit.
    assert after_second.rows_computed == after_first.rows_computed
    assert after_second.cache.misses == after_first.cache.misses
    assert after_second.cache.hits - after_first.cache.hits == after_first.cache.misses
    assert after_second.cache.bytes >= 5000 * 512 * 4


def test_the_cache_key_covers_everything_that_changes_the_bytes(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    variants = [
        classic(64),
        classic(64, base=500.0),
        classic(64, pb.DTYPE_FLOAT64),
        classic(64, layout=pb.LAYOUT_SPLIT),
        classic(64, schedule=pb.SCHEDULE_TENSOR2TENSOR),
        pb.EncodingSpec(whisper=pb.WhisperTable(d_model=64)),
        pb.EncodingSpec(rotary=pb.RotaryTable(head_dim=32)),
    ]
    tables = set()
    for spec in variants:
        message = pb.GetEncodingRequest(spec=spec, range=pb.PositionRange(start=10, stop=20))
        tables.add(stub.GetEncoding(message).tensor.data)
    assert len(tables) == len(variants)
    assert info(stub).cache.entries == len(variants)


def test_server_info_reports_version_limits_and_options(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    response = info(stub)
    assert response.version == "1.0.0"
    assert response.limits.max_d_model == 65536
    assert response.limits.max_abs_position == 2**42
    assert response.limits.max_chunk_bytes == MIB
    assert set(response.dtypes) == {1, 2, 3, 4}
    assert [kind.name for kind in response.table_kinds][:2] == ["sinusoidal", "tensor2tensor"]
    assert response.cache.budget_bytes == 512 * MIB
    assert response.server_id


def test_health_and_reflection_are_served(server: RunningServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "posenc.v1.PositionalEncodingService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"posenc.v1.PositionalEncodingService", "grpc.health.v1.Health"} <= names


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("with_decode_steps", [False, True])
def test_calls_are_answered_between_the_steps_of_a_cold_stream(
    spawn_server: Spawn, with_decode_steps: bool
) -> None:
    """Health checks alone leave a lone stream computing its blocks on the event loop, a
    block a step: each of their turns on the loop waits for a step at most, never for the
    stream. Decode steps send the stream's steps to the pool. Either way, calls are answered
    all along the stream: while any one call waited, the stream moved by a few chunks (a
    step, and what the transport buffers), never by an eighth of its 1,024 chunks. The
    stream's own progress is the measure, not the clock: a loaded machine slows both."""
    process = spawn_server(0)
    spec = classic(4096)
    rows_total = 65536  # 1 GiB in 1,024 chunks of 64 rows: seconds of computing
    with grpc.insecure_channel(process.target) as channel:
        stub = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        step = pb.GetEncodingRequest(spec=spec, positions=pb.PositionList(positions=[7, 70]))
        stub.GetEncoding(step)  # the decode step's block, cached
        # Per-call timeouts only guard against a hang.
        calls: list[Callable[[], object]] = [
            lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=60)
        ]
        if with_decode_steps:
            calls.append(lambda: stub.GetEncoding(step, timeout=60))
        done = threading.Event()
        received = [0]  # the stream's rows received so far

        def stream() -> None:
            try:
                request = pb.StreamEncodingRequest(
                    spec=spec, range=pb.PositionRange(stop=rows_total)
                )
                for message in stub.StreamEncoding(request, timeout=120):
                    received[0] += message.chunk.rows
            finally:
                done.set()

        thread = threading.Thread(target=stream)
        thread.start()
        moved = []  # rows the stream received while each call answered during it waited
        while not done.is_set():
            for call in calls:
                before = received[0]
                call()
                if not done.is_set():
                    moved.append(received[0] - before)
            time.sleep(0.002)
        thread.join()
    assert received[0] == rows_total
    assert len(moved) >= 50
    assert max(moved) <= rows_total // 8, f"a call waited while {max(moved)} rows arrived"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stream_larger_than_the_cache_budget_keeps_server_memory_bounded(
    spawn_server: Spawn,
) -> None:
    budget = 32 * MIB
    process = spawn_server(0, "--cache-bytes", str(budget))
    with grpc.insecure_channel(process.target) as channel:
        stub = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
        stub.GetEncoding(pb.GetEncodingRequest(spec=classic(8), range=pb.PositionRange(stop=1)))
        baseline = peak_rss_mib(process.process.pid)
        rows = 0
        # 1 GiB, 32 times the budget.
        for message in stub.StreamEncoding(stream_request(4096, 0, 65536)):
            rows += message.chunk.rows
        assert rows == 65536
        response = info(stub)
    growth = peak_rss_mib(process.process.pid) - baseline
    assert response.cache.bytes <= budget
    assert response.cache.evictions > 0
    assert growth < budget / MIB + 64, f"server peak RSS grew {growth:.0f} MiB"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_drains_streams_in_flight_and_refuses_new_calls(spawn_server: Spawn) -> None:
    process = spawn_server(0, "--grace-seconds", "20")
    with grpc.insecure_channel(process.target) as channel:
        stub = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        stream = stub.StreamEncoding(stream_request(1024, 0, 16384, chunk=64 * 1024))
        received = [next(stream).chunk.rows]
        finished = threading.Event()

        def consume() -> None:
            for message in stream:
                received.append(message.chunk.rows)
                time.sleep(0.005)  # a slow reader keeps the stream in flight
            finished.set()

        reader = threading.Thread(target=consume)
        reader.start()
        process.terminate()
        deadline = time.monotonic() + 10
        status = health_pb2.HealthCheckResponse.SERVING
        while status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
            status = health.Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING, process.log_lines
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetEncoding(pb.GetEncodingRequest(spec=classic(8), range=pb.PositionRange(stop=1)))
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        reader.join(30)
    assert finished.is_set()
    assert sum(received) == 16384
    assert process.process.wait(30) == 0
    messages = [entry["message"] for entry in process.logs()]
    assert messages[-2:] == ["draining", "stopped"]
    assert process.logs()[-1]["drained"] is True


@pytest.mark.slow
def test_startup_logs_one_line_with_address_version_and_limits(spawn_server: Spawn) -> None:
    process = spawn_server(0, env={"POSENC_MAX_D_MODEL": "1024"})
    startup = [entry for entry in process.logs() if entry["message"] == "listening"]
    assert len(startup) == 1
    assert startup[0]["address"] == process.target
    assert startup[0]["version"] == "1.0.0"
    assert startup[0]["limits"]["max_d_model"] == 1024  # type: ignore[index]


def test_serve_refuses_bad_configuration_with_a_message(spawn_server: Spawn) -> None:
    with pytest.raises(RuntimeError, match="max-chunk-bytes"):
        spawn_server(0, "--max-chunk-bytes", str(64 * MIB))
