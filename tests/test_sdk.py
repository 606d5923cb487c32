"""The blocking SDK against real servers on loopback: results, errors, retries, balancing.

Black-box: results are checked against what the server sends on the wire (read with the
generated stubs, without the SDK), and the server is observed through its own counters.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import ml_dtypes
import numpy as np
import pytest
from conftest import Recorder, ServerProcess, free_port, same_bits, worker_pids
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import REGISTRY

import posenc
from posenc._channel import channel_options
from posenc._retry import map_rpc_error
from posenc.errors import error_class_for_code
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc as pb_grpc
from posenc_server.app import RunningServer


def on_the_wire(
    target: str,
    table: int | posenc.Spec,
    start: int,
    stop: int,
    dtype: str = "float32",
    **classic: Any,
) -> np.ndarray[Any, Any]:
    """The rows the server sends for ``[start, stop)``, read with the generated stubs."""
    spec = (
        posenc.Spec("sinusoidal", d_model=table, **classic) if isinstance(table, int) else table
    ).to_proto()
    spec.dtype = pb.Dtype.Value(f"DTYPE_{dtype.upper()}")
    request = pb.StreamEncodingRequest(spec=spec, range=pb.PositionRange(start=start, stop=stop))
    with grpc.insecure_channel(target) as channel:
        chunks = list(pb_grpc.PositionalEncodingServiceStub(channel).StreamEncoding(request))
    blocks = [
        np.frombuffer(c.chunk.data, dtype=np.dtype(dtype)).reshape(c.chunk.rows, c.chunk.columns)
        for c in chunks
    ]
    return np.concatenate(blocks)


def streams_in_flight() -> float:
    """The in-process servers' ``posenc_streams_in_flight`` gauge."""
    return REGISTRY.get_sample_value("posenc_streams_in_flight") or 0.0


@pytest.fixture
def client(server: RunningServer) -> Iterator[posenc.Client]:
    with posenc.Client(server.target, timeout=30) as c:
        yield c


# -- results ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize(
    ("layout", "schedule"), [("interleaved", "paper"), ("split", "tensor2tensor")]
)
def test_get_range_is_what_the_server_sends(
    client: posenc.Client, server: RunningServer, dtype: str, layout: str, schedule: str
) -> None:
    classic: dict[str, Any] = {"layout": layout, "schedule": schedule, "base": 500.0}
    table = client.get_range(-7, 93, 33, dtype=dtype, **classic)
    assert table.shape == (100, 33)
    assert same_bits(table, on_the_wire(server.target, 33, -7, 93, dtype, **classic))


def test_an_int_table_is_the_classic_spec(client: posenc.Client) -> None:
    spec = posenc.Spec("sinusoidal", d_model=24, layout="split", base=500.0)
    by_int = client.get_range(0, 40, 24, layout="split", base=500.0)
    assert same_bits(by_int, client.get_range(0, 40, spec))
    assert same_bits(by_int[[3, 7]], client.get_positions([3, 7], spec))


@pytest.mark.parametrize(
    "spec",
    [
        posenc.Spec("whisper", d_model=384),
        posenc.Spec("fairseq", d_model=64, padding_idx=1),
        posenc.Spec("tensor2tensor", d_model=33, min_timescale=2.0, start_index=5),
        posenc.Spec("transformer_xl", d_model=32, key_length=64),
        posenc.Spec("rotary", head_dim=64, layout="vllm"),
        posenc.Spec(
            "rotary",
            head_dim=64,
            rope_theta=5e5,
            scaling="yarn",
            factor=4.0,
            original_max_position_embeddings=4096,
        ),
    ],
    ids=repr,
)
def test_every_kind_takes_its_width_from_the_server(
    client: posenc.Client, server: RunningServer, spec: posenc.Spec
) -> None:
    expected = on_the_wire(server.target, spec, 0, 50)
    table = client.get_range(0, 50, spec)
    assert same_bits(table, expected)
    # Later calls know the width: unary, and from the row cache's planning alike.
    assert same_bits(client.get_range(0, 50, spec), expected)
    assert same_bits(client.get_positions([49, 0], spec), expected[[49, 0]])
    pieces = [rows for _, rows in client.iter_range(0, 50, spec, chunk_bytes=4096)]
    assert same_bits(np.concatenate(pieces), expected)


