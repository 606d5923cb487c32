"""torch results of the SDK's table methods (dtype, device, out=, any-shape positions,
(cos, sin) pairs) for Client, AsyncClient and GrowingTable, and the growing tables themselves
(GrowingTable and AsyncGrowingTable).

Every tensor is checked bit for bit against the numpy rows of the same call: the server's
rows, whatever form they are handed back in.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")

from conftest import Recorder  # noqa: E402

import posenc  # noqa: E402
from posenc import AsyncGrowingTable, GrowingTable  # noqa: E402
from posenc_protocol.v1 import posenc_pb2 as pb  # noqa: E402

ROTARY = posenc.Spec("rotary", head_dim=16, rope_theta=500000.0)
SINUSOIDAL = posenc.Spec("sinusoidal", d_model=24)
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@pytest.fixture
def client(server: Any) -> Iterator[posenc.Client]:
    with posenc.Client(server.target) as client:
        yield client


def bits(rows: Any) -> Any:
    """The bytes of rows (numpy, ml_dtypes or torch) as unsigned integers, to compare."""
    if isinstance(rows, torch.Tensor):
        size = rows.element_size()
        rows = rows.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
        return rows.numpy().view(f"u{size}")
    rows = np.ascontiguousarray(rows)
    return rows.view(f"u{rows.dtype.itemsize}")


# -- tensors from the client ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_torch_dtypes_give_tensors_of_the_servers_rows(client: posenc.Client, name: str) -> None:
    rows = client.get_range(1000, 1040, ROTARY, dtype=TORCH_DTYPES[name])
    assert isinstance(rows, torch.Tensor)
    assert rows.dtype == TORCH_DTYPES[name] and rows.shape == (40, 32)
    # bfloat16 included: the server's bits, never rounded through float32.
    expected = client.get_range(1000, 1040, ROTARY, dtype=name)
    assert np.array_equal(bits(rows), bits(expected))
    on_cpu = client.get_positions([5, 3], ROTARY, dtype=name, device="cpu")
    assert isinstance(on_cpu, torch.Tensor) and on_cpu.dtype == TORCH_DTYPES[name]
    assert np.array_equal(bits(on_cpu), bits(client.get_positions([5, 3], ROTARY, dtype=name)))


def test_numpy_stays_the_default_and_bad_dtypes_name_the_field(client: posenc.Client) -> None:
    assert isinstance(client.get_range(0, 4, ROTARY), np.ndarray)
    with pytest.raises(posenc.InvalidArgumentError) as error:
        client.get_range(0, 4, ROTARY, dtype=torch.int32)
    assert error.value.field_violations[0][0] == "spec.dtype"


def test_positions_of_any_shape(client: posenc.Client) -> None:
    flat = client.get_positions([3, 1, 4, 1, 5, 9, 2, 6], ROTARY)
    grid = client.get_positions([[3, 1, 4, 1], [5, 9, 2, 6]], ROTARY)
    assert isinstance(grid, np.ndarray) and grid.shape == (2, 4, 32)
    assert np.array_equal(grid.reshape(8, 32), flat)
    cube = client.get_positions(np.array([3, 1, 4, 1, 5, 9, 2, 6]).reshape(2, 2, 2), ROTARY)
    assert cube.shape == (2, 2, 2, 32) and np.array_equal(cube.reshape(8, 32), flat)
    # Tensor positions (position_ids [batch, seq]) give a tensor on their device.
    ids = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    rows = client.get_positions(ids, ROTARY)
    assert isinstance(rows, torch.Tensor) and rows.shape == (2, 4, 32)
    assert rows.device == ids.device and np.array_equal(rows.numpy(), grid)
    one = client.get_positions(torch.tensor(7), ROTARY)  # a 0-d position: one row
    assert one.shape == (32,) and np.array_equal(one.numpy(), client.get_positions([7], ROTARY)[0])
    with pytest.raises(posenc.InvalidArgumentError) as error:
        client.get_positions(torch.tensor([[0.5]]), ROTARY)
    assert error.value.field_violations[0][0] == "positions"


@pytest.mark.parametrize("layout", ["transformers", "vllm", "gptj"])
def test_cos_sin_pairs_in_the_named_layout(client: posenc.Client, layout: str) -> None:
    spec = posenc.Spec("rotary", head_dim=16, rope_theta=10000.0, layout=layout)
    rows = client.get_positions([[0, 7, 1 << 20]], spec)
    cos, sin = client.get_positions([[0, 7, 1 << 20]], spec, cos_sin=True)
    width = rows.shape[-1]
    assert cos.shape == sin.shape == (1, 3, width // 2)
    assert np.array_equal(cos, rows[..., : width // 2])
    assert np.array_equal(sin, rows[..., width // 2 :])
    # Position 0: cos 1, sin 0 in every layout (no attention factor here).
    assert np.all(cos[0, 0] == 1.0) and np.all(sin[0, 0] == 0.0)
    tcos, _ = client.get_range(0, 3, spec, dtype=torch.float32, cos_sin=True)
    assert isinstance(tcos, torch.Tensor) and tcos.shape == (3, width // 2)
    with pytest.raises(posenc.InvalidArgumentError) as error:
        client.get_range(0, 3, SINUSOIDAL, cos_sin=True)
    assert error.value.field_violations[0][0] == "cos_sin"


def test_out_buffers_are_filled_in_place(client: posenc.Client) -> None:
    expected = client.get_range(1000, 1100, SINUSOIDAL, dtype="float16")
    out = torch.empty(100, 24, dtype=torch.float16)
    pointer = out.data_ptr()
    assert client.get_range(1000, 1100, SINUSOIDAL, out=out) is out  # dtype: out's
    assert out.data_ptr() == pointer and np.array_equal(out.numpy(), expected)
    buffer = np.empty((100, 24), dtype=np.float16)
    assert client.get_range(1000, 1100, SINUSOIDAL, out=buffer) is buffer
    assert np.array_equal(buffer, expected)
    # bfloat16 tensors, any-shape positions, (cos, sin) views of the buffer.
    grid = torch.empty(2, 3, 32, dtype=torch.bfloat16)
    cos, _ = client.get_positions([[1, 2, 3], [4, 5, 6]], ROTARY, out=grid, cos_sin=True)
    assert cos.data_ptr() == grid.data_ptr()
    expected16 = client.get_positions([1, 2, 3, 4, 5, 6], ROTARY, dtype="bfloat16")
    assert np.array_equal(bits(grid).reshape(6, 32), bits(expected16))
    # Non-contiguous buffers are filled by a copy.
    wide = torch.zeros(100, 48, dtype=torch.float16)
    client.get_range(1000, 1100, SINUSOIDAL, out=wide[:, :24])
    assert np.array_equal(wide[:, :24].numpy(), expected) and not wide[:, 24:].any()
    strided = np.zeros((100, 48), dtype=np.float16)
    assert client.get_range(1000, 1100, SINUSOIDAL, out=strided[:, ::2]) is not None
    assert np.array_equal(strided[:, ::2], expected) and not strided[:, 1::2].any()


@pytest.mark.parametrize(
    ("out", "field"),
    [
        (np.empty((99, 24), np.float32), "out"),  # rows
        (np.empty((100, 25), np.float32), "out"),  # width: known only from the response
        (np.empty((100, 24), np.float64), "out"),  # dtype differs from dtype=
        ([[0.0] * 24] * 100, "out"),
        (np.broadcast_to(np.float32(0), (100, 24)), "out"),  # read-only
    ],
)
def test_bad_out_buffers_name_the_field(client: posenc.Client, out: Any, field: str) -> None:
    with pytest.raises(posenc.InvalidArgumentError) as error:
        client.get_range(0, 100, SINUSOIDAL, dtype="float32", out=out)
    assert error.value.field_violations[0][0] == field


@pytest.mark.slow
def test_a_decode_loop_with_out_allocates_no_result(spawn_server: Any) -> None:
    # The server in its own process: tracemalloc sees the client's allocations only.
    server = spawn_server()
    spec = posenc.Spec("rotary", head_dim=256)  # 2 KiB rows
    starts = np.arange(64) * 100_000
    out = np.empty((64, 512), dtype=np.float32)  # 128 KiB a step

    def peak(out: Any) -> int:
        with posenc.Client(server.target) as client:
            for step in range(3):  # warms the read-ahead: later steps are served from it
                client.get_positions(starts + step, spec, out=out)
            kept = []  # results stay alive, as a caller's would
            tracemalloc.start()
            try:
                for step in range(3, 7):
                    kept.append(client.get_positions(starts + step, spec, out=out))
                return tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()

    # Rows go from the read-ahead batches straight into out: four steps allocate less than
    # one result in all (the row cache's bookkeeping); without out, one result a step.
    assert peak(out) < out.nbytes
    assert peak(None) >= 4 * out.nbytes


def test_iterators_yield_tensors(client: posenc.Client) -> None:
    expected = client.get_range(0, 5000, SINUSOIDAL, dtype="bfloat16")
    received = 0
    for first, rows in client.iter_range(
        0, 5000, SINUSOIDAL, dtype=torch.bfloat16, chunk_bytes=16384
    ):
        assert isinstance(rows, torch.Tensor) and rows.dtype == torch.bfloat16
        assert np.array_equal(bits(rows), bits(expected[first : first + len(rows)]))
        received += len(rows)
    assert received == 5000


def test_async_client_gives_the_same_tensors(server: Any) -> None:
    async def main() -> tuple[Any, Any, Any]:
        async with posenc.AsyncClient(server.target) as client:
            grid = await client.get_positions(torch.tensor([[1, 2], [3, 4]]), ROTARY)
            out = torch.empty(4, 32, dtype=torch.bfloat16)
            await client.get_range(0, 4, ROTARY, out=out)
            pair = await client.get_range(0, 4, ROTARY, dtype="float64", cos_sin=True)
            return grid, out, pair

    grid, out, (cos, sin) = asyncio.run(main())
    with posenc.Client(server.target) as client:
        assert np.array_equal(grid.numpy(), client.get_positions([[1, 2], [3, 4]], ROTARY))
        expected = client.get_range(0, 4, ROTARY, dtype="bfloat16")
        assert np.array_equal(bits(out), bits(expected))
        assert np.array_equal(cos, client.get_range(0, 4, ROTARY, dtype="float64")[:, :16])
    assert isinstance(sin, np.ndarray)


@pytest.mark.slow
def test_base_sdk_and_server_never_import_torch(server: Any) -> None:
    code = (
        "import sys, numpy as np, posenc, posenc.integrations, posenc_server.service\n"
        f"with posenc.Client({server.target!r}) as c:\n"
        "    c.get_range(0, 4, 8, out=np.empty((4, 8), np.float32))\n"
        "    c.get_positions([[1, 2]], 8)\n"
        "    posenc.GrowingTable(c, 8).get([[3]])\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"


# -- the growing table ----------------------------------------------------------------------------


def test_rows_are_fetched_once_then_served_from_memory(client: posenc.Client) -> None:
    table = GrowingTable(client, ROTARY, min_rows=256)
    first = table.get([[0, 5], [7, 100]])
    assert first.shape == (2, 2, 32) and len(table) == 256 and table.fetches == 1
    for _ in range(5):
        table.get(np.arange(200))
    assert table.fetches == 1
    expected = client.get_range(0, 256, ROTARY)
    assert np.array_equal(table.rows(), expected)
    assert np.array_equal(first.reshape(4, 32), expected[[0, 5, 7, 100]])


def test_growth_is_geometric(client: posenc.Client) -> None:
    table = GrowingTable(client, SINUSOIDAL, min_rows=16)
    for position in range(5000):  # a decode loop, one row further each step
        table.get([position])
    assert len(table) >= 5000
    assert table.fetches <= 10  # 16, 32, ..., 8192
    assert np.array_equal(table.rows(5000), client.get_range(0, 5000, SINUSOIDAL))


def test_far_negative_and_sparse_positions_are_fetched_not_grown(client: posenc.Client) -> None:
    table = GrowingTable(client, SINUSOIDAL, min_rows=64)
    positions = np.array([[2**30, 3, -7], [5, 2**30 + 1, 63]])
    rows = table.get(positions)
    assert len(table) == 64  # the first fetch only: 2^30 is not grown into
    expected = client.get_positions(positions.reshape(-1), SINUSOIDAL)
    assert np.array_equal(rows.reshape(6, 24), expected)
    dense = table.get(np.arange(0, 1000))  # dense past the end: grown into
    assert len(table) >= 1000
    assert np.array_equal(dense, client.get_range(0, 1000, SINUSOIDAL))


def test_memory_cap(client: posenc.Client) -> None:
    row_bytes = 24 * 4
    table = GrowingTable(client, SINUSOIDAL, min_rows=10, max_bytes=100 * row_bytes)
    rows = table.get(np.arange(150))
    assert len(table) <= 100
    assert np.array_equal(rows, client.get_range(0, 150, SINUSOIDAL))
    with pytest.raises(posenc.ResourceExhaustedError):
        table.reserve(101)


def test_rows_view_is_read_only(client: posenc.Client) -> None:
    table = GrowingTable(client, SINUSOIDAL, min_rows=8)
    view = table.rows(8)
    with pytest.raises(ValueError):
        view[0, 0] = 1.0


def test_growing_table_tensors_out_and_cos_sin(client: posenc.Client) -> None:
    table = GrowingTable(client, ROTARY, dtype=torch.bfloat16, min_rows=128)
    positions = torch.tensor([[0, 1, 2], [3, 90, 2**20]])
    cos, sin = table.get(positions, cos_sin=True)
    assert isinstance(cos, torch.Tensor)
    assert cos.shape == sin.shape == (2, 3, 16) and cos.dtype == torch.bfloat16
    expected = client.get_positions(positions.reshape(-1).numpy(), ROTARY, dtype="bfloat16")
    ours = torch.cat([cos, sin], -1).reshape(6, 32)
    assert np.array_equal(bits(ours), bits(expected))
    out = torch.empty(2, 2, 32, dtype=torch.bfloat16)
    assert table.get(positions[:, :2], out=out) is out
    assert np.array_equal(bits(out).reshape(4, 32), bits(expected[[0, 1, 3, 4]]))
    assert table.get(np.array([5]), device="cpu").shape == (1, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "table",
    [ROTARY, posenc.Spec("rotary", head_dim=16, layout="vllm"), SINUSOIDAL],
    ids=["transformers", "vllm", "sinusoidal"],
)
def test_held_rows_read_by_torch_tensors_are_the_servers(
    client: posenc.Client, table: posenc.Spec, dtype: Any
) -> None:
    # Small CPU tensors of held positions (a decode step) are read by torch's indexing;
    # the rows are the server's whatever the path: positions past the table, a numpy
    # list, or a direct call.
    growing = GrowingTable(client, table, dtype=dtype, min_rows=128)
    growing.reserve(128)
    rotary = table.kind == "rotary"
    for positions in (
        torch.tensor([[5, 0, 127], [64, 64, 3]]),
        torch.tensor([9], dtype=torch.int32),
    ):
        flat = positions.reshape(-1).numpy()
        expected = client.get_positions(flat, table, dtype=dtype).reshape(*positions.shape, -1)
        rows = growing.get(positions)
        assert rows.dtype == dtype and rows.shape == expected.shape
        assert np.array_equal(bits(rows), bits(expected))
        if rotary:
            cos, sin = growing.get(positions, cos_sin=True)
            assert np.array_equal(bits(torch.cat([cos, sin], -1)), bits(expected))
        else:
            with pytest.raises(posenc.InvalidArgumentError, match="cos_sin"):
                growing.get(positions, cos_sin=True)
    past = torch.tensor([[3, 200]])  # 200 is past the held rows: the table grows
    expected = client.get_positions([3, 200], table, dtype=dtype)
    assert np.array_equal(bits(growing.get(past)[0]), bits(expected))
    assert len(growing) > 200


def test_a_transformers_rotary_table_travels_and_is_held_as_halves(server: Any) -> None:
    """transformers' rotary rows repeat each half ([c, c | s, s]): the table asks for vLLM's
    rows ([c | s], half the bytes) and holds those, and every read repeats the halves, bit
    for bit the server's transformers rows; max_bytes counts what is held."""
    recorder = Recorder()
    with (
        posenc.Client(server.target, interceptors=[recorder]) as client,
        posenc.Client(server.target) as direct,
    ):
        # 16 held float32 columns a row (the table's rows are 32 wide): 64 bytes a row.
        table = GrowingTable(client, ROTARY, min_rows=100, max_bytes=200 * 64)
        positions = np.array([[3, 99], [150, 2**20]])
        rows = table.get(positions)  # 100 rows held; 150 and 2**20 fetched for the call
        assert rows.shape == (2, 2, 32) and table.width == 32 and len(table) == 100
        table.get(np.arange(100, 160))  # grown into: 200 rows, all that max_bytes holds
        assert len(table) == 200
        out = np.empty((2, 32), dtype=np.float32)
        assert table.get([7, 8], out=out) is out
        whole = table.rows()
        with pytest.raises(ValueError):
            whole[0, 0] = 1.0
        expected = direct.get_positions(positions.reshape(-1), ROTARY)
        assert np.array_equal(rows.reshape(4, 32), expected)
        assert np.array_equal(out, direct.get_range(7, 9, ROTARY))
        assert np.array_equal(whole, direct.get_range(0, 200, ROTARY))
        with pytest.raises(posenc.ResourceExhaustedError):
            table.reserve(201)
    layouts = {pb.RopeLayout.Name(request.spec.rotary.layout) for _, _, request in recorder.calls}
    assert recorder.calls and layouts == {"ROPE_LAYOUT_VLLM"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_table_with_views_reads_a_held_run_without_a_copy(
    client: posenc.Client, dtype: str
) -> None:
    """``views=True``: a prefill's positions (one run of held positions) come back as a view
    of the held rows, numpy read-only or a CPU tensor of the same memory, in the layout asked
    for (transformers' rotary rows held whole); anything else is a copy as before."""
    table = GrowingTable(client, ROTARY, dtype=dtype, min_rows=512, views=True)
    table.reserve(512)
    held = table.rows()
    assert held.shape == (512, 32)  # transformers' layout, held as read
    expected = client.get_range(0, 512, ROTARY, dtype=dtype)
    assert np.array_equal(bits(held), bits(expected))

    prefill = table.get(np.arange(100, 300)[None, :])  # [batch 1, seq]
    assert prefill.shape == (1, 200, 32) and np.shares_memory(prefill, held)
    assert not prefill.flags.writeable
    assert np.array_equal(bits(prefill[0]), bits(expected[100:300]))
    cos, sin = table.get(np.arange(10, 20), cos_sin=True)
    assert np.shares_memory(cos, held) and np.shares_memory(sin, held)
    assert np.array_equal(bits(sin), bits(expected[10:20, 16:]))

    ids = torch.arange(100, 300).unsqueeze(0)
    tensor = table.get(ids)
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (1, 200, 32)
    assert tensor.data_ptr() == table.get(torch.arange(100, 101)).data_ptr()  # the held rows
    assert np.array_equal(bits(tensor[0]), bits(expected[100:300]))

    # Not a run, a buffer, rows not held: copies, as without views.
    scattered = table.get([5, 7, 6])
    assert not np.shares_memory(scattered, held)
    assert np.array_equal(bits(scattered), bits(expected[[5, 7, 6]]))
    out = np.empty((3, 32), dtype=expected.dtype)
    assert table.get([1, 2, 3], out=out) is out
    assert np.array_equal(bits(out), bits(expected[1:4]))
    beyond = table.get(np.arange(500, 600))
    assert not np.shares_memory(beyond, held)
    assert np.array_equal(bits(beyond), bits(client.get_range(500, 600, ROTARY, dtype=dtype)))


def test_concurrent_readers_see_consistent_rows(client: posenc.Client) -> None:
    table = GrowingTable(client, SINUSOIDAL, min_rows=16)
    expected = client.get_range(0, 3000, SINUSOIDAL)
    failures: list[str] = []

    def read(offset: int) -> None:
        for stop in range(offset, 3000, 97):
            if not np.array_equal(table.get(np.arange(stop)), expected[:stop]):
                failures.append(f"stop {stop}")

    threads = [threading.Thread(target=read, args=(i * 13,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_the_async_table_grows_and_reads_as_the_blocking_one(server: Any) -> None:
    async def main() -> tuple[Any, ...]:
        async with posenc.AsyncClient(server.target) as client:
            table = AsyncGrowingTable(client, SINUSOIDAL, min_rows=16)
            first = await table.get([[0, 5], [7, 10]])
            after_first = (len(table), table.fetches)
            # Tasks reading past the end at once: growth is serialised, every read exact.
            reads = await asyncio.gather(
                *(table.get(np.arange(stop)) for stop in range(1, 3000, 97))
            )
            grown = (len(table), table.fetches)
            sparse = await table.get([2**30, -7, 3])  # fetched for the call, not grown into
            cos, sin = await AsyncGrowingTable(client, ROTARY, dtype=torch.bfloat16).get(
                torch.tensor([[0, 1], [2, 3]]), cos_sin=True
            )
            small = AsyncGrowingTable(client, SINUSOIDAL, min_rows=4, max_bytes=10 * 24 * 4)
            assert (await small.rows(10)).shape == (10, 24)
            with pytest.raises(posenc.ResourceExhaustedError):
                await small.reserve(11)
            return first, after_first, reads, grown, sparse, (len(table), table.fetches), cos, sin

    first, after_first, reads, grown, sparse, final, cos, sin = asyncio.run(main())
    with posenc.Client(server.target) as client:
        expected = client.get_range(0, 3000, SINUSOIDAL)
        assert np.array_equal(first, expected[[[0, 5], [7, 10]]])
        assert after_first == (16, 1)
        for stop, rows in zip(range(1, 3000, 97), reads, strict=True):
            assert np.array_equal(rows, expected[:stop])
        assert grown[0] >= 2910 and grown[1] <= 10  # 16, 32, ..., 4096: geometric
        assert np.array_equal(sparse, client.get_positions([2**30, -7, 3], SINUSOIDAL))
        assert final == (grown[0], grown[1] + 1)
        rotary = client.get_range(0, 4, ROTARY, dtype="bfloat16")
    assert isinstance(cos, torch.Tensor) and cos.shape == (2, 2, 16)
    assert np.array_equal(bits(torch.cat([cos, sin], -1)).reshape(4, 32), bits(rotary))
