"""The SDK's row cache and read-ahead: planning and assembly alone, then through a server."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import grpc.aio
import numpy as np
import numpy.typing as npt
import pytest

import posenc
from posenc._client import READ_AHEAD_THREADS
from posenc._query import Query, Widths, positions_query, table_spec
from posenc._rows import (
    LEAD_STEPS,
    MAX_CACHED_CALL_ROWS,
    MAX_READAHEAD_ROWS,
    Pending,
    RowCache,
    RowPlan,
)
from posenc.testing import MockTransport
from posenc.testing import positions as selected
from posenc_server.app import RunningServer

D_MODEL = 4096  # float32 rows of 16 KiB
ROW_BYTES = D_MODEL * 4
MIB = 1 << 20


def query(positions: Any, d_model: int = D_MODEL, dtype: str = "float32") -> Query:
    """A positions query of the classic table, whose width a response already told."""
    widths = Widths()
    widths.learn(table_spec(d_model, dtype, {}).SerializeToString(deterministic=True), d_model)
    return positions_query(positions, d_model, dtype, {}, widths)[0]


def fake_rows(q: Query) -> npt.NDArray[Any]:
    """Rows standing for the server's: every element of row i is positions[i]."""
    assert q.positions is not None
    rows = q.empty()
    rows[...] = q.positions[:, None]
    return rows


def answer(plan: RowPlan | Pending | None) -> npt.NDArray[Any] | None:
    """What a client does with a plan: fetch (here: fake rows) and assemble."""
    if plan is None:
        return None
    assert isinstance(plan, RowPlan)
    return plan.result(None if plan.fetch is None else fake_rows(plan.fetch))


def fetched_positions(plan: RowPlan | Pending | None) -> list[int]:
    assert isinstance(plan, RowPlan)
    assert plan.fetch is not None and plan.fetch.positions is not None
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
    # 1 MiB over 4 sequences of 16 KiB rows: 16 rows each. The windows of 7 and 10 overlap
    # (8 .. 23 and 11 .. 26): each row is fetched once.
    expected = sorted({int(s) + 1 + k for s in starts for k in range(16)})
    assert len(expected) == 4 * 16 - 13
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


def test_a_table_of_unknown_width_is_not_cached_but_its_steps_count() -> None:
    cache = RowCache(64 * MIB, MIB)
    unknown, _ = positions_query([1000], D_MODEL, "float32", {}, Widths())
    assert unknown.columns is None
    assert cache.plan(unknown) is None  # the first call of a table: its width unknown
    assert cache.claim_ahead(unknown, object) == []
    # ... but it was a step: the next one, the width now known, reads ahead.
    assert fetched_positions(cache.plan(query([1001])))[:2] == [1001, 1002]


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


def test_background_read_ahead_starts_when_a_window_is_half_used() -> None:
    cache = RowCache(64 * MIB, MIB)
    cache.plan(query([1000]))
    answer(cache.plan(query([1001])))  # caches 1001 .. 1064
    for position in range(1002, 1033):
        answer(cache.plan(query([position])))
        assert cache.claim_ahead(query([position]), object) == []
    answer(cache.plan(query([1033])))
    token = object()
    (ahead,) = cache.claim_ahead(query([1033]), lambda: token)  # 1065 is 32 away: next window
    assert ahead.query.positions is not None
    assert ahead.query.positions.tolist() == list(range(1065, 1065 + MAX_READAHEAD_ROWS))
    assert cache.in_flight == MAX_READAHEAD_ROWS
    assert cache.claim_ahead(query([1034]), object) == []  # already on its way
    # A call that needs rows in flight is told to wait for them, or fetches them itself.
    waiting = cache.plan(query([1065]))
    assert isinstance(waiting, Pending) and waiting.tokens == (token,)
    assert fetched_positions(cache.plan(query([1065]), wait=False))[0] == 1065
    cache.finish_ahead(ahead, fake_rows(ahead.query))
    assert cache.in_flight == 0
    plan = cache.plan(query([1066]))
    rows = answer(plan)
    assert plan is not None and plan.fetch is None and rows is not None and (rows == 1066).all()


