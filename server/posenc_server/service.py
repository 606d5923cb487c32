"""The encoding service as plain Python: validation, limits, block caching, chunking.

Rows are computed in fixed blocks of ``block_rows`` consecutive positions, aligned to
multiples of ``block_rows``, so that any range request reuses the blocks of earlier ones. A
block is at most ``max_chunk_bytes``, so a cached block never has to be re-split to respect
the chunk limit unless the client asks for smaller chunks.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from posenc_server import engine
from posenc_server.cache import BlockCache, CacheStats
from posenc_server.config import ServerConfig
from posenc_server.engine import EncodingSpec
from posenc_server.errors import FieldViolation, InvalidRequestError, LimitExceededError

Table = npt.NDArray[np.generic]
BlockKey = tuple[int, int]  # (spec id, block index)
# Specs with an id at once; beyond, the least recently used is forgotten.
_MAX_SPEC_IDS = 4096
# A unary position list computes at most this many new blocks (of max_chunk_bytes each);
# the rows of further uncached blocks are computed one by one.
_MAX_NEW_BLOCKS_PER_LIST = 64
# Evicting this much frees enough heap to trim it at once rather than at the next tick.
_TRIM_AFTER_EVICTED_BYTES = 16 << 20
# Position lists up to this long are gathered row by row, longer ones block by block.
_ROW_BY_ROW_GATHER = 256


@dataclass(frozen=True)
class PositionRange:
    """Positions ``start .. stop - 1``."""

    start: int
    stop: int

    @property
    def rows(self) -> int:
        """Number of rows selected."""
        return self.stop - self.start


@dataclass(frozen=True, eq=False)
class PositionList:
    """Explicit positions, in the order the rows are wanted."""

    positions: npt.NDArray[np.int64]

    @property
    def rows(self) -> int:
        """Number of rows selected."""
        return int(self.positions.size)


Selection = PositionRange | PositionList


@dataclass(frozen=True)
class Chunk:
    """Rows ``row_offset .. row_offset + len(rows) - 1`` of a selection's table."""

    row_offset: int
    rows: Table


def validate_spec(
    d_model: int, base: float, max_d_model: int, violations: list[FieldViolation]
) -> None:
    """Append the problems of ``d_model`` and ``base`` to ``violations``."""
    if not 1 <= d_model <= max_d_model:
        violations.append(
            FieldViolation("spec.d_model", f"must be between 1 and {max_d_model}, got {d_model}")
        )
    if not engine.is_valid_base(base):
        violations.append(
            FieldViolation("spec.base", f"must be finite and greater than 1, got {base!r}")
        )