def test_bfloat16_results_are_ml_dtypes(client: posenc.Client) -> None:
    unary = client.get_range(0, 10, 8, dtype="bfloat16")
    assert unary.dtype == np.dtype(ml_dtypes.bfloat16)
    rows = client.get_positions([3, 1 << 40], 8, dtype=ml_dtypes.bfloat16)
    assert rows.dtype == np.dtype(ml_dtypes.bfloat16)
    assert same_bits(rows[0], unary[3])


def test_numpy_dtypes_are_accepted(client: posenc.Client) -> None:
    assert client.get_range(0, 2, 4, dtype=np.float16).dtype == np.float16


def test_unary_and_streaming_give_identical_arrays(server: RunningServer) -> None:
    with (
        posenc.Client(server.target) as unary,
        posenc.Client(server.target, unary_max_bytes=0, chunk_bytes=4096) as streaming,
    ):
        positions = np.random.default_rng(0).integers(-(1 << 42), 1 << 42, 700)
        fetches: list[Callable[[posenc.Client], np.ndarray[Any, Any]]] = [
            lambda c: c.get_range(1000, 3000, 96),
            lambda c: c.get_range(1000, 3000, 96, dtype="bfloat16", layout="split"),
            lambda c: c.get_positions(positions, 96, dtype="float64"),
        ]
        for fetch in fetches:
            fetch(unary)  # the client now knows the width: the next call is unary
            assert same_bits(fetch(unary), fetch(streaming))


def test_large_result_streams_into_one_array(client: posenc.Client, server: RunningServer) -> None:
    # 8 MiB: over the unary limit of the server, so GetEncoding could not serve it.
    for _ in range(2):  # before and after the client knows the width
        table = client.get_range(0, 8192, 256)
        assert table.shape == (8192, 256)
        assert table.flags.c_contiguous and table.flags.owndata
    assert same_bits(table[5000:5010], on_the_wire(server.target, 256, 5000, 5010))


def test_results_are_writable(client: posenc.Client) -> None:
    for table in (client.get_range(0, 4, 8), client.get_range(0, 8192, 256)):
        table[0, 0] = 42.0
        assert table[0, 0] == 42.0


def test_get_positions_order_repeats_and_numpy_input(client: posenc.Client) -> None:
    table = client.get_range(0, 50, 16)
    positions = [7, 3, 7, 49, 0]
    for given in (positions, np.array(positions, dtype=np.uint16), tuple(positions)):
        assert same_bits(client.get_positions(given, 16), table[positions])


def test_empty_range(client: posenc.Client) -> None:
    assert client.get_range(5, 5, 12).shape == (0, 12)
    assert client.get_range(5, 5, posenc.Spec("rotary", head_dim=8, layout="vllm")).shape == (0, 8)
    assert list(client.iter_range(5, 5, 12)) == []


def test_iter_range_yields_ordered_bounded_slices(client: posenc.Client) -> None:
    whole = client.get_range(100, 5100, 64)
    expected_first = 100
    pieces = []
    for first, rows in client.iter_range(100, 5100, 64, chunk_bytes=10_000):
        assert first == expected_first
        assert rows.nbytes <= 10_000
        assert rows.flags.writeable
        expected_first += len(rows)
        pieces.append(rows)
    assert expected_first == 5100
    assert same_bits(np.concatenate(pieces), whole)


def test_iter_positions_yields_indices(client: posenc.Client) -> None:
    positions = np.arange(3000)[::-1] * 11
    whole = client.get_positions(positions, 32)
    seen = 0
    for first, rows in client.iter_positions(positions, 32, chunk_bytes=4096):
        assert first == seen
        assert same_bits(rows, whole[first : first + len(rows)])
        seen += len(rows)
    assert seen == len(positions)


def wait_for_streams(count: float) -> None:
    """Until the servers' streams in flight are ``count`` (a stream left open would stay
    in flight, held by flow control)."""
    deadline = time.monotonic() + 10
    while streams_in_flight() != count:
        assert time.monotonic() < deadline, f"{streams_in_flight()} streams in flight"
        time.sleep(0.01)


def test_abandoned_iterator_cancels_the_stream(client: posenc.Client) -> None:
    before = streams_in_flight()
    iterator = client.iter_range(0, 1 << 20, 256, chunk_bytes=65536)
    first, rows = next(iterator)
    assert (first, rows.shape) == (0, (64, 256))
    wait_for_streams(before + 1)
    iterator.close()  # type: ignore[attr-defined]
    wait_for_streams(before)
    # The channel is still usable.
    assert client.get_range(0, 1, 4).shape == (1, 4)


# -- errors -----------------------------------------------------------------------------


