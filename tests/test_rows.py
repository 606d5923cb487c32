"""The SDK's row cache and read-ahead: planning and assembly alone, then through a server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from prometheus_client import REGISTRY

import posenc
from posenc import _protocol as proto
from posenc._rows import MAX_CACHED_CALL_ROWS, MAX_READAHEAD_ROWS, RowCache, RowPlan
from posenc_server.app import RunningServer
from posenc_server.engine import EncodingSpec, encode_positions

D_MODEL = 4096  # float32 rows of 16 KiB
ROW_BYTES = D_MODEL * 4
MIB = 1 << 20


def query(positions: Any, d_model: int = D_MODEL, dtype: str = "float32") -> proto.Query:
    return proto.positions_query(
        positions, d_model, base=10000.0, dtype=dtype, layout="interleaved", schedule="paper"
    )


def fake_rows(q: proto.Query) -> npt.NDArray[Any]:
    """Rows standing for the server's: every element of row i is positions[i]."""
    assert q.positions is not None
    rows = q.empty()
    rows[...] = q.positions[:, None]
    return rows


def answer(plan: RowPlan | None) -> npt.NDArray[Any] | None:
    """What a client does with a plan: fetch (here: fake rows) and assemble."""
    if plan is None:
        return None
    return plan.result(None if plan.fetch is None else fake_rows(plan.fetch))


def fetched_positions(plan: RowPlan | None) -> list[int]:
    assert plan is not None and plan.fetch is not None and plan.fetch.positions is not None
    return plan.fetch.positions.tolist()


# -- planning, without a server -------------------------------------------------------------


def test_a_sequence_moving_forward_is_read_ahead_then_served_from_the_cache() -> None:
    cache = RowCache(64 * MIB, MIB)
    assert cache.plan(query([1000])) is None  # nothing known yet: the caller's own call
    plan = cache.plan(query([1001]))  # 1000 was asked for: the sequence moves forward
    # One row is 16 KiB: 1 MiB of read-ahead is 64 rows, the most read ahead.
    assert fetched_positions(plan) == list(range(1001, 1001 + MAX_READAHEAD_ROWS))
    first = answer(plan)
    assert first is not None and first.shape == (1, D_MODEL) and (first == 1001).all()
    for position in range(1002, 1001 + MAX_READAHEAD_ROWS):
        plan = cache.plan(query([position]))
        assert plan is not None and plan.fetch is None  # no call
        rows = answer(plan)
        assert rows is not None and (rows == position).all()
    # Past the window: the next read-ahead.
    position = 1001 + MAX_READAHEAD_ROWS
    assert fetched_positions(cache.plan(query([position])))[:2] == [position, position + 1]


def test_read_ahead_shares_its_bytes_among_the_sequences_moving_forward() -> None:
    cache = RowCache(64 * MIB, MIB)
    starts = np.array([10, 5000, 90000, 7])
    cache.plan(query(starts))
    plan = cache.plan(query(starts + 1))
    # 1 MiB over 4 sequences of 16 KiB rows: 16 rows each, in sorted start order.
    expected = [int(s) + 1 + k for s in sorted(starts) for k in range(16)]
    assert fetched_positions(plan) == expected
    rows = answer(plan)
    assert rows is not None and (rows[:, 0] == starts + 1).all()  # the caller's order
    plan = cache.plan(query(starts + 16))
    rows = answer(plan)
    assert plan is not None and plan.fetch is None
    assert rows is not None and (rows[:, 0] == starts + 16).all()


def test_steps_as_large_as_the_read_ahead_go_to_the_server_as_asked() -> None:
    cache = RowCache(64 * MIB, MIB)
    starts = 1000 + 100 * np.arange(64)  # 64 rows of 16 KiB: a step is already 1 MiB
    for step in range(3):
        assert cache.plan(query(starts + step)) is None
    assert cache.nbytes == 0


def test_scattered_positions_are_not_read_ahead() -> None:
    cache = RowCache(64 * MIB, MIB)
    for positions in ([5, 900], [77, 12], [3000, 1]):
        assert cache.plan(query(positions)) is None
    assert cache.nbytes == 0


