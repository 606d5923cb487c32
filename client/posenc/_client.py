"""The blocking client. Protocol logic lives in :mod:`posenc._protocol`; this is the I/O."""

from __future__ import annotations

import operator
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from types import TracebackType
from typing import Any, TypeVar

import grpc
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

__all__ = ["Client"]

_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def _run_ahead(client_ref: weakref.ref[Client], work: queue.SimpleQueue[AheadFetch | None]) -> None:
    """The read-ahead thread of a client: background fetches, one at a time, until the
    client closes or is collected. A daemon, so that it never holds up interpreter exit."""
    while (ahead := work.get()) is not None:
        client = client_ref()
        if client is None:
            return
        client._fetch_ahead_now(ahead)
        del client


class Client:
    """Blocking client of a posenc server (or several, balanced round robin).

    Thread-safe: one client, and its single gRPC channel, can serve many threads.

    Args:
        target: ``host:port`` of a server, any gRPC target URI (``dns:///host:port``), or
            a sequence of ``host:port`` replicas that calls are spread over, round robin.
        timeout: Default deadline of each call in seconds, retries and whole streams
            included; ``None`` for none. Every method takes a ``timeout=`` override.
        max_retries: How many times a call is retried on UNAVAILABLE (server down or
            restarting), with exponential backoff from ``retry_backoff`` seconds, capped
            at 2 s. An interrupted stream resumes from the last row received.
        retry_backoff: First retry delay, in seconds.
        chunk_bytes: Preferred stream chunk size in bytes (the server caps it); ``None``
            for the server's default.
        unary_max_bytes: Results up to this size are fetched in one unary call, larger
            ones are streamed.
        credentials: ``grpc.ChannelCredentials`` for TLS; plaintext when ``None``.
        options: Extra gRPC channel options, overriding the SDK's.
        token: Bearer token sent with every call, for servers started with
            ``--auth-token-file``.
        row_cache_bytes: Memory for the rows :meth:`get_positions` fetched ahead, which
            answer later calls for the same (spec, position) without a call: a row
            depends on nothing else, so a cached row is the server's row. ``0`` turns
            the cache, and so read-ahead, off.
        readahead_bytes: When a call asks for position ``p`` right after one that asked
            for ``p - 1`` (a decode loop moving forward), it also fetches up to 64
            following positions, at most this many bytes in all, and after the call
            fetches the next ones in the background, so the next steps of the loop need
            no call. ``0`` turns read-ahead off.

    Example::

        with posenc.Client("127.0.0.1:50051") as client:
            table = client.get_range(0, 8192, 512)        # (8192, 512) float32
            rows = client.get_positions([7, 70000], 512)  # (2, 512)
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
        self._ahead_queue: queue.SimpleQueue[AheadFetch | None] = queue.SimpleQueue()
        self._ahead_thread: threading.Thread | None = None
        self._ahead_lock = threading.Lock()
        self._closed = False
        target_uri, channel_options = self._settings.target, self._settings.options
        if credentials is None:
            self._channel = grpc.insecure_channel(target_uri, channel_options)
        else:
            self._channel = grpc.secure_channel(target_uri, credentials, channel_options)
        self._stub = pb_grpc.PositionalEncodingServiceStub(self._channel)
        self._tables = proto.TableCalls(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def target(self) -> str:
        """The gRPC target the channel connects to."""
        return self._settings.target

    def __repr__(self) -> str:
        return f"Client({self._settings.target!r})"

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
        """Closes the channel; calls in flight (background read-ahead too) are cancelled."""
        with self._ahead_lock:
            self._closed = True
            self._ahead_queue.put(None)  # the end mark: the read-ahead thread ends there
        self._channel.close()

    # -- tables ---------------------------------------------------------------------------

    def get_range(
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
        """Returns the rows of positions ``[start, stop)``, shape ``(stop - start, d_model)``.

        Args:
            start: First position (any int64 the server accepts, negative included).
            stop: End of the range, exclusive.
            d_model: Width of a row.
            base: Frequency base, finite and > 1.
            dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` (``ml_dtypes.bfloat16``
                result) or ``"float64"``; numpy dtypes are accepted too.
            layout: ``"interleaved"`` (sin, cos, sin, cos, ...) or ``"split"`` (all sines,
                then all cosines).
            schedule: ``"paper"`` (Vaswani et al.) or ``"tensor2tensor"``.
            preset: A model family's table instead (:mod:`posenc.presets`): a sinusoidal
                preset's name such as ``"whisper"``, a ``SinusoidalPreset`` or a
                ``RotaryPreset`` (whose row width is ``d_model``'s default). With a
                preset, leave ``layout`` and ``schedule`` at their defaults.
            timeout: Deadline of the whole call in seconds (``None``: none); defaults to
                the client's.

        Small results take one unary call; large ones are streamed straight into the
        returned array, resuming after interruptions.

        Raises:
            InvalidArgumentError: A bad argument (``field_violations`` names it).
            ResourceExhaustedError: The result exceeds the server's stream limit.
            DeadlineExceededError: The timeout expired.
            UnavailableError: The server stayed unreachable through every retry.
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
        return self._fetch(query, self._budget(timeout))

    def get_positions(
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
        """Returns the rows of arbitrary ``positions``, shape ``(len(positions), d_model)``.

        ``positions`` is any sequence or 1-D numpy array of integers, in the order the rows
        are wanted (repeats allowed). Other arguments as in :meth:`get_range`.

        Made for decode loops: rows come from the client's row cache when it holds them,
        and a sequence moving forward has its next rows fetched ahead, in the call and in
        the background (see ``row_cache_bytes`` and ``readahead_bytes``). The result is
        always a new array.
        """
        query = proto.positions_query(
            positions,
            d_model,
            base=base,
            dtype=dtype,
            layout=layout,
            schedule=schedule,
            preset=preset,
        )
        return self._fetch_positions(query, self._budget(timeout))

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
    ) -> Iterator[tuple[int, npt.NDArray[Any]]]:
        """Streams positions ``[start, stop)`` as ``(first_position, rows)`` slices, in order.

        Memory stays at one chunk (``chunk_bytes``, else the client's, capped by the
        server) however long the range: for tables too large to hold, e.g. written to
        disk as they arrive. An interrupted stream resumes where it stopped. ``timeout``
        bounds the whole iteration, including the time the caller spends between slices;
        pass ``timeout=None`` for long jobs. Other arguments as in :meth:`get_range`.
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
    ) -> Iterator[tuple[int, npt.NDArray[Any]]]:
        """Streams the rows of ``positions`` as ``(index_of_first_row, rows)`` slices.

        ``rows`` are the rows of ``positions[index : index + len(rows)]``. Otherwise as
        :meth:`iter_range`.
        """
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

    def server_info(self, *, timeout: Timeout = DEFAULT) -> ServerInfo:
        """Describes the server that answers: version, limits, options, cache statistics.

        With several targets, each call may reach a different replica.
        """
        response = self._call(
            self._stub.GetServerInfo, pb.GetServerInfoRequest(), self._budget(timeout)
        )
        return proto.server_info_from_proto(response)

    def health(self, service: str = "", *, timeout: Timeout = DEFAULT) -> str:
        """The ``grpc.health.v1`` status of ``service`` ("" = the whole server).

        Returns ``"SERVING"``, ``"NOT_SERVING"`` (e.g. draining before shutdown), or
        ``"SERVICE_UNKNOWN"``. A probe reports what it sees now, so it is never retried:
        an unreachable server raises :class:`UnavailableError`.
        """
        budget = self._budget(timeout, retry=False)
        try:
            response = self._health.Check(
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

    def _fetch_positions(self, query: Query, budget: CallBudget) -> npt.NDArray[Any]:
        """A positions query, through the row cache (see :mod:`posenc._rows`)."""
        plan = self._rows.plan(query)
        if isinstance(plan, Pending):  # rows on their way: wait, then take them
            futures.wait(plan.tokens, timeout=budget.attempt_timeout())
            plan = self._rows.plan(query, wait=False)
        rows = self._rows_of(query, plan, budget)
        self._fetch_ahead(query)
        return rows

    def _rows_of(
        self, query: Query, plan: RowPlan | Pending | None, budget: CallBudget
    ) -> npt.NDArray[Any]:
        if plan is None:
            return self._fetch(query, budget)
        assert isinstance(plan, RowPlan)
        if plan.fetch is None:
            return plan.result()
        try:
            return plan.result(self._fetch(plan.fetch, budget, self._readahead_unary_max))
        except (InvalidArgumentError, ResourceExhaustedError):
            pass
        return self._fetch(query, budget)  # the server judges the caller's own request

    def _fetch_ahead(self, query: Query) -> None:
        """Start fetching the rows the next steps of ``query``'s sequences will want."""
        with self._ahead_lock:  # close() takes it too: nothing is queued after its end mark
            if self._closed:
                return
            ahead = self._rows.claim_ahead(query, futures.Future)
            if ahead is None:
                return
            if self._ahead_thread is None:
                # The thread holds the client weakly: a client dropped without close() is
                # still collected, and its finalizer ends the thread.
                self._ahead_thread = threading.Thread(
                    target=_run_ahead,
                    args=(weakref.ref(self), self._ahead_queue),
                    name="posenc-read-ahead",
                    daemon=True,
                )
                self._ahead_thread.start()
                weakref.finalize(self, self._ahead_queue.put, None)
            self._ahead_queue.put(ahead)

    def _fetch_ahead_now(self, ahead: AheadFetch) -> None:
        rows = None
        try:
            budget = self._budget(DEFAULT, retry=False)
            rows = self._fetch(ahead.query, budget, self._readahead_unary_max)
        except Exception:
            # Nothing is lost: the call that needs these rows fetches them itself, and
            # reports its own errors.
            pass
        finally:
            self._rows.finish_ahead(ahead, rows)
            ahead.token.set_result(None)

    @property
    def _readahead_unary_max(self) -> int:
        # One GetEncoding call even above unary_max_bytes: the server answers position
        # lists from its cached blocks there, which the next steps' rows share.
        return max(self._settings.unary_max_bytes, self._rows.readahead_bytes)

    def _fetch(
        self, query: Query, budget: CallBudget, unary_max_bytes: int | None = None
    ) -> npt.NDArray[Any]:
        unary_max = self._settings.unary_max_bytes if unary_max_bytes is None else unary_max_bytes
        if not proto.use_stream(query, unary_max):
            try:
                tensor = self._call(self._tables.get_encoding, query.unary_request(), budget)
                return proto.decode_unary(tensor, query)
            except ResourceExhaustedError:
                pass  # the server's unary limit is below ours: stream instead
        cursor = self._settings.cursor(query, collect=True)
        for _ in self._stream(cursor, budget):
            pass  # the cursor copies each chunk into its result array
        return cursor.result()

    def _call(
        self,
        method: Callable[..., _Response],
        request: _Request,
        budget: CallBudget,
    ) -> _Response:
        """One unary call, retried on UNAVAILABLE within the budget."""
        while True:
            try:
                return method(
                    request, timeout=budget.attempt_timeout(), metadata=self._settings.metadata
                )
            except grpc.RpcError as error:
                delay = budget.on_error(error)
            time.sleep(delay)

    def _stream(
        self, cursor: StreamCursor, budget: CallBudget
    ) -> Iterator[tuple[int, npt.NDArray[Any]]]:
        """Yields the cursor's chunks; an interrupted call resumes with the missing rows."""
        while True:
            call = self._tables.stream_encoding(
                cursor.request(), timeout=budget.attempt_timeout(), metadata=self._settings.metadata
            )
            try:
                for chunk in call:
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
            time.sleep(delay)