def test_invalid_argument_names_fields(client: posenc.Client) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        client.get_range(0, 10, 10**6, base=0.5)
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    fields = {field.rsplit(".", 1)[-1] for field, _ in error.field_violations}
    assert fields == {"d_model", "base"}
    assert "d_model" in str(error)
    assert isinstance(error, ValueError)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.get_range(5, 3, 8), "range.stop"),
        (lambda c: list(c.iter_range(5, 3, 8)), "range.stop"),
        (lambda c: c.get_range(0, 3, 0), "d_model"),
        (lambda c: c.get_positions([], 8), "positions.positions"),
        (lambda c: c.get_range(0, 3, posenc.Spec("rotary", head_dim=0)), "head_dim"),
    ],
)
def test_values_are_judged_by_the_server(
    client: posenc.Client, call: Callable[[posenc.Client], object], field: str
) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        call(client)
    [(named, description)] = caught.value.field_violations
    assert named.endswith(field)
    assert "must" in description


def test_invalid_positions_from_server(client: posenc.Client) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        client.get_positions([0, 1 << 50], 8)
    [(field, description)] = caught.value.field_violations
    assert field.startswith("positions")
    assert str(1 << 50) in description


ROTARY = posenc.Spec("rotary", head_dim=64)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.get_positions([1.0, 2.0], 8), "positions"),
        (lambda c: c.get_positions(np.arange(0, 1, 0.25), 8), "positions"),
        (lambda c: c.get_positions([True], 8), "positions"),
        (lambda c: c.get_positions([[1, 2], [3]], 8), "positions"),  # ragged
        (lambda c: c.get_positions("12", 8), "positions"),
        (lambda c: c.get_positions([1 << 64], 8), "positions"),
        (lambda c: c.get_range(0.5, 3, 8), "range.start"),
        (lambda c: c.get_range(0, 1 << 63, 8), "range.stop"),
        (lambda c: c.get_range(0, 3, -1), "spec.sinusoidal.d_model"),
        (lambda c: c.get_range(0, 3, 1 << 32), "spec.sinusoidal.d_model"),
        (lambda c: c.get_range(0, 3, 8.0), "spec.table"),
        (lambda c: c.get_range(0, 3, True), "spec.table"),
        (lambda c: c.get_range(0, 3, 8, dtype="int8"), "spec.dtype"),
        (lambda c: c.get_range(0, 3, 8, layout="sideways"), "spec.sinusoidal.layout"),
        (lambda c: c.get_range(0, 3, 8, schedule="t5"), "spec.sinusoidal.schedule"),
        (lambda c: c.get_range(0, 3, 8, base="10"), "spec.sinusoidal.base"),
        (lambda c: c.get_range(0, 3, 8, rope_theta=1.0), "spec.sinusoidal.rope_theta"),
        (lambda c: c.get_range(0, 3, ROTARY, base=2.0), "spec.rotary.base"),
        (lambda c: c.get_positions([1], ROTARY, layout="split"), "spec.rotary.layout"),
        (lambda c: c.iter_range(0, 3, 8, chunk_bytes=0), "max_chunk_bytes"),
    ],
)
def test_client_side_argument_checks(
    client: posenc.Client, call: Callable[[posenc.Client], object], field: str
) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        call(client)
    assert [f for f, _ in caught.value.field_violations] == [field]


@pytest.mark.parametrize(
    ("d_model", "description"),
    [(-5, "must not be negative, got -5"), (1 << 32, "must be at most 4294967295, got 4294967296")],
)
def test_integers_the_wire_cannot_carry_name_only_the_bound_they_cross(
    client: posenc.Client, d_model: int, description: str
) -> None:
    # The SDK checks only what the wire type carries: naming its whole range ("between 0
    # and 4294967295") read as if 0 were accepted, which the server refuses.
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        client.get_range(0, 3, d_model)
    assert caught.value.field_violations == [("spec.sinusoidal.d_model", description)]


def test_chunk_smaller_than_a_row_is_refused_by_the_server(client: posenc.Client) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        list(client.iter_range(0, 10, 64, chunk_bytes=100))
    assert caught.value.field_violations[0][0] == "max_chunk_bytes"