def test_repeats_and_order_are_kept_and_results_are_new_arrays() -> None:
    cache = RowCache(64 * MIB, MIB)
    cache.plan(query([100, 200]))
    answer(cache.plan(query([101, 201])))
    plan = cache.plan(query([205, 103, 205, 101]))
    rows = answer(plan)
    assert plan is not None and plan.fetch is None
    assert rows is not None and rows[:, 0].tolist() == [205, 103, 205, 101]
    assert rows.flags.writeable and rows.flags.owndata
    rows[...] = -1  # the caller's array: the cache keeps its own rows
    again = answer(cache.plan(query([205])))
    assert again is not None and (again == 205).all()


def test_partly_cached_calls_fetch_only_what_is_missing() -> None:
    cache = RowCache(64 * MIB, MIB)
    cache.plan(query([100]))
    answer(cache.plan(query([101])))  # caches 101 .. 164
    # 9000 and 9001 are new: nothing to read ahead, so the call goes out as asked (one
    # call, no assembly) although 150 is cached.
    assert cache.plan(query([150, 9000, 9001])) is None
    plan = cache.plan(query([151, 9002]))  # 9001 was asked for: 9002 moves forward
    assert fetched_positions(plan) == list(range(9002, 9002 + MAX_READAHEAD_ROWS))
    rows = answer(plan)
    assert rows is not None and rows[:, 0].tolist() == [151, 9002]


