"""The SDK's sans-I/O core (``posenc._core``) driven by a scripted fake, without a server.

Every SDK call is a generator of operations (make this unary call, open this stream, read its
next chunk, sleep, wait, deliver, read ahead). These tests perform the operations themselves,
as the clients do, against a fake that answers from a script: which calls fail, where a
stream breaks, what the "server" says about its limits. They check what the core decides —
the unary-or-stream choice, resumption after an interruption, retries and their budget,
read-ahead — in milliseconds, and every decision is visible in the fake's log of requests.

The fake's rows are identifiable rather than numeric: row ``p`` holds ``p`` in every column,
so a result shows which positions it holds and in which order.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest

import posenc
from posenc import _core as core
from posenc._channel import Settings
from posenc._query import range_query
from posenc._rows import RowCache
from posenc.testing import Status
from posenc.types import DEFAULT
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.wire import SharedView, decode_tensor_response

WIDTH = 8  # columns of the fake's table (d_model 8)
ROW_BYTES = WIDTH * 4


def _positions_of(request: Any) -> list[int]:
    selection = request.WhichOneof("selection")
    if selection == "range":
        return list(range(request.range.start, request.range.stop))
    assert selection == "positions", selection
    return list(request.positions.positions)


def _tensor(positions: list[int], offset: int = 0) -> pb.Tensor:
    rows = np.repeat(np.asarray(positions, dtype="<f4")[:, None], WIDTH, axis=1)
    return pb.Tensor(
        dtype=pb.DTYPE_FLOAT32,
        row_offset=offset,
        rows=len(positions),
        columns=WIDTH,
        data=rows.tobytes(),
    )


@dataclass
class FakeStream:
    """A StreamEncoding call: its chunks, then an error (``fail``) or the end."""

    chunks: Iterator[Any]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Fake:
    """The scripted "server": answers each operation, logging what was asked.

    ``unary_failures`` and ``stream_failures`` are consumed one per call: an error to raise
    (for a stream: ``(rows to send first, error)``), or None for a call that succeeds.
    """

    chunk_rows: int = 4
    unary_failures: list[grpc.RpcError | None] = field(default_factory=list)
    stream_failures: list[tuple[int, grpc.RpcError] | None] = field(default_factory=list)
    log: list[tuple[str, Any]] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    ahead: list[Any] = field(default_factory=list)
    #: The server's shared memory (a unix: target's), when it offers one.
    pool: bytearray | None = None

    def perform(self, operation: core.Operation) -> Any:
        match operation:
            case core.ShareSession():
                self.log.append(("session", self.pool is not None))
                return None if self.pool is None else b"token"
            case core.Unary(method="get_encoding_shared", request=request):
                positions = _positions_of(request)
                self.log.append(("shared", positions))
                assert self.pool is not None and request.shared_memory_session == b"token"
                rows = _tensor(positions).data
                offset = 4096  # the server places the rows where it likes, at a page
                self.pool[offset : offset + len(rows)] = rows
                return SharedView(pb.DTYPE_FLOAT32, len(positions), WIDTH, offset, lease=7)
            case core.Attach(shared=shared, dtype=dtype):
                self.log.append(("attach", shared.lease))
                assert self.pool is not None
                size = shared.rows * shared.columns * dtype.itemsize
                view = np.frombuffer(bytes(self.pool), dtype, size // dtype.itemsize, shared.offset)
                return view.reshape(shared.rows, shared.columns)
            case core.CopyShared(shared=shared, out=out):
                self.log.append(("copy", shared.lease))
                assert self.pool is not None
                out.reshape(-1).view(np.uint8)[...] = self.pool[
                    shared.offset : shared.offset + out.nbytes
                ]
                return None
            case core.Unary(method="get_encoding", request=request):
                self.log.append(("unary", _positions_of(request)))
                if self.unary_failures and (error := self.unary_failures.pop(0)) is not None:
                    raise error
                message = pb.GetEncodingResponse(tensor=_tensor(_positions_of(request)))
                return decode_tensor_response(message.SerializeToString())
            case core.Unary(method=method):
                raise AssertionError(f"unexpected unary call {method}")
            case core.OpenStream(request=request):
                positions = _positions_of(request)
                self.log.append(("stream", positions))
                failure = self.stream_failures.pop(0) if self.stream_failures else None
                stream = FakeStream(self._chunks(positions, failure))
                self.streams.append(stream)
                return core.Stream(stream)
            case core.NextChunk(call=call):
                return next(call.call.chunks, None)
            case core.Sleep(seconds=seconds):
                self.sleeps.append(seconds)
                return None
            case core.Wait(tokens=tokens):
                return futures.wait(tokens, timeout=0)
            case core.ReadAhead(ahead=ahead):
                self.ahead.append(ahead)
                return None
            case core.Deliver():
                raise AssertionError("drivers hand Deliver to their caller")
        raise AssertionError(f"unknown operation {operation!r}")

    def _chunks(
        self, positions: list[int], failure: tuple[int, grpc.RpcError] | None
    ) -> Iterator[Any]:
        stop = len(positions) if failure is None else failure[0]
        for first in range(0, stop, self.chunk_rows):
            part = positions[first : min(first + self.chunk_rows, stop)]
            message = pb.StreamEncodingResponse(chunk=_tensor(part, first))
            yield decode_tensor_response(message.SerializeToString())
        if failure is not None:
            raise failure[1]


def run(fake: Fake, steps: core.Steps[Any]) -> tuple[Any, list[core.Slice]]:
    """Drives ``steps`` against ``fake`` as the blocking client does: the result, and the
    slices an iterator delivered."""
    delivered: list[core.Slice] = []
    with core.Stepper(steps) as stepper:
        for operation in stepper:
            if isinstance(operation, core.Deliver):
                delivered.append(operation.slice)
            else:
                try:
                    outcome = fake.perform(operation)
                except grpc.RpcError as error:
                    outcome = error
                stepper.send(outcome)
        return stepper.result, delivered


def make_core(
    *,
    target: str = "127.0.0.1:1",
    unary_max_bytes: int = 64 * ROW_BYTES,
    max_retries: int = 3,
    row_cache_bytes: int = 0,
    readahead_bytes: int = 0,
) -> core.Core:
    settings = Settings.create(
        target,
        timeout=None,
        max_retries=max_retries,
        retry_backoff=0.0,
        chunk_bytes=None,
        unary_max_bytes=unary_max_bytes,
        connections=1,
        options=None,
    )
    return core.Core(settings, RowCache(row_cache_bytes, readahead_bytes), futures.Future)


def get_range(c: core.Core, start: int, stop: int) -> core.Steps[Any]:
    return c.get_range(start, stop, WIDTH, None, {}, DEFAULT)


def iter_range(c: core.Core, start: int, stop: int, chunk_bytes: int | None) -> core.Steps[None]:
    """An ``iter_range`` of ``WIDTH`` rows, as the clients make it (checked now)."""
    return c.iterate(range_query, (start, stop, WIDTH, None, {}), chunk_bytes, DEFAULT, None)


def expected(positions: list[int]) -> np.ndarray[Any, Any]:
    return np.repeat(np.asarray(positions, dtype=np.float32)[:, None], WIDTH, axis=1)


UNAVAILABLE = Status(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer")
TOO_LARGE = Status(grpc.StatusCode.RESOURCE_EXHAUSTED, "over the unary limit: stream it")


def test_a_small_range_is_one_unary_call() -> None:
    fake = Fake()
    result, _ = run(fake, get_range(make_core(), 10, 20))
    assert fake.log == [("unary", list(range(10, 20)))]
    np.testing.assert_array_equal(result, expected(list(range(10, 20))))


def test_a_range_over_the_unary_limit_streams() -> None:
    fake = Fake()
    result, _ = run(fake, get_range(make_core(unary_max_bytes=4), 0, 50))
    assert fake.log == [("stream", list(range(50)))]
    np.testing.assert_array_equal(result, expected(list(range(50))))


def test_a_server_with_a_lower_unary_limit_gets_a_stream() -> None:
    # RESOURCE_EXHAUSTED without a retry delay: the request is over the server's limit,
    # which is below the client's; the same rows come by stream, with no retry counted.
    fake = Fake(unary_failures=[TOO_LARGE])
    result, _ = run(fake, get_range(make_core(), 0, 30))
    assert [kind for kind, _ in fake.log] == ["unary", "stream"]
    assert fake.sleeps == []
    np.testing.assert_array_equal(result, expected(list(range(30))))


def test_an_interrupted_stream_resumes_from_the_last_row_received() -> None:
    fake = Fake(stream_failures=[(12, UNAVAILABLE), (8, UNAVAILABLE)])
    result, _ = run(fake, get_range(make_core(unary_max_bytes=4), 100, 140))
    assert fake.log == [
        ("stream", list(range(100, 140))),
        ("stream", list(range(112, 140))),  # 12 rows arrived
        ("stream", list(range(120, 140))),  # 8 more
    ]
    assert len(fake.sleeps) == 2
    assert all(stream.cancelled for stream in fake.streams)
    np.testing.assert_array_equal(result, expected(list(range(100, 140))))


def test_an_iterator_delivers_each_row_once_across_a_resume() -> None:
    fake = Fake(stream_failures=[(6, UNAVAILABLE)])
    c = make_core()
    _, slices = run(fake, iter_range(c, 0, 20, None))
    labels = [label for label, _ in slices]
    rows = np.concatenate([rows for _, rows in slices])
    assert labels == [0, 4, 6, 10, 14, 18]
    np.testing.assert_array_equal(rows, expected(list(range(20))))


def test_transient_failures_are_retried_within_the_budget() -> None:
    fake = Fake(unary_failures=[UNAVAILABLE, UNAVAILABLE])
    result, _ = run(fake, get_range(make_core(max_retries=2), 0, 4))
    assert len(fake.log) == 3 and len(fake.sleeps) == 2
    np.testing.assert_array_equal(result, expected([0, 1, 2, 3]))


def test_a_budget_spent_raises_the_mapped_error() -> None:
    fake = Fake(unary_failures=[UNAVAILABLE] * 3)
    with pytest.raises(posenc.UnavailableError, match="after 3 attempts"):
        run(fake, get_range(make_core(max_retries=2), 0, 4))
    assert len(fake.log) == 3


def test_a_bad_request_is_not_retried() -> None:
    bad = Status(grpc.StatusCode.INVALID_ARGUMENT, "spec.sinusoidal.d_model: too large")
    fake = Fake(unary_failures=[bad])
    with pytest.raises(posenc.InvalidArgumentError, match="d_model"):
        run(fake, get_range(make_core(), 0, 4))
    assert len(fake.log) == 1 and fake.sleeps == []


def test_a_stream_that_fails_after_its_last_row_is_complete() -> None:
    fake = Fake(stream_failures=[(20, UNAVAILABLE)])
    result, _ = run(fake, get_range(make_core(unary_max_bytes=4), 0, 20))
    assert len(fake.log) == 1 and fake.sleeps == []
    np.testing.assert_array_equal(result, expected(list(range(20))))


def test_a_decode_loop_reads_ahead_and_then_takes_rows_from_its_cache() -> None:
    # A sequence moving forward: the core asks for rows beyond the step's own (read
    # ahead), and a later step that finds them held makes no call at all.
    c = make_core(row_cache_bytes=1 << 20, readahead_bytes=64 * ROW_BYTES)
    fake = Fake()

    def step(position: int) -> np.ndarray[Any, Any]:
        result, _ = run(fake, c.get_positions([position], WIDTH, None, {}, -1, DEFAULT))
        for job in fake.ahead:  # the client's background read-ahead, run to its end
            for ahead in c.aheads(job):
                rows, _ = run(fake, c.fetch_ahead(ahead))
                c.finish_ahead(ahead, rows)
        fake.ahead.clear()
        return result  # type: ignore[no-any-return]

    for position in range(1000, 1004):
        np.testing.assert_array_equal(step(position), expected([position]))
    calls = len(fake.log)
    asked = {p for _, positions in fake.log for p in positions}
    assert {1004, 1005, 1006} <= asked, "the rows after the sequence's were fetched ahead"
    for position in range(1004, 1007):
        np.testing.assert_array_equal(step(position), expected([position]))
    assert len(fake.log) == calls, "held rows were fetched again"


def test_a_closed_core_refuses_calls() -> None:
    c = make_core()
    c.closed = True
    with pytest.raises(posenc.ClientClosedError):
        run(Fake(), get_range(c, 0, 4))
    with pytest.raises(posenc.ClientClosedError):  # an iterator's, when it is made
        iter_range(c, 0, 4, None)


def test_a_unix_targets_range_travels_through_the_servers_shared_memory() -> None:
    # The core asks the driver for the region-socket session, sends its token with the
    # request, and copies the rows the server placed (ending their lease), or, with
    # copy=False, hands back the mapped rows themselves.
    fake = Fake(pool=bytearray(1 << 16))
    c = make_core(target="unix:/run/posenc/posenc.sock")
    assert c.settings.shared_memory == "/run/posenc/posenc.sock.shm"
    result, _ = run(fake, get_range(c, 100, 300))
    np.testing.assert_array_equal(result, expected(list(range(100, 300))))
    assert result.flags.writeable
    assert fake.log == [("session", True), ("shared", list(range(100, 300))), ("copy", 7)]
    fake.log.clear()
    view, _ = run(fake, c.get_range(0, 20, WIDTH, None, {}, DEFAULT, copy=False))
    np.testing.assert_array_equal(view, expected(list(range(20))))
    assert not view.flags.writeable
    assert fake.log == [("session", True), ("shared", list(range(20))), ("attach", 7)]


def test_without_a_session_a_unix_targets_range_travels_as_over_tcp() -> None:
    fake = Fake()  # the server offers no shared memory (or refused this process)
    c = make_core(target="unix:/run/posenc/posenc.sock", unary_max_bytes=4)
    result, _ = run(fake, get_range(c, 0, 50))
    np.testing.assert_array_equal(result, expected(list(range(50))))
    assert fake.log[0] == ("session", False) and fake.log[-1][0] == "stream"
    # Position lists (decode steps) never ask for shared memory.
    fake.log.clear()
    rows, _ = run(fake, c.get_positions([3, 4], WIDTH, None, {}, -1, DEFAULT))
    np.testing.assert_array_equal(rows, expected([3, 4]))
    assert fake.log == [("stream", [3, 4])]


def test_a_call_moves_through_the_phases_of_the_core_s_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A range refused as too large for a unary call, then streamed, interrupted and
    # resumed: each move is one the table lists (a move it does not list is a bug).
    moves: list[core.Phase] = []
    move = core.CallBudget.move

    def recorded(budget: core.CallBudget, phase: core.Phase) -> None:
        assert phase in core.MOVES[budget.phase], (budget.phase, phase)
        moves.append(phase)
        move(budget, phase)

    monkeypatch.setattr(core.CallBudget, "move", recorded)
    fake = Fake(unary_failures=[TOO_LARGE], stream_failures=[(12, UNAVAILABLE)])
    result, _ = run(fake, get_range(make_core(), 0, 30))
    np.testing.assert_array_equal(result, expected(list(range(30))))
    assert moves == [
        core.Phase.CALLING,
        core.Phase.STREAMING,
        core.Phase.BACKING_OFF,
        core.Phase.STREAMING,
    ]
    assert set(core.MOVES) == set(core.Phase)


def test_a_claim_of_several_windows_is_one_stream_whose_windows_land_one_by_one() -> None:
    # Steps too large for more than a row a window: the claim's windows go as one stream,
    # and each joins the cache as its rows arrive, even when the stream then fails.
    c = make_core(row_cache_bytes=1 << 20, readahead_bytes=8 * ROW_BYTES)
    fake = Fake(chunk_rows=8, stream_failures=[(16, UNAVAILABLE)])
    starts = np.arange(8, dtype=np.int64) * 1000 + 5000
    for t in range(2):
        run(fake, c.get_positions(starts + t, WIDTH, None, {}, -1, DEFAULT))
    (job,) = fake.ahead
    aheads = c.aheads(job)
    assert len(aheads) > 2 and all(ahead.query.rows == 8 for ahead in aheads)
    fake.log.clear()
    result, _ = run(fake, c.fetch_aheads(aheads))
    assert result is None and [kind for kind, _ in fake.log] == ["stream"]
    assert [ahead.token.done() for ahead in aheads] == [True] * len(aheads)
    assert c.rows.in_flight == 0
    # The two windows that arrived before the failure are cached; the rest are not.
    for ahead, held in zip(aheads, [True, True] + [False] * (len(aheads) - 2), strict=True):
        assert ahead.query.positions is not None
        assert (c.rows.lookup(job.query.spec_key, ahead.query.positions) is not None) == held


def test_an_iterator_is_planned_when_made_and_streams_its_plan() -> None:
    # Its arguments and chunk size are checked when it is made, before any operation; its
    # steps then open the stream its plan describes.
    c = make_core()
    with pytest.raises(posenc.InvalidArgumentError):
        iter_range(c, 0, 8, 0)
    steps = iter_range(c, 0, 8, 4096)
    operation = next(steps)
    assert isinstance(operation, core.OpenStream)
    assert operation.request.max_chunk_bytes == 4096
    assert operation.request.range.start == 0 and operation.request.range.stop == 8
    steps.close()
    _, slices = run(Fake(), iter_range(c, 0, 8, None))
    np.testing.assert_array_equal(
        np.concatenate([rows for _, rows in slices]), expected(list(range(8)))
    )
