"""The encoding service: admission, limits, block caching, chunking, and the wire format.

Rows are computed in fixed blocks of ``block_rows`` consecutive positions, aligned to
multiples of ``block_rows``, so that any range request reuses the blocks of earlier ones. A
block holds at most ``_BLOCK_BYTES`` and ``max_chunk_bytes`` bytes: computing one
costs about the same whatever the row width, so a request's work is its rows plus at most a
few blocks. A stream chunk is one block's rows when it fits in one, else copied from several.

Blocks are cached in their wire form: a serialized response holding the block's rows (at
the row offset of the request that computed it), with a read-only numpy view of its payload.
A stream chunk that is exactly a cached block at that offset (a range streamed again, by
any client) is sent as the cached message itself: no copy of its rows in this process.

Every encoding call is admitted first: refused while the server drains, and streams beyond
``max_concurrent_streams`` are refused with a hint to retry. Results leave as serialized
responses (``posenc_protocol.wire``): a new block's rows are computed straight into its message, a
cached block's message is sent as it is when it is a whole chunk, and other results are
copied once, into their message.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import socket
import threading
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from posenc_protocol.stats import CacheStats
from posenc_protocol.wire import build_tensor_response, encode_tensor_response
from posenc_server import admission, engine
from posenc_server.cache import BlockCache
from posenc_server.config import ServerConfig
from posenc_server.errors import (
    FieldViolation,
    InvalidRequestError,
    LimitExceededError,
    OverloadedError,
    ShuttingDownError,
)
from posenc_server.requests import CoordinateList, PositionList, PositionRange, Selection
from posenc_server.specs import Request, Spec

Table = npt.NDArray[np.generic]
BlockKey = tuple[int, int]  # (spec serial, block index)
StreamSteps = Generator[bytes | None, bool | None, None]
"""A stream's messages, one per step; None: the step computes, send True to run it."""


@dataclass(frozen=True, eq=False)
class Block:
    """A cached block: ``message``, a serialized response whose Tensor holds all the block's
    rows at ``row_offset``, and ``rows``, a read-only view of that message's payload."""

    message: bytes
    row_offset: int
    rows: Table

    @property
    def nbytes(self) -> int:
        """Bytes of its rows (the message's dozen header bytes aside, as the objects' own)."""
        return self.rows.nbytes


# Bytes of a cached block (a 1 MiB chunk, 256 Ki float32 elements): a narrow table's block
# is many rows, a wide one's few, and each costs a few milliseconds to compute. Bytes, not
# elements: a block of as many bfloat16 or float16 elements would be half the message, and
# a stream of them twice the messages (and their per-message costs) of the same bytes in
# float32.
_BLOCK_BYTES = 1 << 20
# A unary position list computes new blocks (for the decode steps that follow) up to this
# many times its own rows, at least one block and at most _MAX_NEW_BLOCKS_PER_LIST; the rows
# of further uncached blocks are computed one by one.
_NEW_BLOCK_ROWS_PER_ROW = 16
_MAX_NEW_BLOCKS_PER_LIST = 64
# A position list caches a block the second time it asks for rows of it (the first time
# computes just the rows): a decode loop comes back to its blocks at the next step, while a
# table asked for once (a dynamic-NTK step, whose spec changes every step) would pay for a
# whole block to use a row of it. The blocks seen once are remembered up to this many.
_SEEN_BLOCKS = 4096
# Evicting this much frees enough heap to trim it at once rather than at the next tick.
_TRIM_AFTER_EVICTED_BYTES = 16 << 20
# Position lists up to this long are gathered row by row, longer ones block by block.
_ROW_BY_ROW_GATHER = 256
# How long a client turned away at the stream cap is told to wait before trying again.
_STREAM_RETRY_AFTER = 0.2


@dataclass(frozen=True)
class Chunk:
    """Rows ``row_offset .. row_offset + len(rows) - 1`` of a selection's table."""

    row_offset: int
    rows: Table


