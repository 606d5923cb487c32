"""The blocking SDK against real servers on loopback: results, errors, retries, balancing."""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import grpc.aio
import ml_dtypes
import numpy as np
import pytest
from conftest import ServerProcess, free_port, same_bits
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

import posenc
from posenc import _protocol as proto
from posenc.errors import error_class_for_code
from posenc_server import engine
from posenc_server.app import RunningServer


def reference(start: int, stop: int, d_model: int, **options: Any) -> np.ndarray[Any, Any]:
    """The server engine's table, computed in this process."""
    spec = engine.EncodingSpec(
        d_model=d_model,
        base=options.get("base", 10000.0),
        dtype=options.get("dtype", "float32"),
        layout=engine.Layout(options.get("layout", "interleaved")),
        schedule=engine.Schedule(options.get("schedule", "paper")),
    )
    return engine.encode_range(spec, start, stop)


@pytest.fixture
def client(server: RunningServer) -> Iterator[posenc.Client]:
    with posenc.Client(server.target, timeout=30) as c:
        yield c


# -- results ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize(
    ("layout", "schedule"), [("interleaved", "paper"), ("split", "tensor2tensor")]
)
def test_get_range_matches_engine(
    client: posenc.Client, dtype: str, layout: str, schedule: str
) -> None:
    options: dict[str, Any] = {
        "dtype": dtype,
        "layout": layout,
        "schedule": schedule,
        "base": 500.0,
    }
    table = client.get_range(-7, 93, 33, **options)
    assert table.shape == (100, 33)
    assert same_bits(table, reference(-7, 93, 33, **options))


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
            assert same_bits(fetch(unary), fetch(streaming))


def test_large_result_streams_into_one_array(client: posenc.Client) -> None:
    # 8 MiB: over the unary limit of the server, so GetEncoding could not serve it.
    table = client.get_range(0, 8192, 256)
    assert table.shape == (8192, 256)
    assert table.flags.c_contiguous and table.flags.owndata
    assert same_bits(table[5000:5010], reference(5000, 5010, 256))


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


def wait_until_idle(server: RunningServer) -> None:
    """Until the server has no call in flight (a stream left open would stay in flight,
    held by flow control)."""
    deadline = time.monotonic() + 10
    while server.servicer._in_flight:
        assert time.monotonic() < deadline, "the server still serves the abandoned stream"
        time.sleep(0.01)


def test_abandoned_iterator_cancels_the_stream(
    client: posenc.Client, server: RunningServer
) -> None:
    iterator = client.iter_range(0, 1 << 20, 256, chunk_bytes=65536)
    first, rows = next(iterator)
    assert (first, rows.shape) == (0, (64, 256))
    assert server.servicer._in_flight == 1
    iterator.close()  # type: ignore[attr-defined]
    wait_until_idle(server)
    # The channel is still usable.
    assert client.get_range(0, 1, 4).shape == (1, 4)


# -- errors -----------------------------------------------------------------------------


def test_invalid_argument_names_fields(client: posenc.Client) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        client.get_range(0, 10, 10**6, base=0.5)
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    fields = dict(error.field_violations)
    assert set(fields) == {"spec.d_model", "spec.base"}
    assert "spec.d_model" in str(error)
    assert isinstance(error, ValueError)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.get_range(5, 3, 8), "range.stop"),
        (lambda c: list(c.iter_range(5, 3, 8)), "range.stop"),
        (lambda c: c.get_range(0, 3, 0), "spec.d_model"),
        (lambda c: c.get_positions([], 8), "positions.positions"),
    ],
)
def test_values_are_judged_by_the_server(
    client: posenc.Client, call: Callable[[posenc.Client], object], field: str
) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        call(client)
    assert [f for f, _ in caught.value.field_violations] == [field]
    assert "must" in caught.value.field_violations[0][1]


