"""The asyncio client: :class:`posenc.Client`'s methods, awaitable. As there, only the I/O
is here; the protocol logic is shared in :mod:`posenc._protocol`."""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio
import numpy.typing as npt
from grpc_health.v1 import health_pb2_grpc

from posenc import _protocol as proto
from posenc._protocol import DEFAULT, CallBudget, DTypeArg, Query, ServerInfo, StreamCursor, Timeout
from posenc._rows import (
    DEFAULT_READAHEAD_BYTES,
    DEFAULT_ROW_CACHE_BYTES,
    AheadFetch,
    Pending,
    RowCache,
    RowPlan,
)
from posenc.errors import InvalidArgumentError, ResourceExhaustedError
from posenc.presets import Preset
from posenc.v1 import posenc_pb2 as pb
from posenc.v1 import posenc_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from posenc.v1.posenc_pb2_grpc import PositionalEncodingServiceAsyncStub

__all__ = ["AsyncClient"]

# The name of the tasks that fetch rows ahead in the background.
READ_AHEAD_TASK = "posenc-read-ahead"

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


class AsyncClient:
    """asyncio client of a posenc server (or several, balanced round robin).

    Same constructor arguments, methods and behaviour as :class:`posenc.Client`, with
    ``await`` (and ``async for`` over :meth:`iter_range` / :meth:`iter_positions`). It may
    be created anywhere, but used from one event loop only (its channel is created in the
    loop of the first call)::

        async with posenc.AsyncClient("127.0.0.1:50051") as client:
            table = await client.get_range(0, 8192, 512)
            async for first, rows in client.iter_range(0, 10**7, 512, timeout=None):
                ...

    Cancelling the awaiting task cancels the call (``asyncio.CancelledError`` propagates).
    """

    def __init__(
        self,
        target: str | Sequence[str] = proto.DEFAULT_TARGET,
        *,
        timeout: float | None = proto.DEFAULT_TIMEOUT,
        max_retries: int = proto.DEFAULT_MAX_RETRIES,
        retry_backoff: float = proto.DEFAULT_RETRY_BACKOFF,
        chunk_bytes: int | None = None,
        unary_max_bytes: int = proto.DEFAULT_UNARY_MAX_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        options: Iterable[tuple[str, Any]] | None = None,
        token: str | None = None,
        row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES,
        readahead_bytes: int = DEFAULT_READAHEAD_BYTES,
    ) -> None:
        self._settings = proto.Settings.create(
            target,
            timeout=timeout,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
            chunk_bytes=chunk_bytes,
            unary_max_bytes=unary_max_bytes,
            options=options,
            user_agent=proto.user_agent(),
            token=token,
        )
        self._rows = RowCache(operator.index(row_cache_bytes), operator.index(readahead_bytes))
        self._ahead_tasks: set[asyncio.Task[Any]] = set()
        self._credentials = credentials
        self._channel: grpc.aio.Channel | None = None
        self._stubs: tuple[PositionalEncodingServiceAsyncStub, Any, proto.TableCalls] | None = None
        self._closed = False

    def _connect(self) -> tuple[PositionalEncodingServiceAsyncStub, Any, proto.TableCalls]:
        """The service and health stubs, creating the channel at first use.

        A grpc.aio channel belongs to the event loop it is created in, and clients are often
        built before ``asyncio.run``: creating it in the first call puts it in the right loop.
        """
        if self._closed:
            raise ValueError("the client is closed")
        if self._stubs is None:
            target, options = self._settings.target, self._settings.options
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(target, options)
            else:
                channel = grpc.aio.secure_channel(target, self._credentials, options)
            self._channel = channel
            self._stubs = (
                pb_grpc.PositionalEncodingServiceStub(channel),
                health_pb2_grpc.HealthStub(channel),
                proto.TableCalls(channel),
            )
        return self._stubs

    @property
    def target(self) -> str:
        """The gRPC target the channel connects to."""
        return self._settings.target

    def __repr__(self) -> str:
        return f"AsyncClient({self._settings.target!r})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._closed = True
        for task in list(self._ahead_tasks):
            task.cancel()
        if self._channel is not None:
            await self._channel.close(None)

    # -- tables ---------------------------------------------------------------------------

    async def get_range(
        self,
        start: int,
        stop: int,
        d_model: int | None = None,
        *,
        base: float = 10000.0,
        dtype: DTypeArg = "float32",
        layout: str = "interleaved",
        schedule: str = "paper",
        preset: Preset | None = None,
        timeout: Timeout = DEFAULT,
    ) -> npt.NDArray[Any]:
        """Returns the rows of positions ``[start, stop)``; see :meth:`Client.get_range`."""
        query = proto.range_query(
            start,
            stop,
            d_model,
            base=base,
            dtype=dtype,
            layout=layout,
            schedule=schedule,
            preset=preset,
        )
        return await self._fetch(query, self._budget(timeout))

    async def get_positions(
        self,
        positions: npt.ArrayLike,
        d_model: int | None = None,
        *,
        base: float = 10000.0,
        dtype: DTypeArg = "float32",
        layout: str = "interleaved",
        schedule: str = "paper",
        preset: Preset | None = None,
        timeout: Timeout = DEFAULT,
    ) -> npt.NDArray[Any]:
        """Returns the rows of arbitrary ``positions``; see :meth:`Client.get_positions`."""
        query = proto.positions_query(
            positions,
            d_model,
            base=base,
            dtype=dtype,
            layout=layout,
            schedule=schedule,
            preset=preset,
        )
        return await self._fetch_positions(query, self._budget(timeout))

    def iter_range(
        self,
        start: int,
        stop: int,
        d_model: int | None = None,
        *,
        base: float = 10000.0,
        dtype: DTypeArg = "float32",
        layout: str = "interleaved",
        schedule: str = "paper",
        preset: Preset | None = None,
        chunk_bytes: int | None = None,
        timeout: Timeout = DEFAULT,
    ) -> AsyncIterator[tuple[int, npt.NDArray[Any]]]:
        """``async for first_position, rows in ...``; see :meth:`Client.iter_range`.

        Arguments are checked when this is called, not at the first iteration.
        """
        query = proto.range_query(
            start,
            stop,
            d_model,
            base=base,
            dtype=dtype,
            layout=layout,
            schedule=schedule,
            preset=preset,
        )
        return self._stream(self._settings.cursor(query, chunk_bytes), self._budget(timeout))

    def iter_positions(
        self,
        positions: npt.ArrayLike,
        d_model: int | None = None,
        *,
        base: float = 10000.0,
        dtype: DTypeArg = "float32",
        layout: str = "interleaved",
        schedule: str = "paper",
        preset: Preset | None = None,
        chunk_bytes: int | None = None,
        timeout: Timeout = DEFAULT,
    ) -> AsyncIterator[tuple[int, npt.NDArray[Any]]]:
        """``async for first_index, rows in ...``; see :meth:`Client.iter_positions`."""
        query = proto.positions_query(
            positions,
            d_model,
            base=base,
            dtype=dtype,
            layout=layout,
            schedule=schedule,
            preset=preset,
        )
        return self._stream(self._settings.cursor(query, chunk_bytes), self._budget(timeout))

    # -- service --------------------------------------------------------------------------

    async def server_info(self, *, timeout: Timeout = DEFAULT) -> ServerInfo:
        """Describes the server that answers; see :meth:`Client.server_info`."""
        response = await self._call(
            self._connect()[0].GetServerInfo, pb.GetServerInfoRequest(), self._budget(timeout)
        )
        return proto.server_info_from_proto(response)

    async def health(self, service: str = "", *, timeout: Timeout = DEFAULT) -> str:
        """The ``grpc.health.v1`` status of ``service``; see :meth:`Client.health`."""
        budget = self._budget(timeout, retry=False)
        try:
            response = await self._connect()[1].Check(
                proto.health_request(service),
                timeout=budget.attempt_timeout(),
                metadata=self._settings.metadata,
            )
        except grpc.RpcError as error:
            return proto.health_status_from_error(error)
        return proto.health_status(response)

    # -- I/O ------------------------------------------------------------------------------

    def _budget(self, timeout: Timeout, *, retry: bool = True) -> CallBudget:
        return self._settings.budget(timeout, retry=retry)

    async def _fetch_positions(self, query: Query, budget: CallBudget) -> npt.NDArray[Any]:
        """A positions query, through the row cache (see :mod:`posenc._rows`)."""
        plan = self._rows.plan(query)
        if isinstance(plan, Pending):  # rows on their way: wait, then take them
            await asyncio.wait(plan.tokens, timeout=budget.attempt_timeout())
            plan = self._rows.plan(query, wait=False)
        rows = await self._rows_of(query, plan, budget)
        self._fetch_ahead(query)
        return rows

    async def _rows_of(
        self, query: Query, plan: RowPlan | Pending | None, budget: CallBudget
    ) -> npt.NDArray[Any]:
        if plan is None:
            return await self._fetch(query, budget)
        assert isinstance(plan, RowPlan)
        if plan.fetch is None:
            return plan.result()
        try:
            return plan.result(await self._fetch(plan.fetch, budget, self._readahead_unary_max))
        except (InvalidArgumentError, ResourceExhaustedError):
            pass
        return await self._fetch(query, budget)  # the server judges the caller's own request

    def _fetch_ahead(self, query: Query) -> None:
        """Start fetching the rows the next steps of ``query``'s sequences will want."""
        if self._closed:
            return
        ahead = self._rows.claim_ahead(query, asyncio.get_running_loop().create_future)
        if ahead is None:
            return
        task = asyncio.create_task(self._fetch_ahead_now(ahead), name=READ_AHEAD_TASK)
        self._ahead_tasks.add(task)  # a strong reference until it ends

        def landed(task: asyncio.Task[npt.NDArray[Any] | None]) -> None:
            # Here rather than in the task: a task cancelled before it starts runs nothing.
            self._ahead_tasks.discard(task)
            rows = None if task.cancelled() else task.result()
            self._rows.finish_ahead(ahead, rows)
            ahead.token.set_result(None)

        task.add_done_callback(landed)

    async def _fetch_ahead_now(self, ahead: AheadFetch) -> npt.NDArray[Any] | None:
        try:
            budget = self._budget(DEFAULT, retry=False)
            return await self._fetch(ahead.query, budget, self._readahead_unary_max)
        except Exception:
            # Nothing is lost: the call that needs these rows fetches them itself, and
            # reports its own errors.
            return None

    @property
    def _readahead_unary_max(self) -> int:
        # One GetEncoding call even above unary_max_bytes: the server answers position
        # lists from its cached blocks there, which the next steps' rows share.
        return max(self._settings.unary_max_bytes, self._rows.readahead_bytes)

    async def _fetch(
        self, query: Query, budget: CallBudget, unary_max_bytes: int | None = None
    ) -> npt.NDArray[Any]:
        unary_max = self._settings.unary_max_bytes if unary_max_bytes is None else unary_max_bytes
        if not proto.use_stream(query, unary_max):
            try:
                method = self._connect()[2].get_encoding
                tensor = await self._call(method, query.unary_request(), budget)
                return proto.decode_unary(tensor, query)
            except ResourceExhaustedError:
                pass  # the server's unary limit is below ours: stream instead
        cursor = self._settings.cursor(query, collect=True)
        async for _ in self._stream(cursor, budget):
            pass  # the cursor copies each chunk into its result array
        return cursor.result()

    async def _call(
        self,
        method: Callable[..., Awaitable[_Response]],
        request: _Request,
        budget: CallBudget,
    ) -> _Response:
        """One unary call, retried on UNAVAILABLE within the budget."""
        while True:
            try:
                return await method(
                    request, timeout=budget.attempt_timeout(), metadata=self._settings.metadata
                )
            except grpc.RpcError as error:
                delay = budget.on_error(error)
            await asyncio.sleep(delay)

    async def _stream(
        self, cursor: StreamCursor, budget: CallBudget
    ) -> AsyncIterator[tuple[int, npt.NDArray[Any]]]:
        """Yields the cursor's chunks; an interrupted call resumes with the missing rows."""
        while True:
            call = self._connect()[2].stream_encoding(
                cursor.request(), timeout=budget.attempt_timeout(), metadata=self._settings.metadata
            )
            try:
                async for chunk in call:
                    yield cursor.accept(chunk)
                    budget.progress()
                cursor.check_complete()
                return
            except grpc.RpcError as error:
                if cursor.done:
                    return  # the failure came after the last row: nothing is missing
                delay = budget.on_error(error)
            finally:
                # A no-op when the call finished; frees the server's stream when the
                # caller abandoned the iterator or a chunk failed validation.
                call.cancel()
            await asyncio.sleep(delay)
