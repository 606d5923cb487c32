"""The several-axis kinds (mrope, sincos_grid_2d, sincos_grid_3d) through a real server and the
SDK: coordinates, grids streamed row-major, the accuracy contract on every axis against
mpmath, and the INVALID_ARGUMENT answers that name the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mpmath
import numpy as np
import pytest
from conftest import same_bits
from reference import within_contract

import posenc
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_server.app import RunningServer

mpmath.mp.dps = 50
LIMIT = 2**42

QWEN2_VL = posenc.Spec("mrope", head_dim=128, rope_theta=1e6, mrope_section=[16, 24, 24])
QWEN3_VL = posenc.Spec(
    "mrope", head_dim=128, rope_theta=5e5, mrope_section=[24, 20, 20], interleaved=True
)
DIT = posenc.Spec("sincos_grid_2d", embed_dim=64, grid_height=32, grid_width=48, base_size=16)
VIDEO = posenc.Spec(
    "sincos_grid_3d",
    embed_dim=48,
    grid_frames=5,
    grid_height=6,
    grid_width=7,
    spatial_interpolation_scale=1.875,
)


@pytest.fixture
def client(server: RunningServer) -> Iterator[posenc.Client]:
    with posenc.Client(server.target) as c:
        yield c


# -- exact references, from the definitions ---------------------------------------------------


def _mrope_exact(spec: posenc.Spec, coordinates: Any) -> list[list[mpmath.mpf]]:
    """[cos, cos | sin, sin] of each frequency at its axis's coordinate (transformers)."""
    p = spec.parameters
    half = p["head_dim"] // 2
    t, h, w = p["mrope_section"]
    if p.get("interleaved"):
        axes = [
            1 if i % 3 == 1 and i < 3 * h else 2 if i % 3 == 2 and i < 3 * w else 0
            for i in range(half)
        ]
    else:
        axes = [0] * t + [1] * h + [2] * w
    theta = mpmath.mpf(p["rope_theta"])
    rows = []
    for row in coordinates:
        angles = [
            int(row[axes[i]]) * theta ** (-mpmath.mpf(2 * i) / p["head_dim"]) for i in range(half)
        ]
        cos = [mpmath.cos(a) for a in angles]
        sin = [mpmath.sin(a) for a in angles]
        rows.append(cos + cos + sin + sin)
    return rows


