"""Everything a client call does except its I/O, once for ``Client`` and ``AsyncClient``.

Each SDK call is a generator of this module (sans-I/O): it yields operations — make this
unary call, open this stream, read its next chunk, sleep, wait for these read-ahead tokens,
hand this slice to the caller, start this read-ahead — and the client performs each one
(blocking, or awaited; the ones that neither wait nor call once, in its base), sending
its outcome back in: a value, or the ``grpc.RpcError`` that :class:`Stepper` throws into
the steps. The unary-or-stream choice, stream resume, the deadline and retries
and the read-ahead bookkeeping are written here only, on a query that :mod:`posenc._query`
made of the call's arguments and whose requests :mod:`posenc._cursor` writes; the clients
hold a driver of a few lines and the operations' I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import random
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeAlias, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health_pb2

from posenc._channel import Settings
from posenc._cursor import StreamCursor, decode_unary
from posenc._output import Output, as_tensor, cos_sin_halves
from posenc._query import (
    WIDTHS_KEPT,
    Plan,
    Query,
    Widths,
    affinity,
    join_positions,
    parts,
    positions_plan,
    positions_query,
    range_plan,
    stream_plan,
    unary_request,
)
from posenc._retry import (
    MAX_RETRY_BACKOFF,
    is_transient,
    map_rpc_error,
    nobody_there,
    resolve_timeout,
)
from posenc._rows import (
    MAX_CACHED_CALL_ROWS,
    AheadClaim,
    AheadFetch,
    Pending,
    RowCache,
    RowPlan,
)
from posenc.errors import (
    ClientClosedError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from posenc.types import DEFAULT, DTypeArg, ServerInfo, Timeout, server_info_from_proto
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.wire import SharedView, TensorView

log = logging.getLogger("posenc")

T = TypeVar("T")
Rows: TypeAlias = npt.NDArray[Any]
#: What a table method returns: a numpy array, a ``torch.Tensor``, or a ``(cos, sin)`` pair of
#: either (see :mod:`posenc._output`).
Result: TypeAlias = Any
#: What iterators yield: the label of the first row (a position, or an index into the
#: positions), and the rows (a numpy array, or a tensor when the call asked for tensors).
Slice: TypeAlias = tuple[int, Any]
# The classic table's keyword options, as a table method received them.
Classic: TypeAlias = Mapping[str, object]


# -- operations: what a call asks its client to do --------------------------------------------


@dataclass(frozen=True, slots=True)
class Unary:
    """Make the unary call ``method`` (an attribute of :class:`posenc._channel.Calls`);
    the response is sent back. Calls of equal ``affinity`` go over one connection (see
    :class:`posenc._channel.Pool`); None: the next one."""

    method: str
    request: Any
    timeout: float | None
    affinity: int | None = None


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Start a StreamEncoding call over the connection ``affinity`` keeps (as for
    :class:`Unary`); a :class:`Stream` is sent back."""

    request: pb.StreamEncodingRequest
    timeout: float | None
    affinity: int | None = None


@dataclass(frozen=True, slots=True)
class Stream:
    """A StreamEncoding call, as the client made it."""

    call: Any

    def cancel(self) -> None:
        self.call.cancel()