def test_invalid_positions_from_server(client: posenc.Client) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        client.get_positions([0, 1 << 50], 8)
    [(field, description)] = caught.value.field_violations
    assert field.startswith("positions")
    assert str(1 << 50) in description


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.get_positions([1.0, 2.0], 8), "positions"),
        (lambda c: c.get_positions(np.arange(0, 1, 0.25), 8), "positions"),
        (lambda c: c.get_positions([True], 8), "positions"),
        (lambda c: c.get_positions([[1, 2]], 8), "positions"),
        (lambda c: c.get_positions("12", 8), "positions"),
        (lambda c: c.get_positions([1 << 64], 8), "positions"),
        (lambda c: c.get_range(0.5, 3, 8), "range.start"),
        (lambda c: c.get_range(0, 1 << 63, 8), "range.stop"),
        (lambda c: c.get_range(0, 3, -1), "spec.d_model"),
        (lambda c: c.get_range(0, 3, 1 << 32), "spec.d_model"),
        (lambda c: c.get_range(0, 3, 8, dtype="int8"), "spec.dtype"),
        (lambda c: c.get_range(0, 3, 8, layout="sideways"), "spec.layout"),
        (lambda c: c.get_range(0, 3, 8, schedule="t5"), "spec.schedule"),
        (lambda c: c.get_range(0, 3, 8, base="10"), "spec.base"),
        (lambda c: c.iter_range(0, 3, 8, chunk_bytes=0), "max_chunk_bytes"),
    ],
)
def test_client_side_argument_checks(
    client: posenc.Client, call: Callable[[posenc.Client], object], field: str
) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        call(client)
    assert [f for f, _ in caught.value.field_violations] == [field]


def test_chunk_smaller_than_a_row_is_refused_by_the_server(client: posenc.Client) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as caught:
        list(client.iter_range(0, 10, 64, chunk_bytes=100))
    assert caught.value.field_violations[0][0] == "max_chunk_bytes"


def test_resource_exhausted(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory(max_stream_bytes=1 << 20)
    with posenc.Client(server.target) as client, pytest.raises(posenc.ResourceExhaustedError):
        client.get_range(0, 4096, 512)


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
        table = client.get_range(0, 1000, 64)
    assert same_bits(table, reference(0, 1000, 64))


def test_timeout_raises_deadline_exceeded(client: posenc.Client) -> None:
    started = time.monotonic()
    with pytest.raises(posenc.DeadlineExceededError) as caught:
        client.get_range(0, 1 << 20, 256, timeout=1e-4)
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5


def test_per_call_timeout_overrides_the_default(server: RunningServer) -> None:
    with posenc.Client(server.target, timeout=1e-4) as client:
        with pytest.raises(posenc.DeadlineExceededError):
            client.get_range(0, 1 << 18, 256)
        assert client.get_range(0, 1 << 18, 256, timeout=60).shape == (1 << 18, 256)
        assert client.get_range(0, 10, 8, timeout=None).shape == (10, 8)


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
    trailer = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), trailer, "bad", None
    )
    mapped = proto.map_rpc_error(error)
    assert isinstance(mapped, posenc.InvalidArgumentError)
    assert (mapped.details, mapped.field_violations) == ("bad", [("f", "d")])


def test_every_status_code_maps_to_a_posenc_error() -> None:
    assert error_class_for_code(grpc.StatusCode.UNAVAILABLE) is posenc.UnavailableError
    assert error_class_for_code(grpc.StatusCode.UNAUTHENTICATED) is posenc.UnauthenticatedError
    assert error_class_for_code(grpc.StatusCode.PERMISSION_DENIED) is posenc.PermissionDeniedError
    assert error_class_for_code(grpc.StatusCode.CANCELLED) is posenc.CancelledError
    assert error_class_for_code(grpc.StatusCode.INTERNAL) is posenc.InternalError
    for code in grpc.StatusCode:
        if code is not grpc.StatusCode.OK:
            error = error_class_for_code(code)("boom", code=code)
            assert isinstance(error, posenc.PosencError)
            assert error.code is code and error.details == "boom"


# -- service ----------------------------------------------------------------------------


def test_server_info(client: posenc.Client) -> None:
    client.get_range(0, 10, 8)
    info = client.server_info()
    assert info.version
    assert info.server_id
    assert info.limits.max_d_model == 65536
    assert info.limits.max_unary_bytes <= 4 << 20
    assert set(info.dtypes) == set(posenc.DTYPE_NAMES)
    assert set(info.layouts) == set(posenc.LAYOUT_NAMES)
    assert set(info.schedules) == set(posenc.SCHEDULE_NAMES)
    assert info.rows_computed > 0
    assert info.cache.misses > 0
    assert info.to_dict()["limits"]["max_positions"] == info.limits.max_positions


