"""The encoding service without gRPC: how position lists use the block cache."""

from __future__ import annotations

import numpy as np
import pytest

from posenc_server.config import ServerConfig
from posenc_server.engine import EncodingSpec, encode_positions
from posenc_server.service import EncodingService, PositionList

SPEC = EncodingSpec(d_model=4096)  # 16 KiB rows: blocks of 64 rows (1 MiB)


def scattered(blocks: int, offset: int = 3, per_block: int = 1) -> PositionList:
    """``per_block`` positions in each of ``blocks`` consecutive blocks, in shuffled order."""
    first = 5_000_000 * 64 + 64 * np.arange(blocks, dtype=np.int64) + offset
    positions = (first[:, None] + 7 * np.arange(per_block)).reshape(-1)
    return PositionList(np.random.default_rng(blocks).permutation(positions))


# 100 rows are gathered row by row, 300 block by block.
@pytest.mark.parametrize("per_block", [1, 3])
def test_a_unary_list_computes_at_most_64_new_blocks_and_the_rest_row_by_row(
    per_block: int,
) -> None:
    service = EncodingService(ServerConfig())
    selection = scattered(100, per_block=per_block)
    rows = service.table(SPEC, selection)
    assert rows.tobytes() == encode_positions(SPEC, selection.positions).tobytes()
    assert service.cache_stats().entries == 64
    # 64 blocks, then the rows of the other 36 one by one.
    assert service.rows_computed == 64 * 64 + 36 * per_block


def test_a_unary_list_takes_every_cached_block_it_finds() -> None:
    service = EncodingService(ServerConfig())
    service.table(SPEC, scattered(64))
    computed = service.rows_computed
    # Other rows of the same 64 blocks: all from the cache, nothing computed.
    rows = service.table(SPEC, scattered(64, offset=40))
    assert rows.tobytes() == encode_positions(SPEC, scattered(64, offset=40).positions).tobytes()
    assert service.rows_computed == computed
    assert service.cache_stats().hits >= 64


def test_a_streamed_list_reads_cached_blocks_but_computes_no_new_ones() -> None:
    service = EncodingService(ServerConfig())
    service.table(SPEC, scattered(10))  # blocks 0 .. 9 of the list's 20 are cached
    computed, entries = service.rows_computed, service.cache_stats().entries
    selection = scattered(20, offset=11)
    chunks = list(service.chunks(SPEC, selection, chunk_rows=8))
    rows = np.concatenate([chunk.rows for chunk in chunks])
    assert [chunk.row_offset for chunk in chunks] == [0, 8, 16]
    assert rows.tobytes() == encode_positions(SPEC, selection.positions).tobytes()
    assert service.cache_stats().entries == entries
    assert service.rows_computed == computed + 10  # only the uncached blocks' rows


def test_evicting_enough_asks_for_a_heap_trim() -> None:
    service = EncodingService(ServerConfig(cache_bytes=8 << 20))
    start = 64 * 1_000_000
    # 1 MiB blocks: the first 8 fill the budget, the next 16 evict 16 MiB.
    service.table(SPEC, PositionList(start + 64 * np.arange(8, dtype=np.int64)))
    assert not service.trim_due.is_set()
    service.table(SPEC, PositionList(start + 64 * np.arange(8, 23, dtype=np.int64)))
    assert not service.trim_due.is_set()  # 15 MiB evicted
    service.table(SPEC, PositionList(np.array([start + 64 * 23])))
    assert service.trim_due.is_set()


def test_the_most_negative_int64_is_out_of_range() -> None:
    service = EncodingService(ServerConfig())
    violations = service.validate_selection(
        PositionList(np.array([5, -(2**63), 2**62], dtype=np.int64)), []
    )
    assert [v.field for v in violations] == ["positions.positions[1]"]
    assert "(2 positions out of range)" in violations[0].description
