"""The public methods of ``Client`` and ``AsyncClient``, written once.

Each method asks :mod:`posenc._core` for the steps of the call and hands them to the
client's driver: ``_run`` (blocking: the result; asyncio: an awaitable of it) or
``_iterate`` (an iterator, or an async iterator, of slices). The type parameters say
which, so that each client's signatures are exact for type checkers.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, Unpack, assert_never, cast

import grpc
import numpy.typing as npt

from posenc._channel import (
    DEFAULT_CONNECTIONS,
    DEFAULT_TARGET,
    DEFAULT_UNARY_MAX_BYTES,
    Settings,
    channel_credentials,
)
from posenc._core import Attach, CopyShared, Core, Local, ReadAhead, ShareSession, Steps
from posenc._query import (
    Plan,
    grid_plan,
    grid_query,
    load_dtypes,
    positions_query,
    range_plan,
    range_query,
)
from posenc._retry import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_BACKOFF, DEFAULT_TIMEOUT
from posenc._rows import (
    DEFAULT_READAHEAD_BYTES,
    DEFAULT_ROW_CACHE_BYTES,
    AheadClaim,
    AheadFetch,
    RowCache,
)
from posenc._shm import Session
from posenc.errors import InternalError
from posenc.types import DEFAULT, ClassicOptions, DTypeArg, Table, Timeout

if TYPE_CHECKING:
    from posenc.testing import MockTransport

log = logging.getLogger("posenc")
# How long a client waits for a server's region socket to say hello, and how long it then
# makes calls without shared memory before it tries the socket again.
_SHARED_CONNECT_SECONDS = 5.0
_SHARED_RETRY_SECONDS = 30.0

# What the methods return: the value itself (Client) or an awaitable of it (AsyncClient).
ArrayT = TypeVar("ArrayT")
InfoT = TypeVar("InfoT")
StatusT = TypeVar("StatusT")
# Iterator or AsyncIterator of (label, rows) slices.
SlicesT = TypeVar("SlicesT")


class BaseClient(Generic[ArrayT, InfoT, StatusT, SlicesT]):
    """What ``Client`` and ``AsyncClient`` share: construction and every public method.

    Args:
        target: ``host:port`` of a server, any gRPC target URI (``dns:///host:port``), or
            a sequence of ``host:port`` replicas that calls are spread over, round robin.
        timeout: Default deadline of each call in seconds, retries and whole streams
            included; ``None`` for none. Every method takes a ``timeout=`` override.
        max_retries: How many times a call is retried on UNAVAILABLE (server down or
            restarting), with exponential backoff from ``retry_backoff`` seconds, capped
            at 2 s. An interrupted stream resumes from the last row received. A new
            client's first call retries too (its server may be restarting); once the
            retries are spent, a target that never answered is reported as "no posenc
            server at ... is it running?". A name that does not resolve is reported at
            once.
        retry_backoff: First retry delay, in seconds.
        chunk_bytes: Preferred stream chunk size in bytes (the server caps it); ``None``
            for the server's default.
        unary_max_bytes: Results up to this size are fetched in one unary call, larger
            ones are streamed. The client learns a table's width (so its size) from the
            first response for that table; until then, a call streams when it would be
            too large even with one column, and otherwise tries one unary call first.
        credentials: ``grpc.ChannelCredentials`` for TLS; plaintext when ``None``; or
            ``grpc.local_channel_credentials()`` for plaintext to a server on this machine
            that a token may still be sent to (gRPC checks the address is loopback).
        options: Extra gRPC channel options, overriding the SDK's.
        connections: How many connections the client opens to each server address. Calls
            take them in turn (a decode loop's :meth:`get_positions` calls keep to one, by
            table), and a stream resumes on the next. A server's worker processes share its
            port and the kernel gives each connection to one of them at random: more
            connections than the server has processes reach most of them.
        transport: A :class:`posenc.testing.MockTransport` that answers every call in this
            process instead of a server, for tests; the target is then not used.
        shared_memory: For a ``unix:`` target (a server on this machine started with
            ``--unix-socket``): whether large ranges travel through the server's shared
            memory instead of its responses (None, the default: when the server offers
            it; see ``copy=`` of :meth:`get_range`). True insists on a ``unix:`` target.
        token: Bearer token sent with every call, for servers started with
            ``--auth-token-file``, as gRPC call credentials: it needs ``credentials``
            (TLS, or local credentials for a server on this machine), and a ValueError
            says so otherwise.
        row_cache_bytes: Memory for the rows :meth:`get_positions` fetched ahead, which
            answer later calls for the same (spec, position) without a call: a row
            depends on nothing else, so a cached row is the server's row. ``0`` turns
            the cache, and so read-ahead, off.
        readahead_bytes: When a call asks for position ``p`` right after one that asked
            for ``p - 1`` (a decode loop moving forward), it also fetches up to 64
            following positions, at most this many bytes in all, and after the call
            fetches the next ones in the background, so the next steps of the loop need
            no call. ``0`` turns read-ahead off.
        interceptors: gRPC client interceptors that every call goes through (``grpc``'s
            for ``Client``, ``grpc.aio``'s for ``AsyncClient``).
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_backoff: float = DEFAULT_RETRY_BACKOFF,
        chunk_bytes: int | None = None,
        unary_max_bytes: int = DEFAULT_UNARY_MAX_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        options: Iterable[tuple[str, Any]] | None = None,
        token: str | None = None,
        row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES,
        readahead_bytes: int = DEFAULT_READAHEAD_BYTES,
        interceptors: Sequence[Any] = (),
        connections: int = DEFAULT_CONNECTIONS,
        transport: MockTransport | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        settings = Settings.create(
            target,
            timeout=timeout,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
            chunk_bytes=chunk_bytes,
            unary_max_bytes=unary_max_bytes,
            connections=connections,
            options=options,
            shared_memory=shared_memory,
        )
        rows = RowCache(operator.index(row_cache_bytes), operator.index(readahead_bytes))
        load_dtypes()  # what calls need, loaded once per process here rather than in a call
        self._core = Core(settings, rows, self._new_token)
        self._shared: Session | None = None  # the region socket's session, once open
        self._shared_lock = threading.Lock()
        self._shared_retry_at = 0.0
        self._credentials = channel_credentials(credentials, token)
        self._interceptors = tuple(interceptors)
        self._transport = transport
        self._setup()

    @property
    def target(self) -> str:
        """The gRPC target the channel connects to."""
        return self._core.settings.target

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r})"

    # -- tables ---------------------------------------------------------------------------

    def get_range(
        self,
        start: int,
        stop: int,
        table: Table,
        *,
        dtype: DTypeArg | None = None,
        out: Any = None,
        device: Any = None,
        cos_sin: bool = False,
        copy: bool = True,
        timeout: Timeout = DEFAULT,
        **classic: Unpack[ClassicOptions],
    ) -> ArrayT:
        """Returns the rows of positions ``[start, stop)``, one row per position.

        Args:
            start: First position (any int64 the server accepts, negative included).
            stop: End of the range, exclusive.
            table: The table: an int is the ``d_model`` of the classic sinusoidal table
                (Vaswani et al.), whose options ``base`` (frequency base; the server's
                default is 10000), ``layout`` (``"interleaved"``: sin, cos, sin, cos, ...;
                ``"split"``: all sines, then all cosines) and ``schedule`` (``"paper"``,
                ``"tensor2tensor"``) are keywords allowed only with an int. Any table is
                a :class:`posenc.Spec`. The result's width is the server's.
            dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` (``ml_dtypes.bfloat16``
                result) or ``"float64"``; numpy and torch dtypes are accepted too. The
                server computes the rows in it. Default: ``out``'s dtype, else float32.
            out: A buffer to fill instead of returning a new array: a numpy array or a
                ``torch.Tensor`` (any device; pinned host memory included) of shape
                ``[rows, width]`` and the result's dtype. A contiguous host buffer is
                where the response is decoded, so the call allocates no result.
            device: Return a ``torch.Tensor`` on this device (``"cpu"``, ``"cuda:0"``).
                A torch ``dtype`` (or a tensor ``out``) also makes the result a tensor;
                bfloat16 rows reach torch bit for bit, never through float32. Needs the
                ``[torch]`` extra.
            cos_sin: For a rotary table: return ``(cos, sin)``, the two halves of the
                rows in the spec's layout (views of one array or tensor).
            copy: ``False``: rows that arrive in a server's shared memory (a ``unix:``
                target) come back as a read-only numpy view of it, without a copy:
                processes on one machine holding the same range share one copy of it,
                until their arrays are dropped. Elsewhere (``out=``, tensors, rows in a
                response) the result is as with ``True``.
            timeout: Deadline of the whole call in seconds (``None``: none); defaults to
                the client's.

        Small results take one unary call; large ones are streamed straight into the
        returned array, resuming after interruptions, or over a ``unix:`` target placed in
        the server's shared memory and copied from there. ``AsyncClient``: awaitable.

        Raises:
            InvalidArgumentError: A bad argument (``field_violations`` names it).
            ResourceExhaustedError: The result exceeds the server's stream limit (judged
                whole, however many streams it would travel in) or this machine's memory
                (refused before it is allocated); :meth:`iter_range` takes it in slices.
            DeadlineExceededError: The timeout expired.
            UnavailableError: The server stayed unreachable through every retry.
        """
        plan = range_plan(
            self._core,
            start,
            stop,
            table,
            dtype,
            classic,
            timeout,
            out=out,
            device=device,
            cos_sin=cos_sin,
            copy=copy,
        )
        return cast(ArrayT, self._call(plan))

    def get_positions(
        self,
        positions: npt.ArrayLike,
        table: Table,
        *,
        dtype: DTypeArg | None = None,
        out: Any = None,
        device: Any = None,
        cos_sin: bool = False,
        coordinate_axis: int = -1,
        timeout: Timeout = DEFAULT,
        **classic: Unpack[ClassicOptions],
    ) -> ArrayT:
        """Returns the rows of arbitrary ``positions``, one row per position.

        ``positions`` is an array of integers of any shape ``S`` (a list, a numpy array, or
        a ``torch.Tensor`` on any device), in the order the rows are wanted (repeats
        allowed); the result has shape ``S + [width]``: ``position_ids`` ``[batch, seq]``
        give ``[batch, seq, width]``. Tensor positions give a tensor on their device.
        ``out`` has shape ``S + [width]``; other arguments as in :meth:`get_range`.

        A table with several position axes (``spec.axes``: ``mrope``'s ``(t, h, w)``, the
        grids' ``(h, w)`` or ``(t, h, w)``) takes coordinates of shape ``S + [axes]``
        giving ``S + [width]``; ``coordinate_axis`` names the axis of ``positions`` that
        holds the coordinates when it is not the last (transformers' M-RoPE
        ``position_ids`` ``[3, batch, seq]``: ``coordinate_axis=0``). Coordinates bypass
        the row cache.

        Made for decode loops: rows come from the client's row cache when it holds them,
        and a sequence moving forward has its next rows fetched ahead, in the call and in
        the background (see ``row_cache_bytes`` and ``readahead_bytes``). The result is
        always a new array (or ``out``). ``AsyncClient``: awaitable.
        """
        if out is None and device is None and coordinate_axis == -1 and timeout is DEFAULT:
            # A decode step whose rows are cached: answered before any step is built.
            step = None if classic else self._core.cached(positions, table, dtype, cos_sin)
            if step is not None:
                return self._ready(*step)
        steps = self._core.get_positions(
            positions,
            table,
            dtype,
            classic,
            coordinate_axis,
            timeout,
            out=out,
            device=device,
            cos_sin=cos_sin,
        )
        return cast(ArrayT, self._run(steps))

    def prefetch(
        self,
        positions: npt.ArrayLike,
        table: Table,
        *,
        dtype: DTypeArg | None = None,
        **classic: Unpack[ClassicOptions],
    ) -> None:
        """Starts fetching the rows of ``positions`` in the background and returns at once
        (``AsyncClient`` too: not awaitable; call it from the event loop's thread).

        A later :meth:`get_positions` of these rows, with the same table and dtype, takes
        them from the row cache, or waits for the fetch still under way instead of making
        its own call. For loops that know their next step's rows before they need them: a
        dynamic-NTK model's next table (its ``seq_len`` grows every step) fetched during
        this step's model time. Rows of a sequence moving forward in one table are
        already fetched ahead without it (``readahead_bytes``). Does nothing when the row
        cache is off, or for coordinates (several-axis tables) and lists of over 4,096
        positions; a fetch that fails is forgotten (the later call fetches the rows
        itself and reports its own error). Arguments as in :meth:`get_positions`.
        """
        for ahead in self._core.prefetch(positions, table, dtype, classic):
            self._read_ahead(ahead)

    def iter_range(
        self,
        start: int,
        stop: int,
        table: Table,
        *,
        dtype: DTypeArg | None = None,
        device: Any = None,
        chunk_bytes: int | None = None,
        timeout: Timeout = DEFAULT,
        **classic: Unpack[ClassicOptions],
    ) -> SlicesT:
        """Streams positions ``[start, stop)`` as ``(first_position, rows)`` slices, in order.

        Memory stays at one chunk (``chunk_bytes``, else the client's, capped by the
        server) however long the range: for tables too large to hold, e.g. written to
        disk as they arrive. An interrupted stream resumes where it stopped. ``timeout``
        bounds the whole iteration, including the time the caller spends between slices;
        pass ``timeout=None`` for long jobs. ``device`` (or a torch ``dtype``) makes each
        slice a ``torch.Tensor``. Other arguments as in :meth:`get_range`; they are
        checked when this is called, not at the first slice. ``AsyncClient``:
        ``async for``.
        """
        arguments = (start, stop, table, dtype, classic)
        return self._iterate(
            self._core.iterate(range_query, arguments, chunk_bytes, timeout, device)
        )

    def iter_positions(
        self,
        positions: npt.ArrayLike,
        table: Table,
        *,
        dtype: DTypeArg | None = None,
        device: Any = None,
        chunk_bytes: int | None = None,
        timeout: Timeout = DEFAULT,
        **classic: Unpack[ClassicOptions],
    ) -> SlicesT:
        """Streams the rows of ``positions`` as ``(index_of_first_row, rows)`` slices.

        ``rows`` are the rows of ``positions.reshape(-1)[index : index + len(rows)]``
        (positions of any shape are read flat). Otherwise as :meth:`iter_range`.
        """
        arguments = (positions, table, dtype, classic)
        return self._iterate(
            self._core.iterate(positions_query, arguments, chunk_bytes, timeout, device)
        )

    def get_grid(
        self,
        table: Table,
        *,
        dtype: DTypeArg | None = None,
        out: Any = None,
        device: Any = None,
        copy: bool = True,
        timeout: Timeout = DEFAULT,
    ) -> ArrayT:
        """Returns a grid kind's whole grid, shaped ``[*spec.grid_shape, width]``: a
        ``sincos_grid_2d`` spec gives ``[grid_height, grid_width, embed_dim]``, a
        ``sincos_grid_3d`` one ``[grid_frames, grid_height, grid_width, embed_dim]``.

        It is ``get_range(0, cells, table)`` (row ``r`` is the row-major cell ``r``)
        reshaped; other arguments as in :meth:`get_range`. ``AsyncClient``: awaitable.
        """
        plan = grid_plan(self._core, table, dtype, timeout, out=out, device=device, copy=copy)
        return cast(ArrayT, self._call(plan))

    def iter_grid(
        self,
        table: Table,
        *,
        dtype: DTypeArg | None = None,
        device: Any = None,
        chunk_bytes: int | None = None,
        timeout: Timeout = DEFAULT,
    ) -> SlicesT:
        """Streams a grid kind's whole grid, row-major, as ``(first_row, rows)`` slices
        (row ``r`` is the cell ``np.unravel_index(r, spec.grid_shape)``), in memory of one
        chunk however large the grid: as :meth:`iter_range` over ``[0, cells)``."""
        steps = self._core.iterate(grid_query, (table, dtype), chunk_bytes, timeout, device)
        return self._iterate(steps)

    # -- service --------------------------------------------------------------------------

    def server_info(self, *, timeout: Timeout = DEFAULT) -> InfoT:
        """Describes the server that answers: version, limits, table kinds, cache
        statistics (:class:`posenc.ServerInfo`).

        With several targets, or a server of several processes, each call may reach a
        different replica or process (``server_id`` says which).
        """
        return cast(InfoT, self._run(self._core.server_info(timeout)))

    def health(self, service: str = "", *, timeout: Timeout = DEFAULT) -> StatusT:
        """The ``grpc.health.v1`` status of ``service`` ("" = the whole server).

        Returns ``"SERVING"``, ``"NOT_SERVING"`` (e.g. draining before shutdown), or
        ``"SERVICE_UNKNOWN"``. A probe reports what it sees now, so it is never retried:
        an unreachable server raises :class:`UnavailableError`.
        """
        return cast(StatusT, self._run(self._core.health(service, timeout)))

    # -- shared memory (unix: targets) ---------------------------------------------------

    def _share_session(self) -> bytes | None:
        """The token of this client's session on the server's region socket, opened at the
        first call that may use it (and again when the server ended it: it restarted);
        None while the server's shared memory is out of reach, tried again after
        ``_SHARED_RETRY_SECONDS``."""
        path = self._core.settings.shared_memory
        with self._shared_lock:
            if self._shared is not None and self._shared.alive():
                return self._shared.token
            if self._shared is not None:
                self._shared.close()
                self._shared = None
            if path is None or time.monotonic() < self._shared_retry_at:
                return None
            try:
                self._shared = Session(path, _SHARED_CONNECT_SECONDS)
            except OSError as error:
                log.info("shared memory out of reach, results travel in responses: %s", error)
                self._shared_retry_at = time.monotonic() + _SHARED_RETRY_SECONDS
                return None
            return self._shared.token

    def _session(self) -> Session:
        with self._shared_lock:
            session = self._shared
        if session is None:
            raise InternalError("rows placed in shared memory without a session")
        return session

    def _close_shared(self) -> None:
        with self._shared_lock:
            if self._shared is not None:
                self._shared.close()  # once the views it handed out are gone
                self._shared = None

    def _local(self, operation: Local) -> Any:
        """Performs an operation that neither waits nor makes a call, which both clients
        perform alike (from their driver: ``AsyncClient``'s on its event loop)."""
        match operation:
            case ReadAhead(ahead):
                return self._read_ahead(ahead)
            case ShareSession():
                return self._share_session()
            case Attach(shared, dtype):
                return self._session().attach(shared, dtype)
            case CopyShared(shared, out):
                return self._session().copy(shared, out)
            case _:
                assert_never(operation)

    # -- what each client does its own way ----------------------------------------------------

    def _setup(self) -> None:
        """The client's own state: its channel (or how it makes one), its read-ahead."""
        raise NotImplementedError

    def _new_token(self) -> Any:
        """A future that a read-ahead completes, of the kind the client waits on."""
        raise NotImplementedError

    def _read_ahead(self, ahead: AheadFetch | AheadClaim) -> None:
        """Starts ``ahead`` in the background (a thread, a task)."""
        raise NotImplementedError

    def _run(self, steps: Steps[Any]) -> Any:
        """Performs ``steps``: their result (or, asyncio, an awaitable of it)."""
        raise NotImplementedError

    def _call(self, plan: Plan) -> Any:
        """Performs a planned call (see :class:`posenc._query.Plan`): its GetEncoding call
        first when it has one, then the core's steps; the result (or, asyncio, an
        awaitable of it)."""
        raise NotImplementedError

    def _ready(self, result: Any, claim: AheadClaim | None) -> ArrayT:
        """A result found without steps (or, asyncio, an awaitable of it); ``claim``, if not
        None, is started as a read-ahead."""
        raise NotImplementedError

    def _iterate(self, steps: Steps[None]) -> SlicesT:
        """Performs ``steps`` as the caller iterates, yielding the slices they deliver."""
        raise NotImplementedError
