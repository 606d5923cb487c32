"""posenc.testing.MockTransport: the real clients, answered by a handler, without a server."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest

import posenc
from posenc.testing import MockTransport, Request, Status, positions

WIDTH = 6


def rows_of(request: Request) -> npt.NDArray[np.float64]:
    """Row p is p + column / 8: every row says which position it is."""
    selected = positions(request).astype(np.float64)
    return selected[:, None] + np.arange(WIDTH) / 8


def expected(selected: Any) -> npt.NDArray[np.float32]:
    return (np.asarray(selected, np.float64)[:, None] + np.arange(WIDTH) / 8).astype(np.float32)


def test_small_and_large_ranges_and_positions_come_from_the_handler() -> None:
    transport = MockTransport(rows_of)
    with posenc.Client(transport=transport) as client:
        np.testing.assert_array_equal(client.get_range(5, 9, WIDTH), expected(range(5, 9)))
        many = client.get_range(0, 300_000, WIDTH)  # 7 MiB: a stream, in chunks
        np.testing.assert_array_equal(many, expected(range(300_000)))
        np.testing.assert_array_equal(
            client.get_positions([[7, 1 << 40]], WIDTH), expected([7, 1 << 40])[None]
        )
        slices = list(client.iter_range(0, 300_000, WIDTH, chunk_bytes=1 << 16))
    assert len(slices) > 1 and [first for first, _ in slices][:2] == [0, slices[1][0]]
    kinds = [type(request).__name__ for request in transport.calls]
    assert kinds[:2] == ["GetEncodingRequest", "StreamEncodingRequest"]


def test_rows_take_the_dtype_asked_for() -> None:
    with posenc.Client(transport=MockTransport(rows_of)) as client:
        rows = client.get_range(0, 4, WIDTH, dtype="bfloat16")
    assert rows.dtype.name == "bfloat16"
    np.testing.assert_array_equal(rows.astype(np.float32), expected(range(4)))


def test_a_unary_over_the_servers_limit_is_refused_then_streamed() -> None:
    # A client whose unary limit is above the server's: the transport refuses the unary
    # call (RESOURCE_EXHAUSTED, no retry delay) as the server would, and the client streams.
    transport = MockTransport(rows_of)
    with posenc.Client(transport=transport, unary_max_bytes=16 << 20) as client:
        limits = client.server_info().limits
        rows = client.get_range(0, 200_000, WIDTH)  # 4.6 MiB: over the default 4 MiB - 16 KiB
        small = client.get_range(0, 100_000, WIDTH)  # 2.3 MiB: one unary call
    assert limits.max_unary_bytes == transport.max_unary_bytes == (4 << 20) - (16 << 10)
    np.testing.assert_array_equal(rows, expected(range(200_000)))
    np.testing.assert_array_equal(small, expected(range(100_000)))
    kinds = [type(request).__name__ for request in transport.calls]
    assert kinds == ["GetEncodingRequest", "StreamEncodingRequest", "GetEncodingRequest"]


def test_a_lower_unary_limit_is_the_transports_to_set() -> None:
    transport = MockTransport(rows_of, max_unary_bytes=1024)
    with posenc.Client(transport=transport) as client:
        np.testing.assert_array_equal(client.get_range(0, 100, WIDTH), expected(range(100)))
    kinds = [type(request).__name__ for request in transport.calls]
    assert kinds == ["GetEncodingRequest", "StreamEncodingRequest"]


def test_a_status_fails_the_call_as_a_server_would() -> None:
    def refuse(request: Request) -> npt.ArrayLike:
        raise Status(grpc.StatusCode.INVALID_ARGUMENT, "spec.d_model: too wide")

    with (
        posenc.Client(transport=MockTransport(refuse)) as client,
        pytest.raises(posenc.InvalidArgumentError, match="too wide"),
    ):
        client.get_range(0, 4, WIDTH)


def test_unavailable_is_retried() -> None:
    failures = [Status(grpc.StatusCode.UNAVAILABLE, "restarting")]

    def flaky(request: Request) -> npt.ArrayLike:
        if failures:
            raise failures.pop()
        return rows_of(request)

    transport = MockTransport(flaky)
    with posenc.Client(transport=transport, retry_backoff=0.001) as client:
        np.testing.assert_array_equal(client.get_range(0, 4, WIDTH), expected(range(4)))
    assert len(transport.calls) == 2


def test_the_async_client_takes_a_transport_too() -> None:
    async def main() -> tuple[Any, Any, str]:
        async with posenc.AsyncClient(transport=MockTransport(rows_of)) as client:
            small = await client.get_positions([3, 2], WIDTH)
            large = await client.get_range(10, 200_010, WIDTH)
            return small, large, await client.health()

    small, large, health = asyncio.run(main())
    np.testing.assert_array_equal(small, expected([3, 2]))
    np.testing.assert_array_equal(large, expected(range(10, 200_010)))
    assert health == "SERVING"


def test_a_growing_table_runs_on_the_clients_calls() -> None:
    """GrowingTable's reads are the client's own call steps: here answered by the handler,
    one range to grow, none for held rows, a positions call for a far one."""
    transport = MockTransport(rows_of)
    with posenc.Client(transport=transport) as client:
        table = posenc.GrowingTable(client, WIDTH, min_rows=64)
        np.testing.assert_array_equal(table.get([3, 9]), expected([3, 9]))
        np.testing.assert_array_equal(table.get([60, 0]), expected([60, 0]))
        np.testing.assert_array_equal(table.get([10**9, 1]), expected([10**9, 1]))
    selections = [request.WhichOneof("selection") for request in transport.calls]
    assert selections == ["range", "positions"]
    assert len(table) == 64