def test_a_cached_step_is_a_lookup_that_claims_once_when_its_window_runs_short() -> None:
    # The decode loop's path: a step whose rows one batch holds is answered without a plan;
    # the first step within the lead (32 rows) of its window's end says a claim is due, and
    # only that one: the steps between wake no read-ahead thread.
    cache = RowCache(64 * MIB, MIB)
    cache.plan(query([1000]))
    answer(cache.plan(query([1001])))  # caches 1001 .. 1064
    key = query([1]).spec_key
    for position in range(1001, 1033):
        found = cache.lookup(key, np.array([position]))
        assert found is not None and not found[1] and (found[0] == position).all()
    rows, due = cache.lookup(key, np.array([1033])) or (None, False)
    assert rows is not None and due and rows.shape == (1, D_MODEL)
    found = cache.lookup(key, np.array([1034]))
    assert found is not None and not found[1]  # claimed already
    assert cache.lookup(key, np.array([1065])) is None  # not cached: the caller plans
    assert cache.lookup(query([1], d_model=64).spec_key, np.array([1002])) is None
    # The claim it calls for fetches the next window, as a step's own claim would.
    (ahead,) = cache.claim_ahead(query([1033]), object)
    assert ahead.query.positions is not None and ahead.query.positions[0] == 1065


def test_a_lookup_of_several_sequences_keeps_their_order_and_gives_a_new_array() -> None:
    cache = RowCache(64 * MIB, MIB)
    starts = np.array([10, 5000, 90000, 700])
    cache.plan(query(starts))
    answer(cache.plan(query(starts + 1)))  # 16 rows ahead each (11 .. 26, ...)
    key = query([1]).spec_key
    found = cache.lookup(key, np.array([5004, 12, 12, 90003]))
    assert found is not None
    rows, due = found
    assert rows[:, 0].tolist() == [5004, 12, 12, 90003] and not due
    rows[...] = -1  # the caller's to write: the cache's rows stay
    again = cache.lookup(key, np.array([12]))
    assert again is not None and (again[0] == 12).all()
    # The lead of 4 sequences is half their window, 8 rows: the first step within 8 rows of
    # a window's end claims, once.
    not_yet = cache.lookup(key, starts + 8)
    assert not_yet is not None and not not_yet[1]
    due_now = cache.lookup(key, starts + 9)
    assert due_now is not None and due_now[1]
    later = cache.lookup(key, starts + 10)
    assert later is not None and not later[1]
    assert cache.lookup(key, np.array([12, 4])) is None  # one row missing: plan


def test_cached_steps_answer_as_their_steps_would() -> None:
    # Steps served by the lookup (no plan) give what the same call gives through the server:
    # lists, arrays of other int dtypes and shapes, (cos, sin) halves, tensors for a torch
    # dtype; and a closed client refuses them, cached or not.
    width = 64

    def rows_of(request: Any) -> npt.NDArray[Any]:
        held = selected(request).astype(np.float64)
        return held[:, None] + np.arange(width) / 128

    transport = MockTransport(rows_of)
    client = posenc.Client(transport=transport)
    plain = posenc.Client(transport=MockTransport(rows_of), row_cache_bytes=0)
    rotary = posenc.Spec("rotary", head_dim=width)
    starts = np.array([100, 9000, 70000])
    with client, plain:
        for step in range(40):
            now = starts + step
            for form in (now.tolist(), now.astype(np.int32), now.reshape(3, 1), now[:1]):
                np.testing.assert_array_equal(
                    client.get_positions(form, width), plain.get_positions(form, width)
                )
            cos, sin = client.get_positions(now, rotary, cos_sin=True)
            expected = plain.get_positions(now, rotary)
            np.testing.assert_array_equal(np.concatenate([cos, sin], axis=-1), expected)
        assert len(transport.calls) < 20  # the rest were cached
        torch = pytest.importorskip("torch")
        for step in range(3):
            tensor = client.get_positions(starts + step, width, dtype=torch.float32)
            assert isinstance(tensor, torch.Tensor)
            np.testing.assert_array_equal(tensor.numpy(), plain.get_positions(starts + step, width))
    with pytest.raises(posenc.ClientClosedError):
        client.get_positions(starts + 5, width)