class EncodingService:
    """Validates requests against the limits and produces their tables, through the cache."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # Set when enough has been evicted that the heap is worth trimming now (the
        # housekeeping thread trims; see app.housekeeping).
        self.trim_due = threading.Event()
        self._evicted_since_trim = 0
        self.cache: BlockCache[BlockKey] = BlockCache(config.cache_bytes, self._count_evicted)
        # Host and pid for operators; the random part tells apart servers of one process.
        self.server_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._rows_computed = 0
        self._counter_lock = threading.Lock()
        self._spec_ids: OrderedDict[EncodingSpec, int] = OrderedDict()
        self._next_spec_id = itertools.count()

    def _count_evicted(self, nbytes: int) -> None:
        # Under the cache's lock: no lock of its own needed.
        self._evicted_since_trim += nbytes
        if self._evicted_since_trim >= _TRIM_AFTER_EVICTED_BYTES:
            self._evicted_since_trim = 0
            self.trim_due.set()

    # Validation -----------------------------------------------------------------------------

    def validate_selection(
        self, selection: Selection, violations: list[FieldViolation]
    ) -> list[FieldViolation]:
        """Append the problems of ``selection`` to ``violations`` and return it."""
        limit = self.config.max_abs_position
        if isinstance(selection, PositionRange):
            if selection.start > selection.stop:
                violations.append(
                    FieldViolation(
                        "range.stop",
                        f"must be >= range.start ({selection.start}), got {selection.stop}",
                    )
                )
            if abs(selection.start) > limit:
                violations.append(
                    FieldViolation(
                        "range.start",
                        f"|position| must be at most {limit}, got {selection.start}",
                    )
                )
            # stop is exclusive: the last row is stop - 1.
            if selection.stop - 1 > limit or selection.stop < -limit:
                violations.append(
                    FieldViolation(
                        "range.stop",
                        f"must be between {-limit} and {limit + 1}, got {selection.stop}",
                    )
                )
            return violations
        count = selection.rows
        if not 1 <= count <= self.config.max_positions:
            violations.append(
                FieldViolation(
                    "positions.positions",
                    f"must hold 1 to {self.config.max_positions} positions, got {count}",
                )
            )
        elif (
            # Not np.abs: it overflows (stays negative) for -2**63.
            bad := np.flatnonzero((selection.positions > limit) | (selection.positions < -limit))
        ).size:
            index = int(bad[0])
            violations.append(
                FieldViolation(
                    f"positions.positions[{index}]",
                    f"|position| must be at most {limit}, got {int(selection.positions[index])}"
                    + (f" ({bad.size} positions out of range)" if bad.size > 1 else ""),
                )
            )
        return violations

    @staticmethod
    def raise_if_invalid(violations: list[FieldViolation]) -> None:
        """Raise InvalidRequestError when ``violations`` is not empty."""
        if violations:
            raise InvalidRequestError(violations)

    def check_unary_size(self, spec: EncodingSpec, selection: Selection) -> None:
        """Refuse a GetEncoding result over the unary limit."""
        limit = self.config.max_unary_bytes
        _check_size(spec, selection, "unary", limit, "use StreamEncoding for large results")

    def check_stream_size(self, spec: EncodingSpec, selection: Selection) -> None:
        """Refuse a StreamEncoding result over the stream limit."""
        limit = self.config.max_stream_bytes
        _check_size(spec, selection, "stream", limit, "split the request into smaller ranges")

    def chunk_rows(self, spec: EncodingSpec, requested_chunk_bytes: int) -> int:
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

    def block_rows(self, spec: EncodingSpec) -> int:
        """Rows per cached block: as many as fit in one maximal chunk."""
        return max(1, self.config.max_chunk_bytes // spec.row_bytes)

    def table(self, spec: EncodingSpec, selection: Selection) -> Table:
        """The whole table of a small (unary) selection, in one array (read-only when it is
        a cached block's rows as they are).

        Position lists go through the cache here: they are decode steps, whose blocks the
        next steps ask for again.
        """
        if isinstance(selection, PositionList):
            return self._rows_for_positions(
                spec, selection.positions, new_blocks=_MAX_NEW_BLOCKS_PER_LIST
            )
        chunks = list(self._range_chunks(spec, selection, self.block_rows(spec)))
        if len(chunks) == 1:
            return chunks[0].rows  # within one block: no copy before the message's
        out = np.empty((selection.rows, spec.d_model), dtype=spec.numpy_dtype)
        for chunk in chunks:
            out[chunk.row_offset : chunk.row_offset + len(chunk.rows)] = chunk.rows
        return out

    def chunks(self, spec: EncodingSpec, selection: Selection, chunk_rows: int) -> Iterator[Chunk]:
        """The table of a (validated) selection as consecutive chunks of <= chunk_rows rows.

        Lazy: each chunk is computed when the consumer asks for it, so a cancelled stream stops
        computing and memory stays at a few chunks whatever the size of the selection. Long
        position lists take the rows of blocks already cached and compute the others row
        by row: new blocks for scattered positions could cost a block per row and flush the
        cache.
        """
        if isinstance(selection, PositionRange):
            yield from self._range_chunks(spec, selection, chunk_rows)
        else:
            for first in range(0, selection.rows, chunk_rows):
                positions = selection.positions[first : first + chunk_rows]
                yield Chunk(first, self._rows_for_positions(spec, positions, new_blocks=0))

    def _range_chunks(
        self, spec: EncodingSpec, selection: PositionRange, chunk_rows: int
    ) -> Iterator[Chunk]:
        block_rows = self.block_rows(spec)
        spec_id = self._spec_id(spec)
        position = selection.start
        while position < selection.stop:
            index = position // block_rows
            block = self._block(spec, spec_id, index, block_rows)
            block_start = index * block_rows
            block_stop = min(block_start + block_rows, selection.stop)
            while position < block_stop:
                end = min(position + chunk_rows, block_stop)
                yield Chunk(
                    position - selection.start,
                    block[position - block_start : end - block_start],
                )
                position = end

    def _block(self, spec: EncodingSpec, spec_id: int, index: int, block_rows: int) -> Table:
        """Block ``index`` of ``spec`` (whose ``_spec_id`` is ``spec_id``), from the cache."""

        def compute() -> Table:
            self._count_rows(block_rows)
            start = index * block_rows
            return engine.encode_range(spec, start, start + block_rows)

        return self.cache.get_or_compute((spec_id, index), compute)

    def _spec_id(self, spec: EncodingSpec) -> int:
        """A small integer standing for ``spec`` in cache keys.

        Hashing a spec (a dataclass of floats, enums and preset parameters) costs
        microseconds, and a decode step looks up dozens of blocks: an int hashes at once.
        The table of ids is bounded; a forgotten spec gets a new id, and its old blocks
        age out of the cache.
        """
        with self._counter_lock:
            spec_id = self._spec_ids.get(spec)
            if spec_id is None:
                spec_id = self._spec_ids[spec] = next(self._next_spec_id)
                if len(self._spec_ids) > _MAX_SPEC_IDS:
                    self._spec_ids.popitem(last=False)
            else:
                self._spec_ids.move_to_end(spec)
            return spec_id

    def _rows_for_positions(
        self, spec: EncodingSpec, positions: npt.NDArray[np.int64], *, new_blocks: int
    ) -> Table:
        """Rows for arbitrary positions, from cached blocks where possible.

        A decode loop asks for the next position of each sequence at every step, so a block
        computed once serves the following steps too (a block costs only a few single rows:
        one extended-precision angle, then multiplications). Blocks already cached serve
        their rows; up to ``new_blocks`` missing blocks are computed and cached; the rows of
        any further blocks are computed one by one, so scattered positions cost a row each
        and do not flush the cache.
        """
        block_rows = self.block_rows(spec)
        block_ids = positions // block_rows
        spec_id = self._spec_id(spec)
        offsets = positions - block_ids * block_rows
        first_block = int(block_ids[0])
        if (block_ids == first_block).all() and (
            new_blocks > 0 or (spec_id, first_block) in self.cache
        ):
            rows: Table = self._block(spec, spec_id, first_block, block_rows)[offsets]
            return rows  # one block, as for one sequence's step: no grouping
        out = np.empty((positions.size, spec.d_model), dtype=spec.numpy_dtype)

        def cached_block(block_id: int) -> Table | None:
            """The block from the cache, computed while new ones are allowed; else None."""
            nonlocal new_blocks
            if (spec_id, block_id) not in self.cache:
                if new_blocks <= 0:
                    return None
                new_blocks -= 1
            return self._block(spec, spec_id, block_id, block_rows)

        uncached: list[int] | npt.NDArray[np.intp]
        if positions.size <= _ROW_BY_ROW_GATHER:
            # A decode step of many sequences: about one row per block, where copying row
            # by row costs a fifth of a fancy-indexed gather per block.
            blocks: dict[int, Table | None] = {}
            uncached = []
            for row, (block_id, offset) in enumerate(
                zip(block_ids.tolist(), offsets.tolist(), strict=True)
            ):
                if block_id not in blocks:
                    blocks[block_id] = cached_block(block_id)
                block = blocks[block_id]
                if block is None:
                    uncached.append(row)
                else:
                    out[row] = block[offset]
        else:
            # Rows grouped by block: one gather per block.
            order = np.argsort(block_ids, kind="stable")
            distinct_blocks, starts = np.unique(block_ids[order], return_index=True)
            bounds = [*starts[1:].tolist(), positions.size]
            groups: list[npt.NDArray[np.intp]] = []
            for block_id, first, last in zip(
                distinct_blocks.tolist(), starts.tolist(), bounds, strict=True
            ):
                group = order[first:last]
                block = cached_block(block_id)
                if block is None:
                    groups.append(group)
                else:
                    out[group] = block[offsets[group]]
            uncached = np.concatenate(groups) if groups else []
        if len(uncached):
            self._count_rows(len(uncached))
            out[uncached] = engine.encode_positions(spec, positions[uncached])
        return out

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


def _check_size(spec: EncodingSpec, selection: Selection, kind: str, limit: int, hint: str) -> None:
    size = selection.rows * spec.row_bytes
    if size > limit:
        raise LimitExceededError(
            f"the result is {size} bytes, over the {kind} limit of {limit} bytes: {hint}"
        )