def _table_1d(position: mpmath.mpf, columns: int) -> list[mpmath.mpf]:
    """[sin | cos] over 10000 ** (-2k / columns)."""
    angles = [
        position * mpmath.mpf(10000) ** (-mpmath.mpf(2 * k) / columns) for k in range(columns // 2)
    ]
    return [mpmath.sin(a) for a in angles] + [mpmath.cos(a) for a in angles]


def _grid_2d_exact(spec: posenc.Spec, coordinates: Any) -> list[list[mpmath.mpf]]:
    p = spec.parameters
    half = p["embed_dim"] // 2
    rows = []
    for h, w in coordinates:
        ph = mpmath.mpf(int(h)) * p["base_size"] / p["grid_height"]
        pw = mpmath.mpf(int(w)) * p["base_size"] / p["grid_width"]
        rows.append(_table_1d(pw, half) + _table_1d(ph, half))
    return rows


def _grid_3d_exact(spec: posenc.Spec, coordinates: Any) -> list[list[mpmath.mpf]]:
    p = spec.parameters
    temporal = p["embed_dim"] // 4
    spatial = (p["embed_dim"] - temporal) // 2
    scale = mpmath.mpf(p["spatial_interpolation_scale"])
    return [
        _table_1d(mpmath.mpf(int(t)), temporal)
        + _table_1d(int(w) / scale, spatial)
        + _table_1d(int(h) / scale, spatial)
        for t, h, w in coordinates
    ]


_CASES = {
    "qwen2_vl": (QWEN2_VL, _mrope_exact),
    "qwen3_vl": (QWEN3_VL, _mrope_exact),
    "dit": (DIT, _grid_2d_exact),
    "video": (VIDEO, _grid_3d_exact),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_every_axis_within_the_contract_up_to_the_position_limit(
    client: posenc.Client, case: str, dtype: str
) -> None:
    spec, exact = _CASES[case]
    rng = np.random.default_rng(7)
    axes = spec.axes
    coordinates = rng.integers(-LIMIT, LIMIT + 1, size=(6, axes))
    coordinates[0] = LIMIT  # every axis at the limit
    coordinates[1] = -LIMIT
    coordinates[2] = [LIMIT if a == 1 else 3 for a in range(axes)]  # one axis large
    rows = client.get_positions(coordinates, spec, dtype=dtype)
    for row, exact_row in zip(rows, exact(spec, coordinates), strict=True):
        for column, (value, exact_value) in enumerate(zip(row, exact_row, strict=True)):
            assert within_contract(value, exact_value), (case, dtype, column, value)


# -- selections -----------------------------------------------------------------------------------


def test_mrope_text_positions_are_the_rotary_table(client: posenc.Client) -> None:
    rotary = posenc.Spec("rotary", head_dim=128, rope_theta=1e6)
    positions = np.array([0, 5, 4096, 2**40])
    diagonal = np.repeat(positions[:, None], 3, axis=1)
    expected = client.get_positions(positions, rotary)
    assert same_bits(client.get_positions(diagonal, QWEN2_VL), expected)
    # A 1-D selection of a several-axis kind is refused by the SDK (ambiguous shapes); the
    # wire's range and position list are the text positions (p, p, p).
    assert "coordinates.axes" in _violations(lambda: client.get_positions(positions, QWEN2_VL))
    qwen3_rotary = posenc.Spec("rotary", head_dim=128, rope_theta=5e5)
    assert same_bits(client.get_range(0, 100, QWEN3_VL), client.get_range(0, 100, qwen3_rotary))


def test_coordinates_keep_their_shape_and_the_cos_sin_split(client: posenc.Client) -> None:
    position_ids = np.random.default_rng(1).integers(0, 500, size=(3, 2, 7))  # transformers'
    coordinates = np.moveaxis(position_ids, 0, -1)
    rows = client.get_positions(coordinates, QWEN2_VL)
    assert rows.shape == (2, 7, 256)
    cos, sin = client.get_positions(coordinates, QWEN2_VL, cos_sin=True)
    assert same_bits(np.concatenate([cos, sin], axis=-1), rows)
    # transformers' own layout, by naming the coordinates' axis.
    assert same_bits(client.get_positions(position_ids, QWEN2_VL, coordinate_axis=0), rows)
    assert "coordinate_axis" in _violations(
        lambda: client.get_positions(position_ids, QWEN2_VL, coordinate_axis=5)
    )
    assert "coordinate_axis" in _violations(
        lambda: client.get_positions([1, 2], posenc.Spec("rotary", head_dim=8), coordinate_axis=0)
    )
    # Each row depends on its coordinates alone.
    assert same_bits(client.get_positions(coordinates[1, 3], QWEN2_VL), rows[1, 3])


def test_a_grid_is_the_same_rows_by_range_grid_stream_and_coordinates(
    client: posenc.Client,
) -> None:
    grid = client.get_grid(DIT)
    assert grid.shape == (32, 48, 64)
    assert same_bits(grid.reshape(-1, 64), client.get_range(0, 32 * 48, DIT))
    streamed = list(client.iter_grid(DIT, chunk_bytes=64 * 4 * 100))
    assert len(streamed) > 1 and all(len(rows) <= 100 for _, rows in streamed)
    assert same_bits(np.concatenate([rows for _, rows in streamed]), grid.reshape(-1, 64))
    cells = np.array([[0, 0], [31, 47], [7, 3], [7, 3]])
    assert same_bits(client.get_positions(cells, DIT), grid[cells[:, 0], cells[:, 1]])
    video = client.get_grid(VIDEO, dtype="float64")
    assert video.shape == (5, 6, 7, 48)
    assert same_bits(
        client.get_positions([[4, 5, 6], [1, 2, 3]], VIDEO, dtype="float64"),
        video[[4, 1], [5, 2], [6, 3]],
    )


def test_rows_past_the_grid_continue_it(client: posenc.Client) -> None:
    small = posenc.Spec("sincos_grid_2d", embed_dim=16, grid_height=2, grid_width=5)
    rows = client.get_range(0, 30, small)
    assert same_bits(rows, client.get_positions(np.indices((6, 5)).reshape(2, -1).T, small))


@pytest.mark.slow
def test_a_grid_larger_than_the_stream_limit_streams_in_chunks(
    server_factory: Any,
) -> None:
    server = server_factory(max_stream_bytes=1 << 20)
    big = posenc.Spec(
        "sincos_grid_3d", embed_dim=64, grid_frames=16, grid_height=64, grid_width=64
    )  # 16 MiB of float32
    with posenc.Client(server.target) as c:
        total = 0
        for first, rows in c.iter_grid(big, timeout=None, chunk_bytes=1 << 16):
            assert first == total and rows.nbytes <= 1 << 20
            total += len(rows)
        assert total == 16 * 64 * 64
        assert same_bits(c.get_positions([[15, 63, 63]], big), rows[-1:])


# -- bad input ------------------------------------------------------------------------------------


def _violations(call: Any) -> dict[str, str]:
    with pytest.raises(posenc.InvalidArgumentError) as raised:
        call()
    return dict(raised.value.field_violations)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            posenc.Spec("mrope", head_dim=128, mrope_section=[16, 24, 16]),
            "spec.mrope.mrope_section",
        ),
        (posenc.Spec("mrope", head_dim=128, mrope_section=[32, 32]), "spec.mrope.mrope_section"),
        (posenc.Spec("mrope", head_dim=127, mrope_section=[16, 24, 24]), "spec.mrope.head_dim"),
        (
            posenc.Spec("sincos_grid_2d", embed_dim=66, grid_height=2, grid_width=2),
            "spec.sincos_grid_2d.embed_dim",
        ),
        (
            posenc.Spec("sincos_grid_2d", embed_dim=64, grid_height=2**22, grid_width=2**21),
            "spec.sincos_grid_2d.grid_height",
        ),
        (
            posenc.Spec("sincos_grid_2d", embed_dim=64, grid_height=0, grid_width=2),
            "spec.sincos_grid_2d.grid_height",
        ),
        (
            posenc.Spec(
                "sincos_grid_2d",
                embed_dim=64,
                grid_height=2,
                grid_width=2,
                interpolation_scale=2**-11,
            ),
            "spec.sincos_grid_2d.interpolation_scale",
        ),
        (
            posenc.Spec(
                "sincos_grid_2d", embed_dim=64, grid_height=2, grid_width=2, base_size=-1.0
            ),
            "spec.sincos_grid_2d.base_size",
        ),
        (
            posenc.Spec(
                "sincos_grid_3d",
                embed_dim=64,
                grid_frames=1,
                grid_height=1,
                grid_width=1,
                temporal_dim=3,
            ),
            "spec.sincos_grid_3d.temporal_dim",
        ),
        (
            posenc.Spec(
                "sincos_grid_3d",
                embed_dim=64,
                grid_frames=2**15,
                grid_height=2**14,
                grid_width=2**14,
            ),
            "spec.sincos_grid_3d.grid_frames",
        ),
    ],
)
def test_bad_specs_name_their_field(client: posenc.Client, spec: posenc.Spec, field: str) -> None:
    assert field in _violations(
        lambda: (
            client.get_positions([[0, 0, 0]][:1], spec)
            if spec.axes == 3
            else client.get_range(0, 1, spec)
        )
    )