def test_a_callers_own_fetch_ahead_is_in_flight_until_released() -> None:
    """A loop that outran the read-ahead thread fetches its next window itself: its rows are
    in flight as a background fetch's are. A background claim made meanwhile does not fetch
    them again, another call waits for them, and both take them up if the fetch failed."""
    cache = RowCache(64 * MIB, MIB)
    cache.plan(query([1000]))
    token = object()
    plan = cache.plan(query([1001]), new_token=lambda: token)  # fetching 1001 .. 1064 itself
    assert fetched_positions(plan) == list(range(1001, 1001 + MAX_READAHEAD_ROWS))
    assert isinstance(plan, RowPlan) and plan.token is token
    assert cache.in_flight == MAX_READAHEAD_ROWS
    assert cache.claim_ahead(query([1001]), object) == []
    waiting = cache.plan(query([1002]))
    assert isinstance(waiting, Pending) and waiting.tokens == (token,)
    plan.release()  # the call failed
    plan.release()
    assert cache.in_flight == 0
    (ahead,) = cache.claim_ahead(query([1001]), object)
    assert ahead.query.positions is not None
    assert ahead.query.positions.tolist() == list(range(1002, 1002 + MAX_READAHEAD_ROWS))


def test_background_read_ahead_of_large_steps_leads_by_several_steps() -> None:
    cache = RowCache(64 * MIB, MIB)
    starts = 1000 + 100 * np.arange(64)  # 1 MiB per step: no read-ahead in the call
    cache.plan(query(starts))
    assert cache.claim_ahead(query(starts), object) == []  # not moving yet
    assert cache.plan(query(starts + 1)) is None
    # Twice LEAD_STEPS steps, a step (the window: 1 MiB) a fetch, the nearest first: a lead
    # of one window refills a lead's worth at once.
    aheads = cache.claim_ahead(query(starts + 1), object)
    assert [a.query.positions.tolist() for a in aheads if a.query.positions is not None] == [
        sorted((starts + 1 + step).tolist()) for step in range(1, 2 * LEAD_STEPS + 1)
    ]
    assert len({id(a.token) for a in aheads}) == 2 * LEAD_STEPS
    for ahead in aheads[1:]:
        cache.finish_ahead(ahead, fake_rows(ahead.query))
    cache.finish_ahead(aheads[0], None)  # failed: nothing cached, nothing in flight
    assert cache.in_flight == 0 and cache.plan(query(starts + 2)) is None
    assert cache.claim_ahead(query(starts + 2), object) == []  # the lead is there
    # A step whose lead runs short fetches the next lead's worth: from LEAD_STEPS ahead of
    # it to twice that.
    step = starts + 2 + LEAD_STEPS
    aheads = cache.claim_ahead(query(step), object)
    assert [a.query.positions.tolist() for a in aheads if a.query.positions is not None] == [
        sorted((step + ahead).tolist()) for ahead in range(LEAD_STEPS, 2 * LEAD_STEPS + 1)
    ]
    assert cache.claim_ahead(query(step), object) == []  # on its way


def test_the_lead_of_huge_steps_stays_within_a_quarter_of_the_cache() -> None:
    cache = RowCache(8 * MIB, MIB)  # 2 MiB steps (128 sequences): a lead of one step
    starts = 1000 + 100 * np.arange(128)
    cache.plan(query(starts))
    assert cache.plan(query(starts + 1)) is None
    (ahead,) = cache.claim_ahead(query(starts + 1), object)
    assert ahead.query.positions is not None
    assert ahead.query.positions.tolist() == sorted((starts + 2).tolist())


@pytest.mark.parametrize(("budget", "readahead"), [(-1, MIB), (MIB, -1)])
def test_negative_sizes_are_refused(budget: int, readahead: int) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        RowCache(budget, readahead)
    with pytest.raises(ValueError, match="must be >= 0"):
        posenc.Client("127.0.0.1:1", row_cache_bytes=budget, readahead_bytes=readahead)


# -- through a real server ------------------------------------------------------------------