@dataclass(frozen=True, slots=True)
class NextChunk:
    """Read the next response of ``call`` (a :class:`Stream`); None is sent back at its
    end."""

    call: Stream


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep before a retry."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait (at most ``timeout``) for read-ahead ``tokens``, the client's futures."""

    tokens: tuple[Any, ...]
    timeout: float | None


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand ``slice``, ``(label, rows)``, to the caller of an iterator."""

    slice: Slice


@dataclass(frozen=True, slots=True)
class ReadAhead:
    """In the background (a thread, a task): for each fetch of :meth:`Core.aheads` of
    ``ahead``, run :meth:`Core.fetch_ahead`, then :meth:`Core.finish_ahead`."""

    ahead: AheadFetch | AheadClaim


@dataclass(frozen=True, slots=True)
class ShareSession:
    """Open the client's session on the server's region socket, or take the one open:
    its token is sent back, or None when the server's shared memory is out of reach (see
    :mod:`posenc._shm`)."""


@dataclass(frozen=True, slots=True)
class Attach:
    """Map the rows that ``shared`` says the server placed in its shared memory, read-only,
    as ``dtype``: their array is sent back (its lease ends with the last array using it)."""

    shared: SharedView
    dtype: np.dtype[Any]


@dataclass(frozen=True, slots=True)
class CopyShared:
    """Copy the rows that ``shared`` says the server placed in its shared memory into
    ``out``, and end their lease."""

    shared: SharedView
    out: Rows


#: The operations both clients perform alike, without waiting (see ``BaseClient._local``).
Local: TypeAlias = ReadAhead | ShareSession | Attach | CopyShared
#: The operations a client performs (all but :class:`Deliver`, which its iterator yields).
Performed: TypeAlias = Unary | OpenStream | NextChunk | Sleep | Wait | Local
Operation: TypeAlias = Performed | Deliver
Steps: TypeAlias = Generator[Operation, Any, T]


class Stepper(Generic[T]):
    """Runs the steps of one call for a driver: :meth:`next` gives the next operation,
    after :meth:`send` told the outcome of the last (its value, or its ``grpc.RpcError``);
    None once the call returned (its value is :attr:`result`). Closing it closes the steps,
    which cancels a stream left open."""

    def __init__(self, steps: Steps[T], first: Operation | None = None) -> None:
        """``first``: the operation the steps yielded already (they were started by their
        core), which iterating begins with."""
        self._steps = steps
        self._value: Any = None
        self._error: BaseException | None = None
        self._started = first is not None
        self._first: Operation | None = first
        self.result: T

    def start(self) -> Stepper[T]:
        """Runs the first step now (which checks the call's arguments, and raises for a bad
        one); iterating then begins with its operation."""
        self._first, self._started = self.next(), True
        return self

    def next(self) -> Operation | None:
        error, self._error = self._error, None
        try:
            if error is not None:
                return self._steps.throw(error)
            return self._steps.send(self._value)
        except StopIteration as stop:
            self.result = stop.value
            return None

    def __iter__(self) -> Iterator[Operation]:
        if self._started:
            self._started = False
            if self._first is None:
                return
            yield self._first
        while (operation := self.next()) is not None:
            yield operation

    def send(self, value: object) -> None:
        """The outcome of the last operation: its value, or the ``grpc.RpcError`` it failed
        with, which is thrown into the steps (as :meth:`throw`)."""
        if isinstance(value, grpc.RpcError):
            self.throw(value)
        else:
            self._value = value

    def throw(self, error: BaseException) -> None:
        """Throws ``error`` into the steps at their next step."""
        self._value, self._error = None, error

    def __enter__(self) -> Stepper[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the steps (a stream left open is cancelled)."""
        self._steps.close()


# -- the deadline and retries of a call --------------------------------------------------------

# A unary call's outcome not given: the steps make the call (see Core._call).
_NOT_MADE: Any = object()


class Phase(enum.Enum):
    """Where a call is between its operations (see ``MOVES``)."""

    PLANNED = "planned"  # its plan built, nothing asked yet
    CALLING = "calling"  # a unary call made (or a shared-memory one), its response awaited
    STREAMING = "streaming"  # a stream open, its chunks read
    BACKING_OFF = "backing off"  # a transient failure: sleeping before the next attempt
    WAITING = "waiting"  # its rows on their way in the background: waiting for them


#: Every phase a call may move to from each phase, in one table: the core's steps move a
#: call's budget (``CallBudget.move``) before each operation they yield, and a move not
#: listed here is a bug of the steps (InternalError). A call ends from any phase: its steps
#: return the result, or raise.
MOVES: Final[Mapping[Phase, frozenset[Phase]]] = {
    # cached rows need nothing; rows fetched ahead are waited for; else a call, or a stream
    Phase.PLANNED: frozenset({Phase.CALLING, Phase.STREAMING, Phase.WAITING}),
    # the next part of a long list, the caller's own call after a refused read-ahead, a
    # shared-memory call then the unary one; a unary result too large: a stream instead
    Phase.CALLING: frozenset({Phase.CALLING, Phase.STREAMING, Phase.BACKING_OFF}),
    # resumed, split, or the next part of a long list (streamed, or one unary call)
    Phase.STREAMING: frozenset({Phase.STREAMING, Phase.CALLING, Phase.BACKING_OFF}),
    Phase.BACKING_OFF: frozenset({Phase.CALLING, Phase.STREAMING}),
    # the rows waited for landed (or not: the call fetches them itself)
    Phase.WAITING: frozenset({Phase.CALLING, Phase.STREAMING}),
}