def test_bad_coordinates_name_their_field(client: posenc.Client, stub: Any) -> None:
    assert "coordinates.axes" in _violations(lambda: client.get_positions([[1, 2]], QWEN2_VL))
    assert "coordinates.axes" in _violations(lambda: client.get_positions([5], DIT))
    spec = QWEN2_VL.to_proto()

    def raw(**selection: Any) -> dict[str, str]:
        import grpc
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status

        with pytest.raises(grpc.RpcError) as raised:
            stub.GetEncoding(pb.GetEncodingRequest(spec=spec, **selection))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        status = rpc_status.from_call(raised.value)
        assert status is not None
        details = error_details_pb2.BadRequest()
        status.details[0].Unpack(details)
        return {v.field: v.description for v in details.field_violations}

    assert "coordinates.axes" in raw(coordinates=pb.CoordinateList(axes=2, coordinates=[1, 2]))
    assert "coordinates.coordinates" in raw(
        coordinates=pb.CoordinateList(axes=3, coordinates=[1, 2])
    )
    assert "coordinates.coordinates[4]" in raw(
        coordinates=pb.CoordinateList(axes=3, coordinates=[1, 2, 3, 4, LIMIT + 1, 6])
    )
    rotary = posenc.Spec("rotary", head_dim=64).to_proto()
    with pytest.raises(Exception, match="one position axis"):
        stub.GetEncoding(
            pb.GetEncodingRequest(
                spec=rotary, coordinates=pb.CoordinateList(axes=3, coordinates=[1, 2, 3])
            )
        )
    # Not a grid: the SDK says so before any call.
    assert "spec.table" in _violations(lambda: client.get_grid(QWEN2_VL))


def test_server_info_lists_the_kinds(client: posenc.Client) -> None:
    names = {kind.name for kind in client.server_info().table_kinds}
    assert {"mrope", "sincos_grid_2d", "sincos_grid_3d"} <= names


def test_the_axis_counts_agree_with_the_proto() -> None:
    from posenc_server.tables import KINDS

    for name, kind in KINDS.items():
        assert posenc.Spec(name).axes == kind.AXES, name


def test_fetch_writes_a_grid_with_its_shape(server: RunningServer, tmp_path: Any) -> None:
    from posenc.cli import main

    params = ["--param", "embed_dim=16", "--param", "grid_height=3", "--param", "grid_width=5"]
    out = tmp_path / "grid.npy"
    argv = ["fetch", "--table", "sincos_grid_2d", *params, "-o", str(out)]
    assert main([*argv, "--target", server.target, "--no-progress"]) == 0
    written = np.load(out)
    assert written.shape == (3, 5, 16)
    with posenc.Client(server.target) as c:
        spec = posenc.Spec("sincos_grid_2d", embed_dim=16, grid_height=3, grid_width=5)
        assert same_bits(written, c.get_grid(spec))
