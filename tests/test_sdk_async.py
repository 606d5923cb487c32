"""The asyncio SDK against real servers on loopback: the same behaviour as the blocking one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
import ml_dtypes
import numpy as np
import pytest
from conftest import free_port, same_bits
from prometheus_client import REGISTRY

import posenc
from posenc_server.app import RunningServer

T = TypeVar("T")


def run(
    coroutine_function: Callable[[posenc.AsyncClient], Coroutine[Any, Any, T]],
    target: str | list[str],
    **options: Any,
) -> T:
    """Runs ``coroutine_function(client)`` in a fresh event loop with a fresh AsyncClient."""

    async def main() -> T:
        async with posenc.AsyncClient(target, **options) as client:
            return await coroutine_function(client)

    return asyncio.run(main())


def test_same_results_as_the_blocking_client(server: RunningServer) -> None:
    positions = [5, -9, 1 << 41, 5]

    async def fetch(client: posenc.AsyncClient) -> list[np.ndarray[Any, Any]]:
        return [
            await client.get_range(0, 300, 24, dtype="float16", layout="split"),
            await client.get_range(0, 8192, 256),  # 8 MiB: streamed
            await client.get_positions(positions, 24, schedule="tensor2tensor"),
        ]

    got = run(fetch, server.target)
    with posenc.Client(server.target) as client:
        expected = [
            client.get_range(0, 300, 24, dtype="float16", layout="split"),
            client.get_range(0, 8192, 256),
            client.get_positions(positions, 24, schedule="tensor2tensor"),
        ]
    for a, b in zip(got, expected, strict=True):
        assert same_bits(a, b)


def test_unary_and_streaming_identical(server: RunningServer) -> None:
    async def fetch(client: posenc.AsyncClient) -> np.ndarray[Any, Any]:
        return await client.get_range(-50, 2000, 40, dtype="bfloat16")

    unary = run(fetch, server.target)
    streamed = run(fetch, server.target, unary_max_bytes=0, chunk_bytes=1000)
    assert unary.dtype == np.dtype(ml_dtypes.bfloat16)
    assert same_bits(unary, streamed)


def test_iterators(server: RunningServer) -> None:
    positions = np.arange(500) * 7

    async def iterate(client: posenc.AsyncClient) -> tuple[list[int], list[int]]:
        range_labels, list_labels = [], []
        async for first, rows in client.iter_range(10, 510, 16, chunk_bytes=640):
            assert rows.shape[1] == 16 and rows.nbytes <= 640
            range_labels.append(first)
        async for first, rows in client.iter_positions(positions, 16, chunk_bytes=640):
            assert same_bits(
                rows, await client.get_positions(positions[first : first + len(rows)], 16)
            )
            list_labels.append(first)
        return range_labels, list_labels

    range_labels, list_labels = run(iterate, server.target)
    assert range_labels == list(range(10, 510, 10))
    assert list_labels == list(range(0, 500, 10))


def test_server_info_and_health(server: RunningServer) -> None:
    async def ask(client: posenc.AsyncClient) -> tuple[posenc.ServerInfo, str, str]:
        await client.get_range(0, 3, 3)
        return await client.server_info(), await client.health(), await client.health("x.Y")

    info, health, unknown = run(ask, server.target)
    assert info.rows_computed > 0 and set(info.dtypes) == set(posenc.DTYPE_NAMES)
    assert (health, unknown) == ("SERVING", "SERVICE_UNKNOWN")


def test_arguments_are_checked_when_a_method_is_called(server: RunningServer) -> None:
    async def bad(client: posenc.AsyncClient) -> None:
        with pytest.raises(posenc.InvalidArgumentError):
            client.get_range(0, 3, posenc.Spec("whisper", d_model=8), base=2.0)
        with pytest.raises(posenc.InvalidArgumentError):
            client.iter_range(0, 3, 8, layout="sideways")

    run(bad, server.target)


def test_invalid_argument_with_field_violations(server: RunningServer) -> None:
    async def bad(client: posenc.AsyncClient) -> None:
        await client.get_positions([1, -(1 << 45)], 8, base=-1.0)

    with pytest.raises(posenc.InvalidArgumentError) as caught:
        run(bad, server.target)
    fields = [field for field, _ in caught.value.field_violations]
    assert any(field.endswith("base") for field in fields)
    assert any(field.startswith("positions") for field in fields)


def test_timeout_raises_deadline_exceeded(server: RunningServer) -> None:
    async def slow(client: posenc.AsyncClient) -> None:
        await client.get_range(0, 1 << 20, 256, timeout=1e-4)

    with pytest.raises(posenc.DeadlineExceededError) as caught:
        run(slow, server.target)
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unavailable_after_retries() -> None:
    async def call(client: posenc.AsyncClient) -> None:
        await client.server_info()

    with pytest.raises(posenc.UnavailableError):
        run(call, f"127.0.0.1:{free_port()}", max_retries=1, retry_backoff=0.01)


@pytest.mark.timeout(60)
def test_no_server_at_the_target_is_said_after_the_retry_budget() -> None:
    target = f"127.0.0.1:{free_port()}"

    async def call(client: posenc.AsyncClient) -> np.ndarray[Any, Any]:
        return await client.get_range(0, 10, 8)

    with pytest.raises(
        posenc.UnavailableError, match=r"no posenc server at .* is it running.*after 3 attempts"
    ):
        run(call, target, max_retries=2, retry_backoff=0.01)


def test_round_robin_over_two_servers(server_factory: Callable[..., RunningServer]) -> None:
    servers = [server_factory(), server_factory()]

    async def spread(client: posenc.AsyncClient) -> None:
        # One after the other: a burst sent while the channel connects all goes to the
        # first backend that is ready, which is gRPC's round_robin behaviour.
        for i in range(40):
            await client.get_range(i * 5000, i * 5000 + 5, 8)

    run(spread, [s.target for s in servers])
    for s in servers:
        with posenc.Client(s.target) as client:
            assert client.server_info().rows_computed > 0


def streams_in_flight() -> float:
    """The in-process servers' ``posenc_streams_in_flight`` gauge."""
    return REGISTRY.get_sample_value("posenc_streams_in_flight") or 0.0


