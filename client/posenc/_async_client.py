"""The asyncio client: :class:`posenc.Client`'s methods, awaitable. As there, the calls are
described once in :mod:`posenc._core`; this is how asyncio performs them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Coroutine
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from posenc import _core as core
from posenc._base import BaseClient
from posenc._channel import Calls, Pool
from posenc._core import Result, Slice, Stepper, Steps
from posenc._query import Plan
from posenc._rows import AheadClaim, AheadFetch
from posenc.errors import ClientClosedError
from posenc.types import ServerInfo

__all__ = ["AsyncClient"]

# What a stream's read() returns at its end.
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]

#: The name of the tasks that fetch rows ahead in the background.
READ_AHEAD_TASK = "posenc-read-ahead"


def _affinity(table: int | None) -> int | None:
    """A call's affinity (see :class:`posenc._channel.Pool`): the table's, and the caller
    task's; read-ahead tasks share one, so that they keep to one connection."""
    task = asyncio.current_task()
    if table is None or task is None:
        return table
    return hash((table, 0 if task.get_name() == READ_AHEAD_TASK else id(task)))


class AsyncClient(
    BaseClient[Awaitable[Result], Awaitable[ServerInfo], Awaitable[str], AsyncIterator[Slice]]
):
    """asyncio client of a posenc server (or several, balanced round robin).

    Same constructor arguments, methods and behaviour as :class:`posenc.Client`, with
    ``await`` (and ``async for`` over :meth:`iter_range` / :meth:`iter_positions`);
    ``interceptors`` are ``grpc.aio`` client interceptors. It may be created anywhere, but
    used from one event loop only (its channel is created in the loop of the first call)::

        async with posenc.AsyncClient("127.0.0.1:50051") as client:
            table = await client.get_range(0, 8192, 512)
            async for first, rows in client.iter_range(0, 10**7, 512, timeout=None):
                ...

    Cancelling the awaiting task cancels the call (``asyncio.CancelledError`` propagates).
    """

    def _setup(self) -> None:
        self._ahead_tasks: set[asyncio.Task[Any]] = set()
        self._channels: list[grpc.aio.Channel] = []
        self._pool: Pool | None = None

    def _connect(self) -> Pool:
        """The client's channels (see :class:`posenc._channel.Pool`), created at first use.

        A grpc.aio channel belongs to the event loop it is created in, and clients are often
        built before ``asyncio.run``: creating them in the first call puts them in the right
        loop.
        """
        if self._core.closed:
            raise ClientClosedError()  # as the blocking client raises
        if self._pool is None and self._transport is not None:
            calls = self._transport.calls_for(asynchronous=True)
            self._pool = Pool([calls] * self._core.settings.connections)
        if self._pool is None:
            settings = self._core.settings
            interceptors = list(self._interceptors) or None
            for _ in range(settings.connections):
                if self._credentials is None:
                    channel = grpc.aio.insecure_channel(
                        settings.target, settings.options, interceptors=interceptors
                    )
                else:
                    channel = grpc.aio.secure_channel(
                        settings.target,
                        self._credentials,
                        settings.options,
                        interceptors=interceptors,
                    )
                self._channels.append(channel)
            self._pool = Pool([Calls(channel) for channel in self._channels])
        return self._pool

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
        """Closes the channels; calls in flight (background read-ahead too) are cancelled."""
        self._core.closed = True
        for task in list(self._ahead_tasks):
            task.cancel()
        for channel in self._channels:
            await channel.close(None)
        self._close_shared()

    # -- I/O ------------------------------------------------------------------------------

    def _run(self, steps: Steps[Any]) -> Coroutine[Any, Any, Any]:
        # The first step runs now: a bad argument raises where the call is made, as with the
        # blocking client, rather than where it is awaited.
        return self._result(Stepper(steps).start())

    async def _result(self, stepper: Stepper[Any]) -> Any:
        async for _ in self._drive(stepper):
            raise AssertionError("only iterators deliver slices")
        return stepper.result

    def _iterate(self, steps: Steps[None]) -> AsyncIterator[Slice]:
        return self._drive(Stepper(steps))

    def _call(self, plan: Plan) -> Coroutine[Any, Any, Any]:
        if plan.request is None:
            return self._run(self._core.planned(plan))
        return self._planned_call(plan)

    async def _planned_call(self, plan: Plan) -> Any:
        done, value = self._core.finish(plan, await self._first_call(plan))
        return value if done else await self._result(value)

    async def _first_call(self, plan: Plan) -> object:
        """The outcome of a plan's GetEncoding call: its response, or its error, without
        its traceback: a traceback holds its frames, and theirs callers' (the driver's,
        which holds the call's result), until a collection."""
        try:
            calls = self._connect().pick(_affinity(plan.affinity))
            return await calls.get_encoding(plan.request, timeout=plan.timeout)
        except grpc.RpcError as error:
            return error.with_traceback(None)

    async def _ready(self, result: Result, claim: AheadClaim | None) -> Result:
        # The claim starts when awaited: from the event loop, as every read-ahead.
        if claim is not None:
            self._read_ahead(claim)
        return result

    async def _drive(self, stepper: Stepper[Any]) -> AsyncIterator[Slice]:
        with stepper:
            for operation in stepper:
                if isinstance(operation, core.Deliver):
                    yield operation.slice
                else:
                    stepper.send(await self._perform(operation))

    async def _perform(self, operation: core.Performed) -> Any:
        """The outcome of ``operation``: its value, or the ``grpc.RpcError`` it failed with
        (see :meth:`posenc._core.Stepper.send`)."""
        try:
            match operation:
                case core.Unary(method, request, timeout, affinity):
                    call = getattr(self._connect().pick(_affinity(affinity)), method)
                    return await call(request, timeout=timeout)
                case core.OpenStream(request, timeout, affinity):
                    calls = self._connect().pick(_affinity(affinity))
                    return core.Stream(calls.stream_encoding(request, timeout=timeout))
                case core.NextChunk(stream):
                    chunk = await stream.call.read()
                    return None if chunk is _EOF else chunk
                case core.Sleep(seconds):
                    return await asyncio.sleep(seconds)
                case core.Wait(tokens, timeout):
                    return await asyncio.wait(tokens, timeout=timeout)
                case _:
                    return self._local(operation)
        except grpc.RpcError as error:
            return error

    def _new_token(self) -> asyncio.Future[None]:
        return asyncio.get_running_loop().create_future()

    def _read_ahead(self, ahead: AheadFetch | AheadClaim) -> None:
        """Start a task fetching ``ahead`` (a claim's fetches: claimed once the step that
        called for them has returned)."""
        if isinstance(ahead, AheadClaim):
            asyncio.get_running_loop().call_soon(self._claim, ahead)
            return
        self._fetch_ahead([ahead])

    def _claim(self, claim: AheadClaim) -> None:
        if not self._core.closed:
            aheads = self._core.aheads(claim)
            if aheads:
                self._fetch_ahead(aheads)

    def _fetch_ahead(self, aheads: list[AheadFetch]) -> None:
        """Start a task fetching ``aheads`` (see ``Core.fetch_aheads``)."""
        if self._core.closed:
            for ahead in aheads:
                self._core.finish_ahead(ahead, None)
            return
        task = asyncio.create_task(self._run(self._core.fetch_aheads(aheads)), name=READ_AHEAD_TASK)
        self._ahead_tasks.add(task)  # a strong reference until it ends

        def ended(task: asyncio.Task[None]) -> None:
            # Here too: a task cancelled before it starts runs nothing. (A fetch finished
            # already is not changed by finishing it again.)
            self._ahead_tasks.discard(task)
            if not task.cancelled():
                task.exception()  # retrieved: a client closed under it is no error here
            for ahead in aheads:
                self._core.finish_ahead(ahead, None)

        task.add_done_callback(ended)