class Contact:
    """Whether a server of this client's target has ever answered it.

    A refused connection is retried within the call's budget either way (a new client may
    start while its server restarts); once the budget is spent, a target that never answered
    is said to have no server ("is it running?") rather than only UNAVAILABLE. A name that
    does not resolve, at a target that never answered, is said at once.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self.answered = False


class CallBudget:
    """Deadline and retries of one SDK call, shared by all its attempts.

    The timeout bounds the whole call, retries and resumed streams included: each attempt
    gets what remains of it. Only transient failures are retried (see :func:`is_transient`);
    the other codes say retrying the same request would fail the same way (or, for
    DEADLINE_EXCEEDED, too late).
    """

    def __init__(
        self,
        timeout: float | None,
        max_retries: int,
        backoff: float,
        contact: Contact,
        deadline: float | None = None,
    ) -> None:
        self.timeout = timeout
        self._contact = contact
        if deadline is None and timeout is not None:
            deadline = time.monotonic() + timeout
        self._deadline = deadline
        self._max_retries = max_retries
        self._backoff = backoff
        self._failures = 0  # consecutive failed attempts without progress
        self.phase = Phase.PLANNED

    def move(self, phase: Phase) -> None:
        """The call moves to ``phase`` (see ``MOVES``)."""
        if phase not in MOVES[self.phase]:
            raise InternalError(f"a call cannot move from {self.phase.value} to {phase.value}")
        self.phase = phase

    def attempt_timeout(self) -> float | None:
        """The timeout of the next attempt: what remains of the call's deadline."""
        if self._deadline is None:
            return None
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError(f"deadline of {self.timeout} s exceeded")
        return remaining

    def progress(self) -> None:
        """A server answered: a stream that keeps moving gets its full retry budget again."""
        self._failures = 0
        self._contact.answered = True

    def on_error(self, error: grpc.RpcError) -> float:
        """Returns how long to sleep before retrying, or raises the mapped exception."""
        mapped = map_rpc_error(error)
        nobody, at_once = (
            (None, False)
            if self._contact.answered
            else nobody_there(mapped, self._contact.target, self._failures)
        )
        if nobody is not None and (at_once or self._failures >= self._max_retries):
            raise nobody from error
        if not is_transient(mapped) or self._failures >= self._max_retries:
            if self._failures:
                mapped.details += f" (after {self._failures + 1} attempts)"
            try:
                raise mapped from error
            finally:
                # Else this frame holds the exception whose traceback holds the frame: a
                # cycle that keeps the call's frames, and its result, until a collection.
                del mapped
        delay = min(MAX_RETRY_BACKOFF, self._backoff * 2.0**self._failures)
        delay = max(delay, mapped.retry_after or 0.0)
        # Jitter upwards only, so the documented budget stays a lower bound, while
        # clients that failed together do not all come back in the same millisecond.
        delay *= 1.0 + 0.2 * random.random()
        if self._deadline is not None and time.monotonic() + delay >= self._deadline:
            if nobody is not None:
                raise nobody from error
            raise DeadlineExceededError(
                f"deadline of {self.timeout} s exceeded while retrying: {mapped}"
            ) from error
        self._failures += 1
        log.info(
            "retrying in %.2f s (retry %d of %d): %s",
            delay,
            self._failures,
            self._max_retries,
            mapped,
        )
        return delay


def _complete(token: Any) -> None:
    """Wake whoever waits for a fetch's ``token`` (a client's future)."""
    if not token.done():
        token.set_result(None)


def _over_a_limit(error: grpc.RpcError) -> bool:
    """RESOURCE_EXHAUSTED without a retry delay: the request is over a size limit (with one,
    the server is busy, and the retry budget handles it)."""
    mapped = map_rpc_error(error)
    return mapped.code == grpc.StatusCode.RESOURCE_EXHAUSTED and mapped.retry_after is None


# -- the calls ---------------------------------------------------------------------------------

# Decode-step argument forms remembered (see Core.cached): more tables than a loop uses.
_FORMS_KEPT = 64


class _Form:
    """What the ``table`` and ``dtype`` of a decode step mean, found by its steps: the spec's
    key and query (for read-ahead claims), and the result's form. It holds ``table``, so the
    object's id, its key, names no other object while it is kept."""

    __slots__ = ("key", "query", "rotary", "table", "tensor")

    def __init__(self, table: object, key: bytes, query: Query, tensor: bool, rotary: bool):
        self.table = table
        self.key = key
        self.query = query
        self.tensor = tensor
        self.rotary = rotary