def test_health(client: posenc.Client, server: RunningServer) -> None:
    assert client.health() == "SERVING"
    assert client.health("posenc.v1.PositionalEncodingService") == "SERVING"
    assert client.health("no.such.Service") == "SERVICE_UNKNOWN"
    server.health.enter_graceful_shutdown()
    assert client.health() == "NOT_SERVING"


def test_health_of_nothing_raises_unavailable() -> None:
    with posenc.Client(f"127.0.0.1:{free_port()}") as client:
        started = time.monotonic()
        with pytest.raises(posenc.UnavailableError):
            client.health(timeout=5)
        assert time.monotonic() - started < 4  # a probe does not retry


# -- retries and balancing ---------------------------------------------------------------


def test_retries_exhausted_raise_unavailable() -> None:
    target = f"127.0.0.1:{free_port()}"
    with (
        posenc.Client(target, max_retries=2, retry_backoff=0.01) as client,
        pytest.raises(posenc.UnavailableError) as caught,
    ):
        client.get_range(0, 10, 8)
    assert isinstance(caught.value, ConnectionError)
    assert "after 3 attempts" in caught.value.details


@pytest.mark.timeout(60)
def test_retry_waits_for_a_server_that_is_starting(
    spawn_server: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="posenc")
    port = free_port()
    # The client is created and called before the server exists: the default retry
    # budget (about 5 s) covers a server start.
    client = posenc.Client(f"127.0.0.1:{port}")
    starter = threading.Thread(target=spawn_server, args=(port,))
    starter.start()
    try:
        table = client.get_range(0, 100, 16)
    finally:
        starter.join()
        client.close()
    assert same_bits(table, reference(0, 100, 16))
    assert any("retrying" in record.message for record in caplog.records)


def test_round_robin_over_two_servers(server_factory: Callable[..., RunningServer]) -> None:
    first, second = server_factory(), server_factory()
    # Hostnames are resolved by the client and balanced over with gRPC's round_robin.
    targets = [first.target, f"localhost:{second.port}"]
    with posenc.Client(targets) as client:
        assert client.target == f"ipv4:127.0.0.1:{first.port},127.0.0.1:{second.port}"
        for i in range(40):
            client.get_range(i * 10_000, i * 10_000 + 10, 8)
        server_ids = {client.server_info().server_id for _ in range(6)}
    for server in (first, second):
        with posenc.Client(server.target) as direct:
            info = direct.server_info()
        assert info.rows_computed > 0
        assert info.cache.misses > 0
    # Round robin: six calls reach both servers.
    assert server_ids == {first.servicer.service.server_id, second.servicer.service.server_id}


# -- targets ----------------------------------------------------------------------------


def test_channel_targets() -> None:
    assert proto.channel_target("example.com:1") == "example.com:1"
    assert proto.channel_target("dns:///example.com:1") == "dns:///example.com:1"
    assert proto.channel_target(["10.0.0.1:1", "10.0.0.2:2"]) == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert proto.channel_target(["[::1]:1", "[fe80::2]:2"]) == "ipv6:[::1]:1,[fe80::2]:2"
    mapped = ipaddress.IPv6Address("::ffff:10.0.0.1")  # spelled differently across Pythons
    assert proto.channel_target(["[::1]:1", "10.0.0.1:2"]) == f"ipv6:[::1]:1,[{mapped}]:2"
    for bad in ([], ["a:1", "dns:///b:2"], ["nocolon", "a:1"], ["a:x", "b:1"]):
        with pytest.raises(ValueError):
            proto.channel_target(bad)
    with pytest.raises(ValueError, match="cannot resolve"):
        proto.channel_target(["no-such-host.invalid:1", "127.0.0.1:2"])


def test_user_options_override_the_sdk_defaults() -> None:
    options = dict(proto.channel_options([("grpc.lb_policy_name", "pick_first")], "ua"))
    assert options["grpc.lb_policy_name"] == "pick_first"
    assert options["grpc.max_receive_message_length"] >= 8 << 20


def test_context_manager_closes_the_channel(server: RunningServer) -> None:
    with posenc.Client(server.target) as client:
        client.get_range(0, 1, 4)
    with pytest.raises(ValueError, match="closed"):
        client.get_range(0, 1, 4)
