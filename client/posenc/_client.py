"""The blocking client: the I/O of the calls that :mod:`posenc._core` describes."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc

from posenc import _core as core
from posenc._base import BaseClient
from posenc._channel import Calls, Pool
from posenc._core import Result, Slice, Stepper, Steps
from posenc._query import Plan
from posenc._rows import AheadClaim, AheadFetch
from posenc.errors import ClientClosedError
from posenc.types import ServerInfo

__all__ = ["Client"]

#: The name of the threads that fetch rows ahead in the background.
READ_AHEAD_THREAD = "posenc-read-ahead"
#: How many of them a client runs: a loop of many sequences back to back needs a fetch a
#: step, and one fetch waits on the server and the wire while the next could be computed
#: by another server process (the row cache keeps several steps in flight: LEAD_STEPS).
READ_AHEAD_THREADS = 2


def _affinity(table: int | None) -> int | None:
    """A call's affinity (see :class:`posenc._channel.Pool`): the table's, and the calling
    thread's."""
    return None if table is None else hash((table, threading.get_ident()))


def _run_ahead(
    client_ref: weakref.ref[Client], work: queue.SimpleQueue[AheadFetch | AheadClaim | None]
) -> None:
    """A read-ahead thread of a client: background jobs, one at a time, until the client
    closes or is collected (a claim's fetches in one go: see ``Core.fetch_aheads``; the
    other thread takes the next job). A daemon, so that it never holds up interpreter
    exit."""
    while (job := work.get()) is not None:
        client = client_ref()
        if client is None:
            return
        aheads = client._core.aheads(job)
        try:
            if aheads:
                client._run(client._core.fetch_aheads(aheads))
        except Exception:
            pass  # closed under it (its steps finished every fetch): the caller's call says so
        del client


class Client(BaseClient[Result, ServerInfo, str, Iterator[Slice]]):
    """Blocking client of a posenc server (or several, balanced round robin).

    Thread-safe: one client, and its gRPC channels (``connections`` of them), can serve
    many threads.
    ``interceptors`` are ``grpc`` client interceptors (``grpc.UnaryUnaryClientInterceptor``
    ...) that every call goes through. The other arguments are described in
    :class:`posenc._base.BaseClient`.

    Example::

        with posenc.Client("127.0.0.1:50051") as client:
            table = client.get_range(0, 8192, 512)        # (8192, 512) float32
            rows = client.get_positions([7, 70000], 512)  # (2, 512)
            whisper = client.get_range(0, 1500, posenc.Spec("whisper", d_model=384))
    """

    def _setup(self) -> None:
        self._ahead_queue: queue.SimpleQueue[AheadFetch | AheadClaim | None] = queue.SimpleQueue()
        self._ahead_threads: list[threading.Thread] = []
        self._ahead_lock = threading.Lock()
        settings = self._core.settings
        self._channels: list[grpc.Channel] = []
        if self._transport is not None:
            self._pool = Pool(
                [self._transport.calls_for(asynchronous=False)] * settings.connections
            )
            return
        for _ in range(settings.connections):
            if self._credentials is None:
                channel = grpc.insecure_channel(settings.target, settings.options)
            else:
                channel = grpc.secure_channel(settings.target, self._credentials, settings.options)
            self._channels.append(channel)
        self._pool = Pool(
            [
                Calls(grpc.intercept_channel(channel, *self._interceptors))
                if self._interceptors
                else Calls(channel)
                for channel in self._channels
            ]
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channels; calls in flight (background read-ahead too) are cancelled."""
        with self._ahead_lock:
            self._core.closed = True
            for _ in range(READ_AHEAD_THREADS):  # the end marks: each thread ends at one
                self._ahead_queue.put(None)
        for channel in self._channels:
            channel.close()
        self._close_shared()

    # -- I/O ------------------------------------------------------------------------------

    def _run(self, steps: Steps[Any]) -> Any:
        return self._result(Stepper(steps))

    def _result(self, stepper: Stepper[Any]) -> Any:
        for _ in self._drive(stepper):
            raise AssertionError("only iterators deliver slices")
        return stepper.result

    def _call(self, plan: Plan) -> Any:
        if plan.request is None:
            return self._run(self._core.planned(plan))
        done, value = self._core.finish(plan, self._first_call(plan))
        return value if done else self._result(value)

    def _first_call(self, plan: Plan) -> object:
        """The outcome of a plan's GetEncoding call: its response, or its error, without
        its traceback: a traceback holds its frames, and theirs callers' (the driver's,
        which holds the call's result), until a collection."""
        try:
            calls = self._pool.pick(_affinity(plan.affinity))
            return calls.get_encoding(plan.request, timeout=plan.timeout)
        except grpc.RpcError as error:
            return error.with_traceback(None)

    def _iterate(self, steps: Steps[None]) -> Iterator[Slice]:
        return self._drive(Stepper(steps))

    def _ready(self, result: Result, claim: AheadClaim | None) -> Result:
        if claim is not None:
            self._read_ahead(claim)
        return result

    def _drive(self, stepper: Stepper[Any]) -> Iterator[Slice]:
        with stepper:
            for operation in stepper:
                if isinstance(operation, core.Deliver):
                    yield operation.slice
                else:
                    stepper.send(self._perform(operation))

    def _perform(self, operation: core.Performed) -> Any:
        """The outcome of ``operation``: its value, or the ``grpc.RpcError`` it failed with
        (see :meth:`posenc._core.Stepper.send`)."""
        try:
            match operation:
                case core.Unary(method, request, timeout, affinity):
                    if self._core.closed:  # an iterator made before close() starts no new RPC
                        raise ClientClosedError()
                    call = getattr(self._pool.pick(_affinity(affinity)), method)
                    return call(request, timeout=timeout)
                case core.OpenStream(request, timeout, affinity):
                    if self._core.closed:
                        raise ClientClosedError()
                    calls = self._pool.pick(_affinity(affinity))
                    return core.Stream(calls.stream_encoding(request, timeout=timeout))
                case core.NextChunk(stream):
                    return next(stream.call, None)
                case core.Sleep(seconds):
                    return time.sleep(seconds)
                case core.Wait(tokens, timeout):
                    return futures.wait(tokens, timeout=timeout)
                case _:
                    return self._local(operation)
        except grpc.RpcError as error:
            return error

    def _new_token(self) -> futures.Future[None]:
        return futures.Future()

    def _read_ahead(self, ahead: AheadFetch | AheadClaim) -> None:
        """Queue ``ahead`` for the read-ahead threads, started at the first one."""
        with self._ahead_lock:  # close() takes it too: nothing is queued after its end mark
            if self._core.closed:
                if isinstance(ahead, AheadFetch):
                    self._core.finish_ahead(ahead, None)
                return
            if not self._ahead_threads:
                # The threads hold the client weakly: a client dropped without close() is
                # still collected, and its finalizer ends them.
                for _ in range(READ_AHEAD_THREADS):
                    thread = threading.Thread(
                        target=_run_ahead,
                        args=(weakref.ref(self), self._ahead_queue),
                        name=READ_AHEAD_THREAD,
                        daemon=True,
                    )
                    thread.start()
                    self._ahead_threads.append(thread)
                    weakref.finalize(self, self._ahead_queue.put, None)
            self._ahead_queue.put(ahead)