class CallCounter(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Counts a client's table calls by thread: the caller's, or the read-ahead thread's
    (which has that name); and knows how many are in flight."""

    def __init__(self) -> None:
        self.calls = {"caller": 0, "background": 0}
        self._lock = threading.Lock()
        self._in_flight = 0

    def _count(self, call: Callable[[], Any]) -> Any:
        background = threading.current_thread().name == "posenc-read-ahead"
        with self._lock:
            self.calls["background" if background else "caller"] += 1
            self._in_flight += 1
        try:
            return call()
        finally:
            with self._lock:
                self._in_flight -= 1

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        def call() -> Any:
            outcome = continuation(details, request)
            outcome.result()  # the unary call ends here, as the client waits for it
            return outcome

        return self._count(call)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        # A stream is counted; the caller reads it to its end before its call returns.
        return self._count(lambda: continuation(details, request))

    def settle(self) -> None:
        """Waits for the client's background read-ahead calls to end."""
        deadline = time.monotonic() + 30
        while True:
            with self._lock:
                if not self._in_flight:
                    break
            assert time.monotonic() < deadline, "read-ahead never finished"
            time.sleep(0.002)
        time.sleep(0.01)  # its rows join the cache just after the call returns


def decode_loop(
    get_positions: Callable[[npt.NDArray[np.int64]], npt.NDArray[Any]],
    lengths: npt.NDArray[np.int64],
    steps: int,
    model_seconds: float = 0.0,
) -> list[npt.NDArray[Any]]:
    rows = []
    for step in range(steps):
        rows.append(get_positions(lengths + step))
        time.sleep(model_seconds)  # the model's forward pass
    return rows


def read_ahead_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "posenc-read-ahead"}


@pytest.mark.parametrize(("sequences", "model_seconds"), [(1, 0.0), (8, 0.0), (64, 0.005)])
def test_a_decode_loop_gets_the_servers_exact_rows_from_two_calls_of_its_own(
    server: RunningServer, sequences: int, model_seconds: float
) -> None:
    """After the first two steps, the rows arrive ahead in the background. With 1 and 8
    sequences read-ahead brings 64 and 8 rows per sequence; 64 (1 MiB per step) get the next
    step's rows while the model runs, and the caller never calls again. A loop with no model
    time between steps may outrun the read-ahead thread (a busy machine, the GIL): its step
    then fetches the next window itself, which the background does not fetch again."""
    lengths = 1_000_003 + 9_973 * np.arange(sequences, dtype=np.int64)
    steps = 150 if sequences < 64 else 40
    cached_calls, direct_calls = CallCounter(), CallCounter()
    with (
        posenc.Client(server.target, interceptors=[cached_calls]) as cached,
        posenc.Client(server.target, row_cache_bytes=0, interceptors=[direct_calls]) as direct,
    ):
        want = decode_loop(lambda p: direct.get_positions(p, D_MODEL), lengths, steps)
        got = decode_loop(lambda p: cached.get_positions(p, D_MODEL), lengths, steps, model_seconds)
        cached_calls.settle()
    assert direct_calls.calls == {"caller": steps, "background": 0}
    ahead = MAX_READAHEAD_ROWS // sequences if sequences < 64 else 1
    windows = steps // ahead
    if model_seconds:
        assert cached_calls.calls["caller"] == 2
    else:
        assert 2 <= cached_calls.calls["caller"] <= 2 + windows
    # A call per window, the first few windows at once (LEAD_STEPS of them at most), each
    # window fetched once, by the background or by the caller.
    assert cached_calls.calls["background"] <= LEAD_STEPS + windows
    assert sum(cached_calls.calls.values()) <= 2 + LEAD_STEPS + windows
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.tobytes() == b.tobytes(), f"step {step}"


def test_closing_a_client_ends_its_read_ahead(server: RunningServer) -> None:
    before = read_ahead_threads()
    client = posenc.Client(server.target)
    for step in range(40):
        client.get_positions([5_000 + step], D_MODEL)
    threads = read_ahead_threads() - before
    assert len(threads) == READ_AHEAD_THREADS
    client.close()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


@pytest.mark.slow
def test_read_ahead_past_the_position_limit_falls_back_to_the_callers_call(
    server: RunningServer,
) -> None:
    """Read-ahead the server refuses (past its position limit), in the call or in the
    background, is dropped: each step gets its exact rows at the cost of one refused call
    at most, and an error names the caller's own position."""
    limit = server.config.max_abs_position
    positions = range(limit - 40, limit + 1)
    counter = CallCounter()
    with (
        posenc.Client(server.target, interceptors=[counter]) as client,
        posenc.Client(server.target, row_cache_bytes=0) as direct,
    ):
        for position in positions:
            rows = client.get_positions([position], 64)
            assert rows.tobytes() == direct.get_positions([position], 64).tobytes()
            counter.settle()
        with pytest.raises(posenc.InvalidArgumentError) as error:
            client.get_positions([limit + 1], 64)
        assert error.value.field_violations[0][0] == "positions.positions[0]"
    assert counter.calls["caller"] <= 2 * len(positions) + 2
    assert counter.calls["background"] >= 1