def test_specs_do_not_share_rows() -> None:
    cache = RowCache(64 * MIB, MIB)
    cache.plan(query([100]))
    answer(cache.plan(query([101])))
    for other in (query([102], dtype="float16"), query([102], d_model=D_MODEL // 2)):
        plan = cache.plan(other)
        assert plan is None or plan.fetch is not None  # never another spec's rows
    assert cache.plan(query([102])) is not None


def test_the_budget_bounds_the_cache_and_evicts_the_least_recently_used() -> None:
    budget = 4 * MIB + 64 * 1024  # room for 4 read-ahead windows of 1 MiB
    cache = RowCache(budget, MIB)
    sequences = [10_000 * (k + 1) for k in range(6)]
    for start in sequences:
        cache.plan(query([start]))
        answer(cache.plan(query([start + 1])))
        assert cache.nbytes <= budget
    # The two oldest windows were evicted; the four newest still answer without a call.
    for start in sequences[:2]:
        plan = cache.plan(query([start + 2]))
        assert plan is not None and plan.fetch is not None
    for start in sequences[2:]:
        plan = cache.plan(query([start + 3]))
        assert plan is not None and plan.fetch is None


def test_large_calls_and_a_zero_budget_bypass_the_cache() -> None:
    cache = RowCache(64 * MIB, MIB)
    many = np.arange(MAX_CACHED_CALL_ROWS + 1)
    assert cache.plan(query(many, d_model=8)) is None
    assert cache.plan(query(many + 1, d_model=8)) is None
    for position in (1, 2, 3):  # d_model 0 is the server's to refuse, every time
        assert cache.plan(query([position], d_model=0)) is None
    off = RowCache(0, MIB)
    off.plan(query([1]))
    assert off.plan(query([2])) is None
    no_readahead = RowCache(64 * MIB, 0)
    no_readahead.plan(query([1]))
    assert no_readahead.plan(query([2])) is None


def test_read_ahead_stops_short_of_int64_overflow() -> None:
    cache = RowCache(64 * MIB, MIB)
    top = (1 << 63) - 3
    cache.plan(query([top - 1]))
    assert cache.plan(query([top])) is None


@pytest.mark.parametrize(("budget", "readahead"), [(-1, MIB), (MIB, -1)])
def test_negative_sizes_are_refused(budget: int, readahead: int) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        RowCache(budget, readahead)
    with pytest.raises(ValueError, match="must be >= 0"):
        posenc.Client("127.0.0.1:1", row_cache_bytes=budget, readahead_bytes=readahead)


# -- through a real server ------------------------------------------------------------------


def get_encoding_calls() -> float:
    """GetEncoding calls answered so far by the in-process servers (a global counter)."""
    labels = {"method": "GetEncoding", "code": "OK"}
    return REGISTRY.get_sample_value("posenc_requests_total", labels) or 0.0


def decode_loop(
    get_positions: Callable[[npt.NDArray[np.int64]], npt.NDArray[Any]],
    lengths: npt.NDArray[np.int64],
    steps: int,
) -> list[npt.NDArray[Any]]:
    return [get_positions(lengths + step) for step in range(steps)]


@pytest.mark.parametrize("sequences", [1, 8])
def test_a_decode_loop_gets_the_servers_exact_rows_in_fewer_calls(
    server: RunningServer, sequences: int
) -> None:
    lengths = 1_000_003 + 9_973 * np.arange(sequences, dtype=np.int64)
    steps = 150
    with (
        posenc.Client(server.target) as cached,
        posenc.Client(server.target, row_cache_bytes=0) as direct,
    ):
        before = get_encoding_calls()
        got = decode_loop(lambda p: cached.get_positions(p, D_MODEL), lengths, steps)
        cached_calls = get_encoding_calls() - before
        before = get_encoding_calls()
        want = decode_loop(lambda p: direct.get_positions(p, D_MODEL), lengths, steps)
        direct_calls = get_encoding_calls() - before
    assert direct_calls == steps
    # Read-ahead of 1 MiB: 64 rows ahead for 1 sequence, 8 for 8 (after the first step).
    ahead = MAX_READAHEAD_ROWS // sequences
    assert cached_calls == 1 + -(-(steps - 1) // ahead)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.tobytes() == b.tobytes(), f"step {step}"
    spec = EncodingSpec(d_model=D_MODEL)
    last = encode_positions(spec, lengths + steps - 1)
    assert got[-1].tobytes() == last.tobytes()


def test_read_ahead_past_the_position_limit_falls_back_to_the_callers_call(
    server: RunningServer,
) -> None:
    limit = server.config.max_abs_position
    with posenc.Client(server.target) as client:
        rows = [client.get_positions([p], 64) for p in (limit - 2, limit - 1, limit)]
        spec = EncodingSpec(d_model=64)
        expected = encode_positions(spec, np.array([limit - 2, limit - 1, limit]))
        assert np.concatenate(rows).tobytes() == expected.tobytes()
        with pytest.raises(posenc.InvalidArgumentError) as error:
            client.get_positions([limit + 1], 64)
        assert error.value.field_violations[0][0] == "positions.positions[0]"


def test_the_async_client_reads_ahead_too(server: RunningServer) -> None:
    lengths = np.array([5_000_000, 6_000_000], dtype=np.int64)
    steps = 70

    async def loop(**options: int) -> tuple[list[npt.NDArray[Any]], float]:
        async with posenc.AsyncClient(server.target, **options) as client:
            before = get_encoding_calls()
            rows = [await client.get_positions(lengths + step, D_MODEL) for step in range(steps)]
            return rows, get_encoding_calls() - before

    got, cached_calls = asyncio.run(loop())
    want, direct_calls = asyncio.run(loop(row_cache_bytes=0))
    assert direct_calls == steps
    assert cached_calls == 1 + -(-(steps - 1) // (MAX_READAHEAD_ROWS // 2))
    assert [a.tobytes() for a in got] == [b.tobytes() for b in want]


def test_threads_sharing_a_client_each_get_their_exact_rows(server: RunningServer) -> None:
    spec = EncodingSpec(d_model=256)
    steps = 200

    def loop(client: posenc.Client, lengths: npt.NDArray[np.int64]) -> None:
        for step in range(steps):
            rows = client.get_positions(lengths + step, 256)
            assert rows.tobytes() == encode_positions(spec, lengths + step).tobytes()

    with posenc.Client(server.target) as client, ThreadPoolExecutor(4) as pool:
        starts = [np.array([10_000 * k + 1, 10_000 * k + 500]) for k in range(4)]
        for future in [pool.submit(loop, client, lengths) for lengths in starts]:
            future.result()
        assert 0 < client._rows.nbytes <= client._rows.budget_bytes