@dataclass(frozen=True)
class ServerInfo:
    """What GetServerInfo reports, in domain terms."""

    version: str
    server_id: str
    limits: Mapping[str, int]
    """``posenc.v1.Limits`` fields by name."""
    cache: CacheStats
    rows_computed: int


SHUTTING_DOWN = "the server is shutting down: retry on another replica"


class EncodingService:
    """Validates requests against the limits and produces their tables, through the cache."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # Set when enough has been evicted that the heap is worth trimming now (the
        # housekeeping thread trims; see app.housekeeping).
        self.trim_due = threading.Event()
        self._evicted_since_trim = 0
        self.cache: BlockCache[BlockKey, Block] = BlockCache(
            config.cache_bytes, self._count_evicted
        )
        # Host and pid for operators; the random part tells apart servers of one process.
        self.server_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._rows_computed = 0
        self._counter_lock = threading.Lock()
        self._seen: collections.OrderedDict[BlockKey, None] = collections.OrderedDict()
        self._draining = False
        self._in_flight = 0
        self._streams = 0
        self._idle = threading.Condition()

    def _count_evicted(self, nbytes: int) -> None:
        # Under the cache's lock: no lock of its own needed.
        self._evicted_since_trim += nbytes
        if self._evicted_since_trim >= _TRIM_AFTER_EVICTED_BYTES:
            self._evicted_since_trim = 0
            self.trim_due.set()

    # Calls ----------------------------------------------------------------------------------

    def unary(self, request: Request) -> bytes:
        """The serialized GetEncodingResponse of a small table."""
        with self._admitted(stream=False):
            spec, selection = request.spec, request.selection
            limit = self.config.max_unary_bytes
            _check_size(spec, selection, "unary", limit, "use StreamEncoding for large results")
            return _response(spec, Chunk(0, self.table(spec, selection)))

    def fill(self, request: Request, out: Table) -> None:
        """Writes the rows of ``request`` into ``out`` (a result placed in shared memory:
        any size up to the stream limit), a block at a time, through the cache. Counted as
        a stream: it may be as long as one."""
        with self._admitted(stream=True):
            spec, selection = request.spec, request.selection
            for chunk in self.chunks(spec, selection, self.block_rows(spec)):
                out[chunk.row_offset : chunk.row_offset + len(chunk.rows)] = chunk.rows

    def stream(self, request: Request) -> StreamSteps:
        """The serialized StreamEncodingResponses of a table of any size, one per step,
        lazily: a cancelled stream stops computing.

        A step that would compute (or copy rows into a new message) runs only when the
        consumer sends True, from a thread that may (a worker of the pool); otherwise (None
        sent, or ``next``: the event loop) it yields None instead and waits for that. Steps
        that give a cached block's message as it is cost a cache lookup: a warm stream is
        sent without a trip to the pool.
        """
        with self._admitted(stream=True):
            spec, selection = request.spec, request.selection
            limit = self.config.max_stream_bytes
            _check_size(spec, selection, "stream", limit, "split the request into smaller ranges")
            chunk_rows = self.chunk_rows(spec, request.max_chunk_bytes)
            if isinstance(selection, PositionRange):
                yield from self._range_messages(spec, selection, chunk_rows)
                return
            chunks = self.chunks(spec, selection, chunk_rows)
            may_compute = None
            while True:
                while not may_compute:
                    may_compute = yield None
                chunk = next(chunks, None)
                if chunk is None:
                    return
                may_compute = yield _response(spec, chunk)

    # Admission and drain --------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new encoding calls (ShuttingDownError); calls in flight go on."""
        with self._idle:
            self._draining = True

    @property
    def streams(self) -> int:
        """Streams in flight (admitted, not yet finished)."""
        return self._streams

    @property
    def in_flight(self) -> int:
        """Encoding calls in flight (admitted, not yet finished), streams included."""
        return self._in_flight

    @property
    def draining(self) -> bool:
        """Whether new encoding calls are refused (a drain began)."""
        return self._draining

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no encoding call is in flight; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    @contextlib.contextmanager
    def _admitted(self, *, stream: bool) -> Iterator[None]:
        """Count a call in flight (for the drain), refusing it while draining or at the cap."""
        limit = self.config.max_concurrent_streams
        with self._idle:
            if self._draining:
                raise ShuttingDownError(SHUTTING_DOWN)
            if stream and self._streams >= limit:
                raise OverloadedError(
                    f"this server process already serves {limit} streams, its limit: "
                    "retry later or on another replica",
                    retry_after_seconds=_STREAM_RETRY_AFTER,
                )
            self._in_flight += 1
            self._streams += stream
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._streams -= stream
                if self._draining:  # only wait_idle waits, and only once draining
                    self._idle.notify_all()

    def cached(self, request: Request) -> bool:
        """Whether every block ``request`` reads is cached: answering it computes nothing."""
        spec, selection = request.spec, request.selection
        block_rows = self.block_rows(spec)
        if isinstance(selection, CoordinateList):
            return False  # several-axis coordinates are computed, never cached
        if isinstance(selection, PositionRange):
            first, last = selection.start // block_rows, (selection.stop - 1) // block_rows
            blocks: list[int] = list(range(first, last + 1)) if selection.rows > 0 else []
        else:
            blocks = np.unique(selection.positions // block_rows).tolist()
        return all((spec.serial, block) in self.cache for block in blocks)

    # Limits ---------------------------------------------------------------------------------

    def chunk_rows(self, spec: Spec, requested_chunk_bytes: int) -> int:
        """Rows per stream chunk for a client asking for ``requested_chunk_bytes`` (0: max)."""
        limit = self.config.max_chunk_bytes
        chunk_bytes = limit if requested_chunk_bytes == 0 else min(requested_chunk_bytes, limit)
        if chunk_bytes < spec.row_bytes:
            raise InvalidRequestError(
                [
                    FieldViolation(
                        "max_chunk_bytes",
                        f"must hold at least one row ({spec.row_bytes} bytes), "
                        f"got {requested_chunk_bytes}",
                    )
                ]
            )
        return chunk_bytes // spec.row_bytes

    # Tables ---------------------------------------------------------------------------------

    def block_rows(self, spec: Spec) -> int:
        """Rows per cached block: ``_BLOCK_BYTES``, within one maximal chunk."""
        return max(1, min(self.config.max_chunk_bytes, _BLOCK_BYTES) // spec.row_bytes)

    def table(self, spec: Spec, selection: Selection) -> Table:
        """The whole table of a small (unary) selection, in one array (read-only when it is
        a cached block's rows as they are).

        Position lists go through the cache here: they are decode steps, whose blocks the
        next steps ask for again.
        """
        if isinstance(selection, CoordinateList):
            return next(self.chunks(spec, selection, max(selection.rows, 1))).rows
        if isinstance(selection, PositionList):
            new_rows = _NEW_BLOCK_ROWS_PER_ROW * selection.rows
            new_blocks = min(_MAX_NEW_BLOCKS_PER_LIST, max(1, new_rows // self.block_rows(spec)))
            return self._rows_for_positions(spec, selection.positions, new_blocks=new_blocks)
        chunks = list(self._block_pieces(spec, selection.start, selection.stop, 0))
        if len(chunks) == 1:
            return chunks[0].rows  # within one block: no copy before the message's
        out = np.empty((selection.rows, spec.width), dtype=spec.encoding.dtype)
        for chunk in chunks:
            out[chunk.row_offset : chunk.row_offset + len(chunk.rows)] = chunk.rows
        return out

    def chunks(self, spec: Spec, selection: Selection, chunk_rows: int) -> Iterator[Chunk]:
        """The table of a (validated) selection as consecutive chunks of <= chunk_rows rows.

        Lazy: each chunk is computed when the consumer asks for it, so a cancelled stream stops
        computing and memory stays at a few chunks whatever the size of the selection. Long
        position lists take the rows of blocks already cached and compute the others row
        by row: new blocks for scattered positions could cost a block per row and flush the
        cache.
        """
        if isinstance(selection, PositionRange):
            yield from self._range_chunks(spec, selection, chunk_rows)
        elif isinstance(selection, CoordinateList):
            for first in range(0, selection.rows, chunk_rows):
                part = selection.coordinates[first : first + chunk_rows]
                self._count_rows(len(part))
                yield Chunk(first, engine.encode_coordinates(spec.encoding, part))
        else:
            for first in range(0, selection.rows, chunk_rows):
                positions = selection.positions[first : first + chunk_rows]
                yield Chunk(first, self._rows_for_positions(spec, positions, new_blocks=0))

    def _range_chunks(
        self, spec: Spec, selection: PositionRange, chunk_rows: int
    ) -> Iterator[Chunk]:
        """Chunks of ``chunk_rows`` rows: a block's rows as they are when one block holds
        the chunk, else copied from the blocks it spans."""
        for first in range(selection.start, selection.stop, chunk_rows):
            last = min(first + chunk_rows, selection.stop)
            yield self._range_chunk(spec, first, last, selection.start)

    def _range_chunk(self, spec: Spec, first: int, last: int, origin: int) -> Chunk:
        """Rows ``first .. last - 1`` of the range starting at ``origin``: a cached block's
        rows as they are when one block holds them, else copied from the blocks."""
        pieces = list(self._block_pieces(spec, first, last, origin))
        if len(pieces) == 1:
            return Chunk(first - origin, pieces[0].rows)
        rows = np.empty((last - first, spec.width), dtype=spec.encoding.dtype)
        for piece in pieces:
            rows[piece.row_offset : piece.row_offset + len(piece.rows)] = piece.rows
        return Chunk(first - origin, rows)

    def _range_messages(self, spec: Spec, selection: PositionRange, chunk_rows: int) -> StreamSteps:
        """``stream``'s steps for a range: a chunk that is exactly a cached block at the
        same row offset is that block's message, sent as it is; others are built.

        Chunks are at most a block: a block (1 MiB) is smaller than the largest chunk a
        server may allow (4 MiB), and chunks spanning two blocks would all be copies.
        Chunks of a whole block follow the blocks' boundaries (the first one ends at the
        first boundary).
        """
        block_rows = self.block_rows(spec)
        chunk_rows = min(chunk_rows, block_rows)
        origin = selection.start
        may_compute: bool | None = None
        first = origin
        while first < selection.stop:
            # A whole block's chunk ends at the block's end (not a sentinel: negative
            # positions have a block ending at 0).
            end = (first // block_rows + 1) * block_rows if chunk_rows == block_rows else None
            last = min(first + chunk_rows if end is None else end, selection.stop)
            whole = first % block_rows == 0 and last - first == block_rows
            message: bytes | None = None
            if whole:
                block = self.cache.lookup((spec.serial, first // block_rows))
                if block is not None and block.row_offset == first - origin:
                    message = block.message
            if message is None:
                while not may_compute:
                    may_compute = yield None
                if whole:
                    block = self._block(spec, first // block_rows, origin)
                    if block.row_offset == first - origin:
                        message = block.message
                if message is None:
                    chunk = self._range_chunk(spec, first, last, origin)
                    message = _response(spec, chunk)
            may_compute = yield message
            first = last

    def _block_pieces(self, spec: Spec, start: int, stop: int, origin: int) -> Iterator[Chunk]:
        """Rows ``start .. stop - 1`` as views of the cached blocks that hold them (blocks
        computed here carry row offsets from ``origin``, the start of the range asked for)."""
        block_rows = self.block_rows(spec)
        position = start
        while position < stop:
            index = position // block_rows
            rows = self._block(spec, index, origin).rows
            block_start = index * block_rows
            piece_end = min(block_start + block_rows, stop)
            yield Chunk(position - start, rows[position - block_start : piece_end - block_start])
            position = piece_end

    def _block(self, spec: Spec, index: int, origin: int = 0) -> Block:
        """Block ``index`` of ``spec`` (``block_rows`` rows), from the cache. A block
        computed here is serialized at its row offset in a range starting at ``origin``
        (0 when before it): the offset a stream of that range sends it at."""

        block_rows = self.block_rows(spec)

        def compute() -> Block:
            self._count_rows(block_rows)
            start = index * block_rows
            row_offset = max(0, start - origin)
            shape = (block_rows, spec.width)
            dtype = spec.encoding.dtype
            nbytes = block_rows * spec.row_bytes

            def fill(payload: memoryview) -> None:
                rows = np.frombuffer(payload, dtype=dtype).reshape(shape)
                engine.encode_range(spec.encoding, start, start + block_rows, out=rows)

            # The engine writes the rows straight into the message: one write, no copy.
            message = build_tensor_response(
                spec.dtype_code, row_offset, block_rows, spec.width, nbytes, fill
            )
            view = np.frombuffer(message, dtype=dtype, offset=len(message) - nbytes)
            return Block(message, row_offset, view.reshape(shape))

        return self.cache.get_or_compute((spec.serial, index), compute)

    def _rows_for_positions(
        self, spec: Spec, positions: npt.NDArray[np.int64], *, new_blocks: int
    ) -> Table:
        """Rows for arbitrary positions (see ``_gather``), gathered ``GATHER_POSITIONS`` at a
        time: grouping positions by block takes several times their own size in working
        memory, which a list of a million positions would otherwise take all at once."""
        if positions.size <= admission.GATHER_POSITIONS:
            return self._gather(spec, positions, _Allowance(new_blocks))
        out = np.empty((positions.size, spec.width), dtype=spec.encoding.dtype)
        allowance = _Allowance(new_blocks)
        for first in range(0, positions.size, admission.GATHER_POSITIONS):
            part = positions[first : first + admission.GATHER_POSITIONS]
            out[first : first + part.size] = self._gather(spec, part, allowance)
        return out

    def _gather(self, spec: Spec, positions: npt.NDArray[np.int64], allowance: _Allowance) -> Table:
        """Rows for arbitrary positions, from cached blocks where possible.

        A decode loop asks for the next position of each sequence at every step, so a block
        computed once serves the following steps too (a block costs only a few single rows:
        one extended-precision angle, then multiplications). Blocks already cached serve
        their rows; up to ``new_blocks`` missing blocks are computed and cached; the rows of
        any further blocks are computed one by one, so scattered positions cost a row each
        and do not flush the cache. ``allowance`` counts the new blocks left.
        """
        block_rows = self.block_rows(spec)
        block_ids = positions // block_rows
        offsets = positions - block_ids * block_rows
        first_block = int(block_ids[0])
        cached_block = self._block_lookup(spec, allowance)
        if (block_ids == first_block).all() and (block := cached_block(first_block)) is not None:
            rows: Table = block[offsets]
            return rows  # one block, as for one sequence's step: no grouping
        out = np.empty((positions.size, spec.width), dtype=spec.encoding.dtype)
        uncached: list[int] | npt.NDArray[np.intp]
        if positions.size <= _ROW_BY_ROW_GATHER:
            uncached = _copy_row_by_row(cached_block, block_ids, offsets, out)
        else:
            uncached = self._copy_by_block(spec, cached_block, block_ids, offsets, out)
        if len(uncached):
            self._count_rows(len(uncached))
            # In slices: the engine's working memory is many times its output's.
            step = admission.engine_slice_rows(spec.width)
            for first in range(0, len(uncached), step):
                part = uncached[first : first + step]
                out[part] = engine.encode_positions(spec.encoding, positions[part])
        return out

    def _block_lookup(self, spec: Spec, allowance: _Allowance) -> Callable[[int], Table | None]:
        """One gather's look-up of ``spec``'s blocks: a block from the cache, computed while
        ``allowance`` allows new ones (and only for a block asked for before); else None.
        Decided once per block for the gather."""
        blocks: dict[int, Table | None] = {}

        def cached_block(block_id: int) -> Table | None:
            if block_id not in blocks:
                key = (spec.serial, block_id)
                new = key not in self.cache
                if new and (allowance.blocks <= 0 or not self._seen_before(key)):
                    blocks[block_id] = None
                else:
                    allowance.blocks -= new
                    blocks[block_id] = self._block(spec, block_id).rows
            return blocks[block_id]

        return cached_block

    def _copy_by_block(
        self,
        spec: Spec,
        cached_block: Callable[[int], Table | None],
        block_ids: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        out: Table,
    ) -> npt.NDArray[np.intp]:
        """Copy into ``out`` the rows of the blocks ``cached_block`` gives, one gather per
        block; the rows left to compute.

        The blocks looked at one by one are the cached ones and the first _SEEN_BLOCKS
        others (where new blocks may be allowed and blocks asked for twice are noticed, both
        bounded). The rows of the others are left to compute with no Python step per block:
        a long list of scattered positions would otherwise spend its time in that loop."""
        order = np.argsort(block_ids, kind="stable")
        distinct_blocks, starts = np.unique(block_ids[order], return_index=True)
        sizes = np.diff(np.append(starts, block_ids.size))
        cached_ids = [block for serial, block in self.cache.cached_keys() if serial == spec.serial]
        looked = np.isin(distinct_blocks, np.array(cached_ids, dtype=np.int64))
        looked[:_SEEN_BLOCKS] = True
        groups: list[npt.NDArray[np.intp]] = [order[np.repeat(~looked, sizes)]]
        for index in np.flatnonzero(looked).tolist():
            group = order[starts[index] : starts[index] + sizes[index]]
            block = cached_block(int(distinct_blocks[index]))
            if block is None:
                groups.append(group)
            else:
                out[group] = block[offsets[group]]
        return np.concatenate(groups)

    def _seen_before(self, key: BlockKey) -> bool:
        """Whether a position list asked for rows of block ``key`` before (and remember
        that it has now)."""
        with self._counter_lock:
            if key in self._seen:
                del self._seen[key]
                return True
            self._seen[key] = None
            if len(self._seen) > _SEEN_BLOCKS:
                self._seen.popitem(last=False)
            return False

    def _count_rows(self, rows: int) -> None:
        with self._counter_lock:
            self._rows_computed += rows

    # Introspection --------------------------------------------------------------------------

    @property
    def rows_computed(self) -> int:
        """Rows computed by the engine since start (cache hits excluded)."""
        with self._counter_lock:
            return self._rows_computed

    def cache_stats(self) -> CacheStats:
        """The cache counters."""
        return self.cache.stats()

    def info(self, version: str) -> ServerInfo:
        """What GetServerInfo reports."""
        return ServerInfo(
            version=version,
            server_id=self.server_id,
            limits={
                **self.config.public_limits(),
                "max_receive_message_bytes": self.config.max_receive_message_bytes,
            },
            cache=self.cache_stats(),
            rows_computed=self.rows_computed,
        )


def _check_size(spec: Spec, selection: Selection, kind: str, limit: int, hint: str) -> None:
    size = selection.rows * spec.row_bytes
    if size > limit:
        raise LimitExceededError(
            f"the result is {size} bytes, over the {kind} limit of {limit} bytes: {hint}"
        )


def _response(spec: Spec, chunk: Chunk) -> bytes:
    """A serialized Get/StreamEncodingResponse, encoded by hand to copy the rows only once."""
    rows = np.ascontiguousarray(chunk.rows)
    return encode_tensor_response(
        spec.dtype_code,
        chunk.row_offset,
        rows.shape[0],
        spec.width,
        # Bytes, whatever the dtype: memoryview cannot export bfloat16.
        rows.reshape(-1).view(np.uint8).data,
    )


def _copy_row_by_row(
    cached_block: Callable[[int], Table | None],
    block_ids: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    out: Table,
) -> list[int]:
    """Copy into ``out``, row by row, the rows whose blocks ``cached_block`` gives; the rows
    left to compute. For a decode step of many sequences, about one row per block: there a
    row's copy is cheaper than a fancy-indexed gather per block."""
    uncached = []
    for row, (block_id, offset) in enumerate(
        zip(block_ids.tolist(), offsets.tolist(), strict=True)
    ):
        block = cached_block(block_id)
        if block is None:
            uncached.append(row)
        else:
            out[row] = block[offset]
    return uncached


@dataclass
class _Allowance:
    """New blocks a position list may still add to the cache."""

    blocks: int