async def until_streams(count: float) -> bool:
    """Whether the servers' streams in flight come to ``count`` within 10 s."""
    for _ in range(1000):
        if streams_in_flight() == count:
            return True
        await asyncio.sleep(0.01)
    return False


def test_cancelling_the_task_cancels_the_call(server: RunningServer) -> None:
    async def cancel(client: posenc.AsyncClient) -> bool:
        before = streams_in_flight()
        task = asyncio.ensure_future(client.get_range(0, 1 << 20, 256, timeout=None))
        assert await until_streams(before + 1)  # one server process: one stream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # A stream left open would stay in flight, held by flow control.
        assert await until_streams(before)
        return (await client.get_range(0, 2, 2)).shape == (2, 2)

    assert run(cancel, server.target)


def test_an_abandoned_async_iterator_cancels_the_stream(server: RunningServer) -> None:
    async def abandon(client: posenc.AsyncClient) -> None:
        before = streams_in_flight()
        slices = client.iter_range(0, 1 << 20, 256, chunk_bytes=65536)
        first, rows = await anext(slices)
        assert (first, rows.shape) == (0, (64, 256))
        assert await until_streams(before + 1)
        await slices.aclose()  # type: ignore[attr-defined]
        assert await until_streams(before)

    run(abandon, server.target)


def test_specs_and_their_width(server: RunningServer) -> None:
    spec = posenc.Spec("rotary", head_dim=64, layout="vllm", scaling="linear", factor=2.0)

    async def fetch(client: posenc.AsyncClient) -> list[np.ndarray[Any, Any]]:
        return [
            await client.get_range(0, 100, spec),  # the width is not known yet
            await client.get_range(0, 100, spec),
            await client.get_positions([99, 3], spec),
        ]

    first, unary, rows = run(fetch, server.target)
    assert first.shape == (100, 64) and same_bits(first, unary)
    assert same_bits(rows, unary[[99, 3]])
    with posenc.Client(server.target) as client:
        assert same_bits(client.get_range(0, 100, spec), unary)


def test_client_created_outside_the_event_loop(server: RunningServer) -> None:
    client = posenc.AsyncClient(server.target)  # before asyncio.run, as module globals are

    async def use() -> tuple[int, int]:
        async with client:
            shape = (await client.get_range(0, 3, 4)).shape
            return (shape[0], shape[1])

    assert asyncio.run(use()) == (3, 4)

    async def after_close() -> None:
        await client.get_range(0, 3, 4)

    with pytest.raises(posenc.ClientClosedError, match="closed"):
        asyncio.run(after_close())


def test_a_closed_client_raises_a_posenc_error(server: RunningServer) -> None:
    async def main() -> None:
        client = posenc.AsyncClient(server.target)
        await client.get_range(0, 1, 4)
        await client.close()
        with pytest.raises(posenc.ClientClosedError, match="the client is closed"):
            await client.get_positions([1], 4)
        with pytest.raises(posenc.ClientClosedError):
            await client.server_info()

    asyncio.run(main())


def test_more_coordinate_rows_than_one_request_carries(server: RunningServer) -> None:
    spec = posenc.Spec("mrope", head_dim=16, mrope_section=[2, 3, 3])
    index = np.arange(70_000, dtype=np.int64)
    coordinates = np.stack([index, index // 7, -(index // 13)], axis=1)

    async def fetch(client: posenc.AsyncClient) -> tuple[Any, Any, Any]:
        whole = await client.get_positions(coordinates, spec)
        tail = await client.get_positions(coordinates[-10:], spec)
        streamed = [rows async for _, rows in client.iter_positions(coordinates, spec)]
        return whole, tail, np.concatenate(streamed)

    whole, tail, streamed = run(fetch, server.target)
    assert whole.shape == (70_000, 32)  # cos and sin
    assert same_bits(whole[-10:], tail)
    assert same_bits(streamed, whole)


def test_an_iterator_made_before_close_raises_client_closed(server: RunningServer) -> None:
    """As the blocking client does (a ValueError before), whether or not a call was made."""

    async def main(first_call: bool) -> None:
        client = posenc.AsyncClient(server.target)
        if first_call:
            await client.get_range(0, 1, 4)
        slices = client.iter_range(0, 10, 4)
        await client.close()
        with pytest.raises(posenc.ClientClosedError, match="the client is closed"):
            async for _ in slices:
                pass

    for first_call in (False, True):
        asyncio.run(main(first_call))