class Core:
    """The steps of every SDK call, on a client's settings, row cache and known widths.

    The steps of a call that returns a result (``get_range``, ``get_positions``, ...)
    check its arguments at their first step, which the client runs at once; an iterator's
    (``iter_range``, ...) are checked when it is made, before its first slice is asked for.
    ``new_token`` makes the futures that read-ahead tokens are.
    """

    def __init__(self, settings: Settings, rows: RowCache, new_token: Callable[[], Any]) -> None:
        self.settings = settings
        self.rows = rows
        self.widths = Widths()
        self._new_token = new_token
        self._contact = Contact(settings.target)
        # Set by the clients' close(); every call starts at budget(), so one check refuses all.
        self.closed = False
        # What the arguments of decode steps were found to mean (see cached()).
        self._forms: dict[tuple[Any, ...], _Form] = {}

    def check_open(self) -> None:
        """ClientClosedError once the client is closed (every call starts here)."""
        if self.closed:
            raise ClientClosedError()

    def budget(self, timeout: Timeout, *, retry: bool = True) -> CallBudget:
        """The deadline and retry budget of one call (every call starts with it)."""
        self.check_open()
        return CallBudget(
            resolve_timeout(timeout, self.settings.timeout),
            self.settings.max_retries if retry else 0,
            self.settings.retry_backoff,
            self._contact,
        )

    # -- the decode step's fast path

    def cached(
        self, positions: object, table: object, dtype: object, cos_sin: object
    ) -> tuple[Result, AheadClaim | None] | None:
        """A ``get_positions`` whose rows the row cache holds, answered before anything else
        is built: its result, and the read-ahead claim that is due, if one is. None when the
        call must take its steps (:meth:`get_positions`): another form of arguments, a row
        missing, the client closed.

        The arguments are not checked again: an earlier call of the same ``table`` object
        and ``dtype`` took its steps and recorded what they mean (its spec, its result's
        form); numpy arrays and lists of int positions are read here as those steps read
        them. A decode step then costs a few numpy calls: no plan, no query, no lock.
        """
        try:
            form = self._forms.get(
                (table, dtype) if type(table) is int else (id(table), dtype, None)
            )
        except TypeError:  # an unhashable dtype argument: the steps say what is wrong with it
            return None
        if form is None or self.closed or (type(table) is not int and form.table is not table):
            return None
        if type(cos_sin) is not bool:
            return None
        # Positions as the steps would read them: a numpy array or a list of signed
        # integers (unsigned may not fit; floats and objects: the steps judge them).
        if type(positions) is np.ndarray:
            array = positions
        elif type(positions) is list:
            array = np.asarray(positions)
        else:
            return None
        if array.dtype != np.int64:
            if array.dtype.kind != "i":
                return None
            array = array.astype(np.int64)
        flat = array.reshape(-1)
        if not 0 < flat.size <= MAX_CACHED_CALL_ROWS or (cos_sin and not form.rotary):
            return None  # (cos_sin of a table not rotary: the steps say so)
        found = self.rows.lookup(form.key, flat)
        if found is None:
            return None
        rows, due = found
        result: Result = rows if array.ndim == 1 else rows.reshape(*array.shape, rows.shape[1])
        if form.tensor:
            result = as_tensor(result)
        if cos_sin:
            result = cos_sin_halves(result)
        if not due:
            return result, None
        query = dataclasses.replace(
            form.query, rows=flat.size, positions=flat.copy(), columns=rows.shape[1]
        )
        return result, AheadClaim(query)

    def _remember(self, table: object, dtype: object, query: Query, result: Output) -> None:
        """Records what a decode step's ``table`` and ``dtype`` mean, for :meth:`cached`: when
        its rows may be cached and its result is a new array (or tensor) of the rows."""
        if query.axes > 1 or result.out is not None or result.device is not None:
            return
        try:
            key = (table, dtype) if type(table) is int else (id(table), dtype, None)
        except TypeError:
            return
        if key in self._forms:
            return
        if len(self._forms) >= _FORMS_KEPT:
            self._forms.clear()
        rotary = query.spec.WhichOneof("table") in ("rotary", "mrope")
        template = dataclasses.replace(query, positions=None, out=None, view=False)
        self._forms[key] = _Form(table, query.spec_key, template, result.tensor, rotary)

    # -- planned calls (see posenc._query.Plan)

    def finish(self, plan: Plan, outcome: object) -> tuple[bool, Any]:
        """A planned call whose GetEncoding call the driver made: ``outcome`` is its
        response, or the ``grpc.RpcError`` it failed with. ``(True, result)`` when that
        settles the call; else ``(False, stepper)``, the steps that go on (a retry, a stream
        instead), started: the driver performs their operations from the stepper's first."""
        steps = self._planned(plan, outcome)
        try:
            operation = next(steps)
        except StopIteration as stop:
            return True, stop.value
        return False, Stepper(steps, operation)

    def planned(self, plan: Plan) -> Steps[Result]:
        """The steps of a planned call that makes no call first (``plan.request`` None)."""
        return self._planned(plan, _NOT_MADE)

    def _plan_budget(self, plan: Plan) -> CallBudget:
        """The retry budget of a planned call, within the timeout and deadline its plan set."""
        return CallBudget(
            plan.timeout,
            self.settings.max_retries,
            self.settings.retry_backoff,
            self._contact,
            plan.deadline,
        )

    def _planned(self, plan: Plan, outcome: object) -> Steps[Result]:
        budget = self._plan_budget(plan)
        if outcome is not _NOT_MADE:
            budget.move(Phase.CALLING)  # the driver made the plan's call
            rows = yield from self._fetch(plan.query, budget, planned=plan, outcome=outcome)
        elif plan.query.positions is not None and plan.query.axes == 1:
            rows = yield from self._through_rows(plan.query, budget)
        else:  # a range, a grid, coordinates (the row cache keys rows by one position)
            rows = yield from self._fetch(plan.query, budget)
        output = plan.output
        if output.plain:  # the rows themselves: no call of the output's module
            return rows if len(output.shape) == 1 else rows.reshape(*output.shape, rows.shape[1])
        return output.finish(rows)

    # -- what the public methods run

    def get_range(
        self,
        start: object,
        stop: object,
        table: object,
        dtype: DTypeArg | None,
        classic: Classic,
        timeout: Timeout,
        **output: Any,
    ) -> Steps[Result]:
        """Rows ``[start, stop)``, handed back as ``output`` (``out``, ``device``,
        ``cos_sin``; see :class:`posenc._output.Output`) says: the steps of its plan, which
        make its call themselves (the clients make a plan's call first: see finish())."""
        return self.planned(range_plan(self, start, stop, table, dtype, classic, timeout, **output))

    def get_positions(
        self,
        positions: npt.ArrayLike,
        table: object,
        dtype: DTypeArg | None,
        classic: Classic,
        coordinate_axis: int,
        timeout: Timeout,
        **output: Any,
    ) -> Steps[Result]:
        """The rows of positions of any shape (coordinates along ``coordinate_axis`` for a
        table of several position axes), one-axis ones through the row cache: the steps of
        its plan."""
        plan = positions_plan(
            self, positions, table, dtype, classic, coordinate_axis, timeout, **output
        )
        if plan.query.axes == 1 and not classic and coordinate_axis == -1:
            self._remember(table, dtype, plan.query, plan.output)
        return self.planned(plan)

    def iterate(
        self,
        made_by: Callable[..., tuple[Query, Output]],
        arguments: tuple[object, ...],
        chunk_bytes: object,
        timeout: Timeout,
        device: Any,
    ) -> Steps[None]:
        """An iterator's slices, of the query ``made_by`` (:func:`posenc._query.range_query`,
        ...) makes of ``arguments`` (see :func:`posenc._query.stream_plan`); arguments are
        checked now."""
        return self.streamed(stream_plan(self, made_by, arguments, chunk_bytes, timeout, device))

    def streamed(self, plan: Plan) -> Steps[None]:
        """The steps of an iterator's plan (:func:`posenc._query.stream_plan`): its slices."""
        cursor = self._cursor(plan.query, plan.chunk_bytes)
        yield from self._stream(cursor, self._plan_budget(plan), plan.output)

    def server_info(self, timeout: Timeout) -> Steps[ServerInfo]:
        return self._server_info(self.budget(timeout))

    def health(self, service: str, timeout: Timeout) -> Steps[str]:
        if not isinstance(service, str):
            raise TypeError(f"service must be a str, got {type(service).__name__}")
        # A probe reports what it sees now: never retried.
        request = health_pb2.HealthCheckRequest(service=service)
        return self._health(request, self.budget(timeout, retry=False))

    def prefetch(
        self, positions: npt.ArrayLike, table: object, dtype: DTypeArg | None, classic: Classic
    ) -> list[AheadFetch]:
        """The background fetches that bring the rows of ``positions`` into the row cache
        (``prefetch``); the client starts each one as a read-ahead."""
        self.check_open()
        query, _ = positions_query(positions, table, dtype, classic, self.widths)
        if query.axes > 1:
            return []  # coordinates bypass the row cache
        return self.rows.claim_prefetch(query, self._new_token)

    def aheads(self, job: AheadFetch | AheadClaim) -> list[AheadFetch]:
        """The fetches of a read-ahead job: itself, or those a decode step's claim calls for
        (claimed here, in the background: the step did not wait for the claim)."""
        if isinstance(job, AheadFetch):
            return [job]
        return self.rows.claim_ahead(job.query, self._new_token)

    def fetch_ahead(self, ahead: AheadFetch) -> Steps[Rows | None]:
        """The steps of a background read-ahead: its rows, or None when it failed."""
        budget = self.budget(DEFAULT, retry=False)
        try:
            return (yield from self._fetch(ahead.query, budget, self._readahead_unary_max))
        except Exception:
            # Nothing is lost: the call that needs these rows fetches them itself, and
            # reports its own errors.
            return None

    def fetch_aheads(self, aheads: list[AheadFetch]) -> Steps[None]:
        """The steps of a read-ahead job's fetches (:meth:`aheads`, nearest rows first), each
        finished (:meth:`finish_ahead`) as soon as its rows land, and the rest when the steps
        end however they end (failed, or closed by a closing client).

        Several fetches go as one stream of their positions, one after the other, chunked
        at the first's size: the nearest window joins the cache, and wakes the step waiting
        for it, while the next ones are still on the wire. A loop that steps faster than the
        wire then waits for one window's rows at a time, not for a call's, and the call's
        fixed cost is paid once for the whole lead.
        """
        finished = 0
        try:
            if len(aheads) == 1:
                rows = yield from self.fetch_ahead(aheads[0])
                finished = 1
                self.finish_ahead(aheads[0], rows)
                return
            ends = np.cumsum([ahead.query.rows for ahead in aheads]).tolist()
            joined = join_positions([ahead.query for ahead in aheads])
            assert joined.row_bytes is not None  # a claim's queries know their width
            cursor = self._cursor(joined, aheads[0].query.rows * joined.row_bytes, collect=True)

            def landed() -> None:
                nonlocal finished
                while finished < len(aheads) and ends[finished] <= cursor.received:
                    start = ends[finished] - aheads[finished].query.rows
                    finished += 1
                    rows = cursor.result()[start : ends[finished - 1]]
                    self.finish_ahead(aheads[finished - 1], rows)

            yield from self._stream(cursor, self.budget(DEFAULT, retry=False), landed=landed)
        except Exception:
            pass  # nothing is lost: a step that needs these rows fetches them itself
        finally:
            for ahead in aheads[finished:]:
                self.finish_ahead(ahead, None)

    def finish_ahead(self, ahead: AheadFetch, rows: Rows | None) -> None:
        """A read-ahead ended (``rows`` None: it failed, or never ran): its rows join the
        cache, and whoever waits for its token is woken."""
        self.rows.finish_ahead(ahead, rows)
        _complete(ahead.token)

    @staticmethod
    def _landed(plan: RowPlan) -> None:
        """A call's own fetch ahead ended (stored, failed or abandoned): its rows are no
        longer in flight, and calls waiting for them are woken."""
        plan.release()
        _complete(plan.token)

    # -- the steps

    def _cursor(
        self, query: Query, chunk_bytes: int | None = None, *, collect: bool = False
    ) -> StreamCursor:
        """The stream cursor of ``query``, in chunks of ``chunk_bytes`` (checked: a plan's, or
        the core's own; None: the client's setting)."""
        chunk = self.settings.chunk_bytes if chunk_bytes is None else chunk_bytes
        cursor = StreamCursor(query, chunk, collect=collect)

        def into(columns: int) -> Rows:
            # Learnt before the result is judged: a result refused as too large is refused
            # before any call the next time.
            self.widths.learn(query.spec_key, columns)
            return query.allocate(columns)

        cursor.into = into
        return cursor

    @property
    def _readahead_unary_max(self) -> int:
        # One GetEncoding call even above unary_max_bytes: the server answers position
        # lists from its cached blocks there, which the next steps' rows share.
        return max(self.settings.unary_max_bytes, self.rows.readahead_bytes)

    def _call(
        self,
        method: str,
        request: object,
        budget: CallBudget,
        affinity: int | None = None,
        made: object = _NOT_MADE,
    ) -> Steps[Any]:
        """One unary call, retried on transient failures within the budget. ``made``: the
        outcome of its first attempt, when the driver made it (a plan's call)."""
        while True:
            try:
                if made is _NOT_MADE:
                    budget.move(Phase.CALLING)
                    response = yield Unary(method, request, budget.attempt_timeout(), affinity)
                else:
                    response, made = made, _NOT_MADE
                    if isinstance(response, grpc.RpcError):
                        raise response
            except grpc.RpcError as error:
                delay = budget.on_error(error)
            else:
                budget.progress()
                return response
            budget.move(Phase.BACKING_OFF)
            yield Sleep(delay)

    def _server_info(self, budget: CallBudget) -> Steps[ServerInfo]:
        response = yield from self._call("get_server_info", pb.GetServerInfoRequest(), budget)
        return server_info_from_proto(response)

    def _health(self, request: health_pb2.HealthCheckRequest, budget: CallBudget) -> Steps[str]:
        try:
            response = yield from self._call("health_check", request, budget)
        except NotFoundError:
            return "SERVICE_UNKNOWN"  # an answer: the server knows no such service
        try:
            name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except ValueError:
            return f"UNKNOWN({response.status})"
        return name

    def _fetch(
        self,
        query: Query,
        budget: CallBudget,
        unary_max_bytes: int | None = None,
        planned: Plan | None = None,
        outcome: object = None,
    ) -> Steps[Rows]:
        """A whole table: one unary call when it is small (or empty: the response still
        tells its width), else a stream collected into one array. With ``planned``, the
        plan's GetEncoding call was made already: ``outcome`` is its response, or the
        ``grpc.RpcError`` it failed with.

        Until a response has told the table's width, a call is small when it would be with
        one column: the server refuses a unary result over its limit before computing
        anything, and the call then streams. A decode loop's first step is one unary call.
        """
        if planned is None:
            pieces = parts(query)
            if len(pieces) > 1:
                tables = []
                for part in pieces:
                    tables.append((yield from self._fetch(part, budget, unary_max_bytes)))
                    if len(tables) == 1:
                        query.check_size(tables[0].shape[1])  # the whole, once the width is told
                return np.concatenate(tables)
        unary_max = self.settings.unary_max_bytes if unary_max_bytes is None else unary_max_bytes
        too_large = False  # for a response: the server said so
        if (
            planned is None
            and self.settings.shared_memory is not None
            and query.positions is None
            and query.rows > 0
        ):
            shared = yield from self._shared(query, budget)
            if not isinstance(shared, bool):
                return shared
            too_large = shared
        # A width not known yet counts as one column.
        size = query.rows * (query.columns or 1) * query.dtype.itemsize
        if planned is not None or (not too_large and (query.rows <= 0 or size <= unary_max)):
            try:
                if planned is None:
                    request, calls = unary_request(query), affinity(query)
                    tensor = yield from self._call("get_encoding", request, budget, calls)
                else:
                    assert planned.request is not None, "a plan of a call made"
                    tensor = yield from self._call(
                        "get_encoding", planned.request, budget, planned.affinity, outcome
                    )
                rows = decode_unary(tensor, query)
                if self.widths.get(query.spec_key) != rows.shape[1]:
                    # (a dict: set here rather than by learn(), which a planned call would
                    # enter after its plan left its module)
                    self.widths[query.spec_key] = rows.shape[1]
                    if len(self.widths) > WIDTHS_KEPT:
                        self.widths.trim()
                return rows
            except ResourceExhaustedError:
                if query.rows <= 0:
                    raise
                # The server's unary limit is below ours: stream instead.
        cursor = self._cursor(query, collect=True)
        yield from self._stream(cursor, budget)
        return cursor.result()

    def _shared(self, query: Query, budget: CallBudget) -> Steps[Rows | bool]:
        """A range through the server's shared memory (a ``unix:`` target): one GetEncoding
        call, whose rows the server places in its memory (or, when small or when they do
        not fit there now, sends in the response). False when the session is out of reach
        (the call goes on as over TCP); True when the server could not place the rows and
        they are too large for a response (the call streams them)."""
        budget.move(Phase.CALLING)
        token = yield ShareSession()
        if token is None:
            return False
        request = unary_request(query)
        request.shared_memory_session = token
        try:
            response = yield from self._call(
                "get_encoding_shared", request, budget, affinity(query)
            )
        except ResourceExhaustedError:
            return True  # not placed, and over the unary limit
        if isinstance(response, TensorView):
            rows = decode_unary(response, query)
        else:
            if response.rows != query.rows or response.dtype != query.spec.dtype:
                raise InternalError(
                    f"server placed {response.rows} rows of dtype {response.dtype}, expected "
                    f"{query.rows} of {query.spec.dtype}"
                )
            if query.view:
                rows = yield Attach(response, query.dtype)
            else:
                rows = query.allocate(response.columns)
                yield CopyShared(response, rows)
        self.widths.learn(query.spec_key, rows.shape[1])
        return rows

    def _stream(
        self,
        cursor: StreamCursor,
        budget: CallBudget,
        output: Output | None = None,
        landed: Callable[[], None] | None = None,
    ) -> Steps[None]:
        """The cursor's chunks (delivered unless it collects them; ``landed`` is called after
        each collected one); an interrupted call resumes with the missing rows."""
        collect = cursor.collect
        calls = affinity(cursor.query)
        while True:
            budget.move(Phase.STREAMING)
            call = yield OpenStream(cursor.request(), budget.attempt_timeout(), calls)
            # A stream that resumes takes the next connection: the one that failed may be gone.
            calls = None
            try:
                while (chunk := (yield NextChunk(call))) is not None:
                    label, rows = cursor.accept(chunk)
                    self.widths.learn(cursor.query.spec_key, rows.shape[1])
                    if not collect:
                        assert output is not None, "an iterator's slices have an output"
                        yield Deliver((label, output.slice(rows)))
                    elif landed is not None:
                        landed()
                    budget.progress()
                if cursor.more:
                    continue  # the next part of a long position list
                cursor.check_complete()
                return
            except grpc.RpcError as error:
                if cursor.done:
                    return  # the failure came after the last row: nothing is missing
                if _over_a_limit(error) and cursor.split():
                    continue  # the server's stream limit: ask for the rest in smaller calls
                delay = budget.on_error(error)
            finally:
                # A no-op when the call finished; frees the server's stream when the
                # caller abandoned the iterator or a chunk failed validation.
                call.cancel()
            budget.move(Phase.BACKING_OFF)
            yield Sleep(delay)

    def _through_rows(self, query: Query, budget: CallBudget) -> Steps[Rows]:
        """A positions query, through the row cache (see :mod:`posenc._rows`)."""
        plan = self.rows.plan(query, new_token=self._new_token)
        if isinstance(plan, Pending):  # rows on their way: wait, then take them
            budget.move(Phase.WAITING)
            yield Wait(plan.tokens, budget.attempt_timeout())
            # The fetch waited for may be the first to tell this table's width: the result
            # is judged now, as one whose width was known is when its query is made.
            query = dataclasses.replace(query, columns=self.widths.get(query.spec_key))
            if query.columns is not None:
                query.check_size(query.columns)
            plan = self.rows.plan(query, wait=False, new_token=self._new_token)
        rows = yield from self._rows_of(query, plan, budget)
        if self.rows.cacheable(query):
            # What to fetch next is worked out in the background: not on the step's path.
            yield ReadAhead(AheadClaim(query))
        return rows

    def _rows_of(
        self, query: Query, plan: RowPlan | Pending | None, budget: CallBudget
    ) -> Steps[Rows]:
        if plan is None:
            return (yield from self._fetch(query, budget))
        assert isinstance(plan, RowPlan)
        if plan.fetch is None:
            return plan.result()
        try:
            fetched = yield from self._fetch(plan.fetch, budget, self._readahead_unary_max)
            return plan.result(fetched)
        except (InvalidArgumentError, ResourceExhaustedError):
            # Read-ahead may pass the server's position limit: the server judges the
            # caller's own request (below), and its error names the caller's positions.
            pass
        finally:
            self._landed(plan)  # stored, failed or abandoned: nobody waits for it any more
        return (yield from self._fetch(query, budget))