class AsyncUnaryCounter(grpc.aio.UnaryUnaryClientInterceptor):
    """Counts an AsyncClient's unary calls into ``calls``. (grpc.aio takes an interceptor
    as one kind only, the first it is: streams have their own.)"""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.calls.append(details.method)
        return await continuation(details, request)


class AsyncStreamCounter(grpc.aio.UnaryStreamClientInterceptor):
    """Counts an AsyncClient's streams into ``calls``."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self.calls.append(details.method)
        return await continuation(details, request)


def test_the_async_client_reads_ahead_too(server: RunningServer) -> None:
    lengths = np.array([5_000_000, 6_000_000], dtype=np.int64)
    steps = 70

    async def loop(**options: int) -> tuple[list[npt.NDArray[Any]], int]:
        calls: list[str] = []
        counters = [AsyncUnaryCounter(calls), AsyncStreamCounter(calls)]
        async with posenc.AsyncClient(server.target, interceptors=counters, **options) as c:
            rows = [await c.get_positions(lengths + step, D_MODEL) for step in range(steps)]
        return rows, len(calls)

    got, cached_calls = asyncio.run(loop())
    want, direct_calls = asyncio.run(loop(row_cache_bytes=0))
    assert direct_calls == steps
    # Two calls of its own, then a background window of 32 rows every 16 steps at most.
    assert cached_calls <= 2 + 2 + steps // (MAX_READAHEAD_ROWS // 2)
    assert [a.tobytes() for a in got] == [b.tobytes() for b in want]


@pytest.mark.slow
def test_threads_sharing_a_client_each_get_their_exact_rows(server: RunningServer) -> None:
    steps = 200
    counter = CallCounter()

    def loop(client: posenc.Client, lengths: npt.NDArray[np.int64]) -> None:
        with posenc.Client(server.target, row_cache_bytes=0) as direct:
            for step in range(steps):
                rows = client.get_positions(lengths + step, 256)
                assert rows.tobytes() == direct.get_positions(lengths + step, 256).tobytes()

    with (
        posenc.Client(server.target, interceptors=[counter]) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        starts = [np.array([10_000 * k + 1, 10_000 * k + 500]) for k in range(4)]
        for future in [pool.submit(loop, client, lengths) for lengths in starts]:
            future.result()
    assert sum(counter.calls.values()) < 4 * steps // 4  # the cache answered most steps


def test_a_client_dropped_without_close_is_collected_and_its_thread_ends(
    server: RunningServer,
) -> None:
    before = read_ahead_threads()
    counter = CallCounter()
    client = posenc.Client(server.target, interceptors=[counter])
    for step in range(40):
        client.get_positions([9_000 + step], D_MODEL)
    counter.settle()
    threads = read_ahead_threads() - before
    assert len(threads) == READ_AHEAD_THREADS
    dropped = weakref.ref(client)
    del client
    for _ in range(100):  # the thread holds it while it files its last rows, then lets go
        gc.collect()
        if dropped() is None:
            break
        time.sleep(0.01)
    assert dropped() is None  # the read-ahead threads hold it weakly
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


def test_closing_an_async_client_with_a_read_ahead_in_flight_ends_it(
    server: RunningServer,
) -> None:
    async def main() -> None:
        client = posenc.AsyncClient(server.target)
        for step in range(34):  # the last step starts the next window in the background
            await client.get_positions([5_000 + step], D_MODEL)
        await asyncio.sleep(0)  # the step's claim runs once the step has returned
        ahead = [t for t in asyncio.all_tasks() if t.get_name() == "posenc-read-ahead"]
        assert ahead
        await client.close()  # cancels the task
        for _ in range(100):
            if all(task.done() for task in ahead):
                break
            await asyncio.sleep(0.01)
        assert all(task.done() for task in ahead)

    asyncio.run(main())


def test_positions_are_copied_at_call_time() -> None:
    mine = np.array([1, 2, 3], dtype=np.int64)
    positions = query(mine).positions
    mine[:] = 999  # a caller reusing its buffer changes nothing already asked for
    assert positions is not None and positions.tolist() == [1, 2, 3]


# -- prefetch: rows a loop knows it needs next ------------------------------------------------


def test_prefetch_claims_only_rows_neither_cached_nor_in_flight() -> None:
    cache = RowCache(64 * MIB, MIB)
    tokens = iter(range(100))
    [ahead] = cache.claim_prefetch(query([7, 3, 7]), lambda: next(tokens))
    assert ahead.query.positions is not None and ahead.query.positions.tolist() == [3, 7]
    assert cache.in_flight == 2
    assert cache.claim_prefetch(query([3, 7]), lambda: next(tokens)) == []  # in flight
    plan = cache.plan(query([3]))
    assert isinstance(plan, Pending) and plan.tokens == (ahead.token,)
    cache.finish_ahead(ahead, fake_rows(ahead.query))
    assert cache.in_flight == 0
    assert cache.claim_prefetch(query([3, 7]), lambda: next(tokens)) == []  # cached
    plan = cache.plan(query([7, 3]))
    assert isinstance(plan, RowPlan) and plan.fetch is None
    assert answer(plan).tolist() == [[7] * D_MODEL, [3] * D_MODEL]  # type: ignore[union-attr]
    # The cache off, or a batch job's list: nothing to prefetch.
    assert RowCache(0, MIB).claim_prefetch(query([1]), lambda: next(tokens)) == []
    many = np.arange(MAX_CACHED_CALL_ROWS + 1)
    assert cache.claim_prefetch(query(many), lambda: next(tokens)) == []


def test_a_prefetch_in_flight_is_waited_for_even_before_the_width_is_known() -> None:
    cache = RowCache(64 * MIB, MIB)
    unknown, _ = positions_query([5, 6], 96, "float32", {}, Widths())  # no width told yet
    assert len(cache.claim_prefetch(unknown, lambda: "token")) == 1
    assert isinstance(cache.plan(unknown), Pending)
    assert cache.plan(unknown, wait=False) is None  # no width: the caller's own call


@pytest.mark.parametrize("model_seconds", [0.0, 0.005])
def test_a_loop_prefetching_its_next_table_makes_one_call_of_its_own(
    server: RunningServer, model_seconds: float
) -> None:
    """A new table every step (as a dynamic-NTK model's), each step's rows prefetched one
    step before: the caller's only call is the first step's; the next steps take the
    rows from the cache, or wait for the prefetch still under way (no model time)."""
    steps = 30
    specs = [posenc.Spec("rotary", head_dim=128, rope_theta=10_000.0 + s) for s in range(steps)]
    positions = np.array([[5_000], [5_000], [7_000]], dtype=np.int64)  # [batch, 1]
    counter = CallCounter()
    got = []
    with (
        posenc.Client(server.target, interceptors=[counter]) as client,
        posenc.Client(server.target, row_cache_bytes=0) as direct,
    ):
        for step in range(steps):
            got.append(client.get_positions(positions + step, specs[step], dtype="bfloat16"))
            if step + 1 < steps:
                client.prefetch(positions + step + 1, specs[step + 1], dtype="bfloat16")
            time.sleep(model_seconds)
        counter.settle()
        want = [
            direct.get_positions(positions + step, specs[step], dtype="bfloat16")
            for step in range(steps)
        ]
    assert counter.calls == {"caller": 1, "background": steps - 1}
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == (3, 1, 256) and a.tobytes() == b.tobytes(), f"step {step}"


def test_prefetch_on_the_async_client_and_on_a_closed_client(server: RunningServer) -> None:
    spec = posenc.Spec("rotary", head_dim=64)

    async def main() -> list[str]:
        calls: list[str] = []
        counters = [AsyncUnaryCounter(calls), AsyncStreamCounter(calls)]
        async with posenc.AsyncClient(server.target, interceptors=counters) as client:
            client.prefetch([9, 20], spec)  # not awaited: it returns at once
            rows = await client.get_positions([20, 9], spec)
            direct = await client.get_range(9, 21, spec)
            assert rows.tobytes() == direct[[11, 0]].tobytes()
        with pytest.raises(posenc.ClientClosedError):
            client.prefetch([1], spec)
        return calls

    # The prefetch and the range: get_positions waited for the prefetch.
    assert len(asyncio.run(main())) == 2
    client = posenc.Client(server.target)
    client.close()
    with pytest.raises(posenc.ClientClosedError):
        client.prefetch([1], spec)
