"""How position lists use the block cache, observed through the server's own counters."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import ml_dtypes
import numpy as np
import pytest
from reference import engine_positions, engine_range

from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc
from posenc_server import convert
from posenc_server.app import RunningServer
from posenc_server.config import ServerConfig
from posenc_server.service import EncodingService
from posenc_server.specs import SpecTable

# 16 KiB rows: blocks of 64 rows (256 Ki elements, 1 MiB).
SPEC = pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=4096))
BLOCK = 64


def scattered(blocks: int, offset: int = 3, per_block: int = 1) -> list[int]:
    """``per_block`` positions in each of ``blocks`` consecutive blocks, in shuffled order."""
    first = 5_000_000 * BLOCK + BLOCK * np.arange(blocks, dtype=np.int64) + offset
    positions = (first[:, None] + 7 * np.arange(per_block)).reshape(-1)
    return np.random.default_rng(blocks).permutation(positions).tolist()  # type: ignore[no-any-return]


class Server:
    """A raw stub on a fresh server, and its counters."""

    def __init__(self, running: RunningServer) -> None:
        options = [("grpc.max_receive_message_length", 80 << 20)]
        self.channel = grpc.insecure_channel(running.target, options=options)
        self.stub = posenc_pb2_grpc.PositionalEncodingServiceStub(self.channel)

    def get(self, positions: list[int]) -> bytes:
        request = pb.GetEncodingRequest(spec=SPEC, positions=pb.PositionList(positions=positions))
        return self.stub.GetEncoding(request).tensor.data

    def stream(self, positions: list[int], chunk_rows: int) -> list[pb.Tensor]:
        request = pb.StreamEncodingRequest(
            spec=SPEC,
            positions=pb.PositionList(positions=positions),
            max_chunk_bytes=chunk_rows * 4096 * 4,
        )
        return [response.chunk for response in self.stub.StreamEncoding(request)]

    def counters(self) -> tuple[int, int, int]:
        """(rows computed, cache entries, cache hits)."""
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest())
        return info.rows_computed, info.cache.entries, info.cache.hits


@pytest.fixture
def fresh(server_factory: Callable[..., RunningServer]) -> Iterator[Server]:
    # 300 rows of 16 KiB in one message.
    server = Server(server_factory(max_unary_bytes=8 << 20))
    yield server
    server.channel.close()


# 100 rows are gathered row by row, 300 block by block.
@pytest.mark.parametrize("per_block", [1, 3])
def test_a_unary_list_computes_new_blocks_up_to_16_rows_per_row_and_the_rest_row_by_row(
    fresh: Server, per_block: int
) -> None:
    positions = scattered(100, per_block=per_block)
    expected = engine_positions(SPEC, positions).tobytes()
    # The first time, only the rows: a table asked for once costs no blocks.
    assert fresh.get(positions) == expected
    assert fresh.counters()[:2] == (100 * per_block, 0)
    # Asked again (a decode loop's next step): 16 rows per requested row in new blocks (at
    # most 64 blocks), the rest one by one.
    assert fresh.get(positions) == expected
    rows, entries, _ = fresh.counters()
    new_blocks = min(64, 16 * len(positions) // BLOCK)
    assert entries == new_blocks
    assert rows == 100 * per_block + new_blocks * BLOCK + (100 - new_blocks) * per_block


def test_a_new_table_asked_for_once_per_spec_costs_its_rows_only(fresh: Server) -> None:
    # A dynamic-NTK decode loop: the spec (its base) changes every step.
    for seq_len in range(5000, 5010):
        spec = pb.EncodingSpec(
            rotary=pb.RotaryTable(
                head_dim=64,
                dynamic=pb.DynamicScaling(factor=4, max_position_embeddings=4096, seq_len=seq_len),
            )
        )
        request = pb.GetEncodingRequest(
            spec=spec, positions=pb.PositionList(positions=[seq_len - 1] * 8)
        )
        assert fresh.stub.GetEncoding(request).tensor.rows == 8
    rows, entries, _ = fresh.counters()
    assert (rows, entries) == (80, 0)


def test_a_unary_list_takes_every_cached_block_it_finds(fresh: Server) -> None:
    start = scattered(1, offset=0)[0]
    request = pb.StreamEncodingRequest(
        spec=SPEC, range=pb.PositionRange(start=start, stop=start + 64 * BLOCK)
    )
    assert len(list(fresh.stub.StreamEncoding(request))) == 64  # 64 blocks cached
    computed, _, hits = fresh.counters()
    # Rows of the same 64 blocks: all from the cache, nothing computed.
    positions = scattered(64, offset=40)
    assert fresh.get(positions) == engine_positions(SPEC, positions).tobytes()
    rows, _, hits_after = fresh.counters()
    assert rows == computed
    assert hits_after - hits >= 64


def test_a_streamed_list_reads_cached_blocks_but_computes_no_new_ones(fresh: Server) -> None:
    for position in scattered(10):
        fresh.get([position])
        fresh.get([position])  # a block each: blocks 0 .. 9 of the list's 20 are cached
    computed, entries, _ = fresh.counters()
    positions = scattered(20, offset=11)
    chunks = fresh.stream(positions, chunk_rows=8)
    assert [chunk.row_offset for chunk in chunks] == [0, 8, 16]
    assert b"".join(c.data for c in chunks) == engine_positions(SPEC, positions).tobytes()
    rows, entries_after, _ = fresh.counters()
    assert entries_after == entries
    assert rows == computed + 10  # only the uncached blocks' rows


def test_evicting_enough_asks_for_a_heap_trim() -> None:
    # The service's signal to the housekeeping thread (which trims the heap): no call
    # reports it, so this test drives the service on its own.
    config = ServerConfig(cache_bytes=8 << 20)
    service, specs = EncodingService(config), SpecTable(config)
    start = BLOCK * 1_000_000

    def get(positions: list[int]) -> None:
        request = pb.GetEncodingRequest(spec=SPEC, positions=pb.PositionList(positions=positions))
        service.unary(specs.resolve(convert.encoding_query(request, config)))

    # 1 MiB blocks, one per single-position request: the first 8 fill the budget, the next
    # 16 evict 16 MiB.
    # (Each twice: a position list caches a block the second time it asks for it.)
    for block in range(8):
        get([start + BLOCK * block])
        get([start + BLOCK * block])
    assert not service.trim_due.is_set()
    for block in range(8, 23):
        get([start + BLOCK * block])
        get([start + BLOCK * block])
    assert not service.trim_due.is_set()  # 15 MiB evicted
    get([start + BLOCK * 23])
    get([start + BLOCK * 23])
    assert service.trim_due.is_set()


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_scattered_positions_of_a_narrow_table_cost_about_their_rows(
    server_factory: Callable[..., RunningServer], dtype: str
) -> None:
    # The trial's case (issue 10, item 9): 64 scattered positions at d_model 1 computed
    # 64 blocks of a whole 1 MiB chunk each, 33,554,432 rows for 64 in float16.
    server = Server(server_factory())
    spec = pb.EncodingSpec(
        dtype=pb.Dtype.Value(f"DTYPE_{dtype.upper()}"), sinusoidal=pb.SinusoidalTable(d_model=1)
    )
    positions = np.random.default_rng(9).integers(-(2**42), 2**42, 64).tolist()
    request = pb.GetEncodingRequest(spec=spec, positions=pb.PositionList(positions=positions))
    before, _, _ = server.counters()
    tensor = server.stub.GetEncoding(request).tensor
    assert tensor.rows == 64
    rows, _, _ = server.counters()
    # At most one new block (1 MiB: 512 Ki float16 elements) besides 16 rows per requested row.
    assert rows - before <= (1 << 20) // np.dtype(dtype).itemsize + 16 * 64, rows - before
    server.channel.close()


def test_a_range_streams_as_whole_blocks_that_are_sent_again_as_they_are(fresh: Server) -> None:
    # bfloat16 rows of 16 KiB: blocks of 64 rows are 1 MiB, as float32's of half the width.
    # Chunks are whole blocks, on the blocks' boundaries (the first runs to the first
    # boundary), so a range asked again is its cached blocks' messages.
    spec = pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=8192), dtype=pb.DTYPE_BFLOAT16)
    start = 7_000_000 * BLOCK + 10
    request = pb.StreamEncodingRequest(
        spec=spec,
        range=pb.PositionRange(start=start, stop=start + 5 * BLOCK),
        max_chunk_bytes=1 << 20,
    )
    computed, _, hits = fresh.counters()
    first = [response.chunk for response in fresh.stub.StreamEncoding(request)]
    assert [(chunk.row_offset, chunk.rows) for chunk in first] == [
        (0, 54),
        (54, 64),
        (118, 64),
        (182, 64),
        (246, 64),
        (310, 10),
    ]
    assert fresh.counters()[0] - computed == 6 * BLOCK
    again = [response.chunk for response in fresh.stub.StreamEncoding(request)]
    assert [chunk.data for chunk in again] == [chunk.data for chunk in first]
    after_computed, _, after_hits = fresh.counters()
    assert after_computed - computed == 6 * BLOCK  # nothing computed the second time
    assert after_hits - hits == 6
    rows = np.frombuffer(b"".join(chunk.data for chunk in first), dtype=ml_dtypes.bfloat16)
    expected = engine_range(spec, start, start + 5 * BLOCK)
    np.testing.assert_array_equal(rows.reshape(expected.shape), expected)
    # Negative positions too: the block of -10 ends at 0.
    request = pb.StreamEncodingRequest(
        spec=spec, range=pb.PositionRange(start=-10, stop=2 * BLOCK), max_chunk_bytes=1 << 20
    )
    chunks = [response.chunk for response in fresh.stub.StreamEncoding(request)]
    assert [(chunk.row_offset, chunk.rows) for chunk in chunks] == [(0, 10), (10, 64), (74, 64)]


def test_a_list_over_thousands_of_blocks_reads_the_cached_ones_and_computes_the_rest(
    fresh: Server,
) -> None:
    # 5,000 scattered rows in as many blocks, and 6 rows of the 3 cached blocks with the
    # highest ids: past the first 4,096 blocks, which the service looks at one by one, the
    # cached ones are found by their ids, the others' rows computed without a step each.
    spec = pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=16))  # blocks of 16,384 rows
    block = 16_384
    base = 9_000_000
    cached = [(base + 20_000 + i) * block for i in range(3)]
    fresh.stub.GetEncoding(
        pb.GetEncodingRequest(
            spec=spec, range=pb.PositionRange(start=cached[0], stop=cached[-1] + block)
        )
    )
    scattered_rows = [(base + 2 * i) * block + i for i in range(5000)]
    in_cached = [first + offset for first in cached for offset in (5, 9000)]
    positions = np.random.default_rng(5).permutation(scattered_rows + in_cached).tolist()
    computed, entries, hits = fresh.counters()
    request = pb.GetEncodingRequest(spec=spec, positions=pb.PositionList(positions=positions))
    data = fresh.stub.GetEncoding(request).tensor.data
    rows = np.frombuffer(data, dtype=np.float32).reshape(len(positions), 16)
    np.testing.assert_array_equal(rows, engine_positions(spec, positions))
    after_computed, after_entries, after_hits = fresh.counters()
    assert after_computed - computed == 5000  # the cached blocks' 6 rows are read
    assert after_entries == entries  # none of the new blocks was asked for before
    assert after_hits - hits == 3


@pytest.mark.slow
def test_a_warm_stream_needs_no_worker(server_factory: Callable[..., RunningServer]) -> None:
    # Every thread of the server's pool is held by a task that waits for the test's gate; a
    # range of a known spec whose blocks are all cached must stream meanwhile: its request is
    # parsed and its messages taken from the cache on the event loop, none of it queued for a
    # worker. Had it needed one, it could not finish before the gate opens, and the gate only
    # opens after it finished or missed its deadline: no ordering of clock readings decides.
    running = server_factory(workers=2, max_concurrent_streams=1)
    server = Server(running)
    start = 7_000_000 * BLOCK
    warm = pb.StreamEncodingRequest(
        spec=SPEC, range=pb.PositionRange(start=start, stop=start + 32 * BLOCK)
    )
    expected = b"".join(response.chunk.data for response in server.stub.StreamEncoding(warm))
    gate = threading.Event()
    holding = threading.Semaphore(0)

    def hold() -> None:
        holding.release()
        gate.wait()

    held = [running.pool.submit(hold) for _ in range(2)]
    try:
        for _ in held:
            assert holding.acquire(timeout=30), "a pool thread never took its task"
        responses = list(server.stub.StreamEncoding(warm, timeout=30))
        assert not any(future.done() for future in held), "the pool was free during the stream"
        assert len(responses) == 32
        assert b"".join(response.chunk.data for response in responses) == expected
    finally:
        gate.set()
        for future in held:
            future.result(timeout=30)