def test_resource_exhausted(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory(max_stream_bytes=1 << 20)
    with posenc.Client(server.target) as client, pytest.raises(posenc.ResourceExhaustedError):
        client.get_range(0, 4096, 512)


def test_iterators_split_what_is_over_the_stream_limit(
    server_factory: Callable[..., RunningServer], client: posenc.Client
) -> None:
    # 8 MiB through a server whose streams stop at 1 MiB: the iterator asks for the rest in
    # smaller streams, and every row arrives once, in order, exact.
    limited = server_factory(max_stream_bytes=1 << 20)
    expected = client.get_range(-100, 4000, 512)
    with posenc.Client(limited.target) as small:
        slices = list(small.iter_range(-100, 4000, 512))
        positions = np.arange(-100, 4000)[::-1]
        by_list = list(small.iter_positions(positions, 512))
    assert [first for first, _ in slices] == sorted({first for first, _ in slices})
    assert same_bits(np.concatenate([rows for _, rows in slices]), expected)
    assert same_bits(np.concatenate([rows for _, rows in by_list]), expected[::-1])


def test_over_the_stream_limit_fails_before_allocating(client: posenc.Client) -> None:
    # 16 PiB: refused by the server, not a MemoryError from preallocating the result.
    with pytest.raises(posenc.ResourceExhaustedError, match="stream limit"):
        client.get_range(0, 1 << 40, 4096)


def test_unary_refusal_falls_back_to_streaming(
    server_factory: Callable[..., RunningServer],
) -> None:
    # The server's unary limit (16 KiB) is far below the client's 1 MiB threshold.
    server = server_factory(max_unary_bytes=16 << 10)
    with posenc.Client(server.target) as client:
        first = client.get_range(0, 1000, 64)  # unary, refused, then streamed
        again = client.get_range(0, 1000, 64)  # the same, with the width known
    assert same_bits(first, again)
    assert same_bits(again, on_the_wire(server.target, 64, 0, 1000))


def served_ok() -> float:
    """The encoding calls the in-process servers answered OK."""
    return sum(
        REGISTRY.get_sample_value("posenc_requests_total", {"method": method, "code": "OK"}) or 0.0
        for method in ("GetEncoding", "StreamEncoding")
    )


def test_timeout_raises_deadline_exceeded(
    client: posenc.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The timeout ends the call: DEADLINE_EXCEEDED, which is not retried (it would fail
    the same way, later), and the server sent no table for it."""
    caplog.set_level(logging.INFO, logger="posenc")
    before = served_ok()
    with pytest.raises(posenc.DeadlineExceededError) as caught:
        client.get_range(0, 1 << 20, 256, timeout=1e-4)
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "attempts" not in caught.value.details
    assert not any("retrying" in record.message for record in caplog.records)
    assert served_ok() == before


def test_per_call_timeout_overrides_the_default(server: RunningServer) -> None:
    with posenc.Client(server.target, timeout=1e-4) as client:
        with pytest.raises(posenc.DeadlineExceededError):
            client.get_range(0, 1 << 18, 256)
        assert client.get_range(0, 1 << 18, 256, timeout=60).shape == (1 << 18, 256)
        assert client.get_range(0, 10, 8, timeout=None).shape == (10, 8)


def aio_error(
    code: grpc.StatusCode, details: str, status: status_pb2.Status | None = None
) -> grpc.aio.AioRpcError:
    """A failed call as gRPC reports it, with a rich status in its trailer when given."""
    trailer = grpc.aio.Metadata()
    if status is not None:
        trailer = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailer, details, None)


def test_field_violations_survive_a_mismatched_rich_status() -> None:
    # grpc_status.from_call refuses a rich status whose message differs from the call's;
    # the SDK still reads the violations from the grpc-status-details-bin trailer.
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field="f", description="d")
            ]
        )
    )
    status = status_pb2.Status(code=3, message="other words", details=[detail])
    mapped = map_rpc_error(aio_error(grpc.StatusCode.INVALID_ARGUMENT, "bad", status))
    assert isinstance(mapped, posenc.InvalidArgumentError)
    assert (mapped.details, mapped.field_violations) == ("bad", [("f", "d")])


DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT: posenc.InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: posenc.ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: posenc.UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: posenc.DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: posenc.UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: posenc.PermissionDeniedError,
    grpc.StatusCode.CANCELLED: posenc.CancelledError,
    grpc.StatusCode.NOT_FOUND: posenc.NotFoundError,
    grpc.StatusCode.UNIMPLEMENTED: posenc.UnimplementedError,
    grpc.StatusCode.INTERNAL: posenc.InternalError,
    grpc.StatusCode.DATA_LOSS: posenc.InternalError,
}


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK])
def test_every_status_code_maps_to_its_documented_error(code: grpc.StatusCode) -> None:
    mapped = map_rpc_error(aio_error(code, "boom"))
    assert type(mapped) is DOCUMENTED.get(code, posenc.PosencError)
    assert error_class_for_code(code) is type(mapped)
    assert (mapped.code, mapped.details) == (code, "boom")


# -- service ----------------------------------------------------------------------------


def test_server_info(client: posenc.Client) -> None:
    client.get_range(0, 10, 8)
    info = client.server_info()
    assert isinstance(info, posenc.ServerInfo)
    assert info.version
    assert info.server_id
    assert isinstance(info.limits, posenc.Limits) and info.limits.max_d_model == 65536
    assert info.limits.max_unary_bytes <= 4 << 20
    assert set(info.dtypes) == set(posenc.DTYPE_NAMES)
    assert isinstance(info.cache, posenc.CacheStats)
    assert info.rows_computed > 0
    assert info.cache.misses > 0
    kinds = {kind.name: kind for kind in info.table_kinds}
    assert isinstance(kinds["whisper"], posenc.TableKind)
    for parameter in kinds["whisper"].parameters:
        assert isinstance(parameter, posenc.TableParameter)
    assert info.to_dict()["limits"]["max_positions"] == info.limits.max_positions


def test_health(client: posenc.Client, server: RunningServer) -> None:
    assert client.health() == "SERVING"
    assert client.health("posenc.v1.PositionalEncodingService") == "SERVING"
    assert client.health("no.such.Service") == "SERVICE_UNKNOWN"
    server.not_serving()
    assert client.health() == "NOT_SERVING"


def test_health_of_nothing_raises_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    """A probe reports what it sees now: it is never retried, whatever the client's
    retries (the timeout, generous, only guards against a hang)."""
    caplog.set_level(logging.INFO, logger="posenc")
    client = posenc.Client(f"127.0.0.1:{free_port()}", max_retries=5)
    with client, pytest.raises(posenc.UnavailableError) as caught:
        client.health(timeout=30)
    assert "attempts" not in caught.value.details
    assert not any("retrying" in record.message for record in caplog.records)


# -- retries and balancing ---------------------------------------------------------------


@pytest.mark.slow
def test_retries_exhausted_raise_unavailable(spawn_server: Callable[..., ServerProcess]) -> None:
    server = spawn_server()
    with posenc.Client(server.target, max_retries=2, retry_backoff=0.01) as client:
        client.get_range(0, 10, 8)  # it answered: a refusal now is worth retrying
        server.kill()
        server.process.wait(30)
        with pytest.raises(posenc.UnavailableError) as caught:
            client.get_range(0, 10, 8)
    assert isinstance(caught.value, ConnectionError)
    assert "after 3 attempts" in caught.value.details


@pytest.mark.timeout(60)
def test_no_server_at_the_target_is_said_after_the_retry_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="posenc")
    port = free_port()
    for target in (f"127.0.0.1:{port}", [f"127.0.0.1:{port}", f"localhost:{port}"]):
        with (
            posenc.Client(target, max_retries=2, retry_backoff=0.01) as client,
            pytest.raises(posenc.UnavailableError) as raised,
        ):
            client.get_range(0, 10, 8)
        message = str(raised.value)
        assert f"no posenc server at {client.target}" in message
        assert "(connection refused): is it running?" in message
        assert message.endswith("(after 3 attempts)")
    # A new client retries a refused connection as an established one does: its server may
    # be restarting.
    assert sum("retrying" in record.message for record in caplog.records) == 4


@pytest.mark.slow  # starts a server twice
@pytest.mark.timeout(120)
def test_a_new_client_waits_for_a_server_restarting_during_its_first_call(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    port = free_port()
    spawn_server(port).kill()  # the server is gone when the client's first call begins
    retried = threading.Event()

    class Retries(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("retrying"):
                retried.set()

    handler = Retries()
    logger = logging.getLogger("posenc")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        # A budget of about 20 s: a server start takes 1-3 s, more on a loaded machine.
        with (
            posenc.Client(f"127.0.0.1:{port}", max_retries=15) as client,
            ThreadPoolExecutor(1) as pool,
        ):
            call = pool.submit(client.get_range, 0, 100, 16)
            while not retried.wait(0.05):
                if call.done():
                    call.result()  # raises: the first call gave up without retrying
                    raise AssertionError("the first call returned without a server")
            spawn_server(port)  # the restart, while the new client's first call retries
            table = call.result(timeout=60)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert same_bits(table, on_the_wire(f"127.0.0.1:{port}", 16, 0, 100))


@pytest.mark.timeout(60)
def test_a_target_whose_name_does_not_resolve_is_said_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="posenc")
    # .invalid never resolves (a reserved name).
    with (
        posenc.Client("posenc.invalid:50051") as client,
        pytest.raises(posenc.UnavailableError) as raised,
    ):
        client.get_range(0, 10, 8)
    assert "no posenc server at posenc.invalid:50051: its name does not resolve" in str(
        raised.value
    )
    assert not any("retrying" in record.message for record in caplog.records)


@pytest.mark.slow
def test_retry_waits_for_a_server_that_answered_before(
    spawn_server: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="posenc")
    port = free_port()
    first = spawn_server(port)
    # A budget of about 20 s: a server start takes 1-3 s, more on a loaded machine.
    with posenc.Client(f"127.0.0.1:{port}", max_retries=15) as client:
        client.get_range(0, 10, 8)
        first.process.terminate()
        first.process.wait(30)
        # The restart begins once the server is gone: the next call's first attempts fail.
        restarter = threading.Thread(target=spawn_server, args=(port,))
        restarter.start()
        try:
            table = client.get_range(0, 100, 16)
        finally:
            restarter.join()
    assert same_bits(table, on_the_wire(f"127.0.0.1:{port}", 16, 0, 100))
    assert any("retrying" in record.message for record in caplog.records)


def test_round_robin_over_two_servers(server_factory: Callable[..., RunningServer]) -> None:
    first, second = server_factory(), server_factory()
    # Hostnames are resolved by the client and balanced over with gRPC's round_robin.
    targets = [first.target, f"localhost:{second.port}"]
    with posenc.Client(targets) as client:
        assert client.target == f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
        for i in range(40):
            client.get_range(i * 10_000, i * 10_000 + 10, 8)
        # Round robin takes turns among the connections that are ready: one reconnecting (a
        # busy machine, a connection's age) leaves the other its turns for a while.
        server_ids: set[str] = set()
        for _ in range(200):
            server_ids.add(client.server_info().server_id)
            if len(server_ids) == 2:
                break
    direct_ids = set()
    for server in (first, second):
        with posenc.Client(server.target) as direct:
            info = direct.server_info()
        assert info.rows_computed > 0
        assert info.cache.misses > 0
        direct_ids.add(info.server_id)
    # Round robin: the calls reach both servers.
    assert server_ids == direct_ids and len(direct_ids) == 2


@pytest.mark.slow  # starts a server of two processes
@pytest.mark.timeout(120)
def test_one_client_reaches_every_process(spawn_server: Callable[..., ServerProcess]) -> None:
    process = spawn_server(0, "--processes", "2")
    # The kernel gives each connection to one of the two processes at random: 16 connections
    # all to one of them has probability 2**-15.
    with posenc.Client(process.target, connections=16) as client:
        # Turns go round the connections: 32 calls use each connection twice.
        server_ids = {client.server_info().server_id for _ in range(32)}
        table = client.get_range(0, 100, 16)
    assert len(server_ids) == 2
    with posenc.Client(process.target, connections=1) as single:
        # One connection, one process.
        assert len({single.server_info().server_id for _ in range(8)}) == 1
        assert same_bits(single.get_range(0, 100, 16), table)


@pytest.mark.slow  # starts servers of two processes and of one
@pytest.mark.timeout(180)
def test_a_range_in_parts_survives_a_worker_killed_mid_stream(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    """A worker killed while it streams its part of a range: that part resumes (on another
    connection, so another process or the worker's replacement) and the table is exact."""
    process = spawn_server(0, "--processes", "2")
    workers = worker_pids(process.process.pid)
    rows, width = 1 << 18, 256  # 256 MiB in 64 KiB chunks
    with (
        posenc.Client(process.target, connections=16, chunk_bytes=64 << 10, timeout=120) as client,
        posenc.Client(process.target, timeout=10) as watcher,
        ThreadPoolExecutor(1) as executor,
    ):
        fetch = executor.submit(client.get_range, 10**6, 10**6 + rows, width)
        deadline = time.monotonic() + 60
        while watcher.server_info().rows_computed < rows // 4:
            assert time.monotonic() < deadline and not fetch.done()
            time.sleep(0.02)
        os.kill(workers[0], signal.SIGKILL)
        table = fetch.result(timeout=120)
    with posenc.Client(spawn_server(0).target, connections=1, timeout=120) as one:
        assert same_bits(table, one.get_range(10**6, 10**6 + rows, width))


@pytest.mark.slow  # starts a server of two processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rows", [256, 8192, 1 << 15], ids=["unary", "stream", "large-stream"])
def test_a_range_asked_again_is_served_from_the_cache_it_filled(
    spawn_server: Callable[..., ServerProcess], rows: int
) -> None:
    """Each server process caches its own blocks: the client sends a range it asks for
    again over the connection it went over, so to the process that cached it (with 16
    connections over 2 processes, eight calls spread round robin would all reach the
    same process with probability 2**-8)."""
    process = spawn_server(0, "--processes", "2")
    with posenc.Client(process.target, connections=16) as client:
        first = client.get_range(1_000_000, 1_000_000 + rows, 1024)
        computed = settled_rows_computed(client)
        assert computed >= rows
        for _ in range(8):
            assert same_bits(client.get_range(1_000_000, 1_000_000 + rows, 1024), first)
        assert settled_rows_computed(client) == computed  # no row computed again


def settled_rows_computed(client: posenc.Client) -> int:
    """The server's rows computed, once its processes have all published their counters
    (each publishes five times a second)."""
    last = client.server_info().rows_computed
    while True:
        time.sleep(0.5)
        now = client.server_info().rows_computed
        if now == last:
            return now
        last = now


@pytest.mark.parametrize("connections", [0, 65, 1.5])
def test_connections_must_be_a_small_positive_int(connections: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        posenc.Client("127.0.0.1:1", connections=connections)  # type: ignore[arg-type]


# -- targets and channels ---------------------------------------------------------------------


def target_of(target: str | list[str]) -> str:
    """The gRPC target a client makes of ``target`` (creating a client does not connect)."""
    with posenc.Client(target) as client:
        return client.target


def test_one_target_rule_for_one_target_and_for_lists() -> None:
    assert target_of("example.com:1") == "example.com:1"
    assert target_of("dns:///example.com:1") == "dns:///example.com:1"
    # No port means the default port, 50051, alone or in a list.
    assert target_of("127.0.0.1") == "127.0.0.1:50051"
    assert target_of("::1") == target_of("[::1]") == "[::1]:50051"
    assert target_of(["10.0.0.1", "10.0.0.2:2"]) == "ipv4:10.0.0.1:50051,10.0.0.2:2"
    assert target_of(["[::1]:1", "[fe80::2]:2"]) == "ipv6:[::1]:1,[fe80::2]:2"
    mapped = ipaddress.IPv6Address("::ffff:10.0.0.1")  # spelled differently across Pythons
    assert target_of(["[::1]:1", "10.0.0.1:2"]) == f"ipv6:[::1]:1,[{mapped}]:2"
    for bad in ([], ["a:1", "dns:///b:2"], ["a:x", "b:1"], "a:0", "a:", "a:99999", ":1"):
        with pytest.raises(ValueError):
            target_of(bad)
    # A URL is refused at once, saying what a target is, instead of failing to resolve.
    for url in ("http://127.0.0.1:50051", ["https://a:1", "b:2"]):
        with pytest.raises(ValueError, match="is a URL: give host:port"):
            target_of(url)
    with pytest.raises(ValueError, match="cannot resolve"):
        target_of(["no-such-host.invalid:1", "127.0.0.1:2"])


def test_user_options_override_the_sdk_defaults() -> None:
    options = dict(channel_options([("grpc.lb_policy_name", "pick_first")], "ua"))
    assert options["grpc.lb_policy_name"] == "pick_first"
    assert options["grpc.max_receive_message_length"] >= 8 << 20


def test_interceptors_see_every_call_and_the_token_travels_as_call_credentials(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0k3n")
    server = server_factory(auth_token_file=str(token_file))
    recorder = Recorder()
    local = grpc.local_channel_credentials()
    # One connection: a large range goes in one stream (over several, in parts).
    with posenc.Client(
        server.target, token="t0k3n", credentials=local, interceptors=[recorder], connections=1
    ) as client:
        client.get_range(0, 10, 8)
        client.get_range(0, 1 << 20, 8)  # 32 MiB: streamed
        client.server_info()
        client.health()
    methods = [method.rsplit("/", 1)[-1] for method, _, _ in recorder.calls]
    assert methods == ["GetEncoding", "StreamEncoding", "GetServerInfo", "Check"]
    # gRPC adds the token below the interceptors, only on channels that protect it.
    assert not any("authorization" in metadata for _, metadata, _ in recorder.calls)


def test_context_manager_closes_the_channel(server: RunningServer) -> None:
    with posenc.Client(server.target) as client:
        client.get_range(0, 1, 4)
    with pytest.raises(posenc.ClientClosedError, match="closed"):
        client.get_range(0, 1, 4)


def test_a_closed_client_raises_a_posenc_error(server: RunningServer) -> None:
    client = posenc.Client(server.target)
    client.get_range(0, 1, 4)
    client.close()
    for call in (
        lambda: client.get_range(0, 1, 4),
        lambda: client.get_positions([1], 4),
        lambda: list(client.iter_range(0, 1, 4)),
        client.server_info,
        client.health,
    ):
        with pytest.raises(posenc.ClientClosedError, match="the client is closed"):
            call()


# More coordinate rows than one request carries (65,536 positions): the list travels in parts
# split by rows, each row keeping its axes together.
MROPE = posenc.Spec("mrope", head_dim=16, mrope_section=[2, 3, 3])


def mrope_coordinates(rows: int) -> np.ndarray[Any, Any]:
    """``rows`` distinct (t, h, w) coordinates."""
    index = np.arange(rows, dtype=np.int64)
    return np.stack([index, index // 7, -(index // 13)], axis=1)


def test_more_coordinate_rows_than_one_request_carries(client: posenc.Client) -> None:
    coordinates = mrope_coordinates(70_000)
    table = client.get_positions(coordinates, MROPE)
    assert table.shape == (70_000, 32)  # cos and sin
    # Each row is its own coordinates' row, also across the parts' borders.
    for rows in (slice(0, 5), slice(21_840, 21_850), slice(65_530, 65_540), slice(69_990, None)):
        assert same_bits(table[rows], client.get_positions(coordinates[rows], MROPE))
    streamed = np.concatenate([rows for _, rows in client.iter_positions(coordinates, MROPE)])
    assert same_bits(streamed, table)


@pytest.mark.slow  # starts a server of two processes
@pytest.mark.timeout(180)
def test_a_range_over_the_stream_limit_is_refused_whatever_the_process_count(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    """16 MiB against a stream limit of 12 MiB: refused by one stream, and by a client that
    would fetch it in parts (each under the limit) from a server of two processes."""
    server = spawn_server(0, "--processes", "2", "--max-stream-bytes", str(12 << 20))
    assert len(worker_pids(server.process.pid)) == 2
    rows, table = 1 << 16, 64  # 256 bytes a row
    for connections in (1, 16):
        with posenc.Client(server.target, connections=connections) as client:
            with pytest.raises(posenc.ResourceExhaustedError, match="stream limit"):
                client.get_range(0, rows, table)
            # The width is known now: refused before any call.
            with pytest.raises(posenc.ResourceExhaustedError, match="stream limit"):
                client.get_range(0, rows, table)
            # Under the limit, the parts are fetched; an iterator goes past it in pieces.
            assert client.get_range(0, rows // 2, table).shape == (rows // 2, table)
            assert sum(len(part) for _, part in client.iter_range(0, rows, table)) == rows

    async def fetch() -> None:
        async with posenc.AsyncClient(server.target, connections=16) as client:
            with pytest.raises(posenc.ResourceExhaustedError, match="stream limit"):
                await client.get_range(0, rows, table)

    asyncio.run(fetch())


@pytest.mark.timeout(120)
def test_a_range_larger_than_memory_is_refused_before_it_is_allocated(
    server_factory: Callable[..., RunningServer],
) -> None:
    server = server_factory(max_stream_bytes=1 << 50)
    spec = posenc.Spec("sinusoidal", d_model=65536)
    rows = (posenc_memory_limit() // (65536 * 8)) + 1  # float64 rows: one over the memory
    with posenc.Client(server.target, connections=1) as client:
        with pytest.raises(posenc.ResourceExhaustedError, match="more than this machine"):
            client.get_range(0, rows, spec, dtype="float64")
        # Known width: refused before any call.
        with pytest.raises(posenc.ResourceExhaustedError, match="more than this machine"):
            client.get_range(0, rows, spec, dtype="float64")


def posenc_memory_limit() -> int:
    """This machine's memory, as /proc/meminfo says (or the control group's limit)."""
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal"))
    try:
        with open("/sys/fs/cgroup/memory.max") as limit:
            return min(total, int(limit.read()))
    except (OSError, ValueError):
        return total


def test_an_iterator_made_before_close_raises_client_closed(server: RunningServer) -> None:
    client = posenc.Client(server.target)
    client.get_range(0, 1, 4)
    slices = client.iter_range(0, 10, 4)
    client.close()
    with pytest.raises(posenc.ClientClosedError, match="the client is closed"):
        list(slices)
