"""The N-axis rotary kind (``rotary_axes``) through a real server and the SDK: every axis within
the accuracy contract up to the position limit (mpmath), equal to diffusers' own per-axis
builder (``get_1d_rotary_pos_embed``, concatenated) as Flux, HunyuanVideo, Wan and Lumina
configure it, and bad specs refused naming their field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mpmath
import numpy as np
import pytest
from reference import within_contract

import posenc
from posenc_server.app import RunningServer

LIMIT = 2**42
FLUX = posenc.Spec("rotary_axes", axes_dim=[16, 56, 56])  # theta 10000
HUNYUAN = posenc.Spec("rotary_axes", axes_dim=[16, 56, 56], rope_theta=256.0)
WAN = posenc.Spec("rotary_axes", axes_dim=[44, 42, 42])  # head 128: h = w = 2 * (128 // 6)


@pytest.fixture
def client(server: RunningServer) -> Iterator[posenc.Client]:
    with posenc.Client(server.target) as c:
        yield c


def _exact(spec: posenc.Spec, coordinates: Any) -> list[list[mpmath.mpf]]:
    """Rows of the gptj layout: cos then sin, each frequency twice, axes in order."""
    mpmath.mp.dps = 50
    p = spec.parameters
    theta = mpmath.mpf(p.get("rope_theta", 10000.0))
    rows = []
    for coordinate in coordinates:
        angles = []
        for axis, dim in enumerate(p["axes_dim"]):
            for k in range(dim // 2):
                angles.append(
                    mpmath.mpf(int(coordinate[axis])) / theta ** (mpmath.mpf(2 * k) / dim)
                )
        cos = [mpmath.cos(a) for a in angles for _ in range(2)]
        sin = [mpmath.sin(a) for a in angles for _ in range(2)]
        rows.append(cos + sin)
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("spec", [FLUX, HUNYUAN], ids=["flux", "hunyuan"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_every_axis_within_the_contract_up_to_the_position_limit(
    client: posenc.Client, spec: posenc.Spec, dtype: str
) -> None:
    rng = np.random.default_rng(11)
    coordinates = rng.integers(-LIMIT, LIMIT + 1, size=(5, 3))
    coordinates[0] = LIMIT
    coordinates[1] = -LIMIT
    coordinates[2] = [0, LIMIT, 3]  # one axis large, a text token's 0 beside it
    rows = client.get_positions(coordinates, spec, dtype=dtype)
    for row, exact_row in zip(rows, _exact(spec, coordinates), strict=True):
        for column, (value, exact_value) in enumerate(zip(row, exact_row, strict=True)):
            assert within_contract(value, exact_value), (dtype, column, value)


def _diffusers(axes_dim: list[int], theta: float, coordinates: Any, **options: Any) -> Any:
    """diffusers' per-axis tables, concatenated as its models do (float64 frequencies)."""
    torch = pytest.importorskip("torch")
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    parts = [
        embeddings.get_1d_rotary_pos_embed(
            dim,
            torch.from_numpy(coordinates[:, axis].astype(np.float64)),
            theta=theta,
            freqs_dtype=torch.float64,
            **options,
        )
        for axis, dim in enumerate(axes_dim)
        if dim
    ]
    return parts


@pytest.mark.parametrize(
    ("axes_dim", "theta"),
    [([16, 56, 56], 10000.0), ([16, 56, 56], 256.0), ([44, 42, 42], 10000.0), ([0, 32, 32], 1e4)],
    ids=["flux", "hunyuan-video", "wan", "two-axes"],
)
def test_equal_to_diffusers_where_its_positions_are_exact(
    client: posenc.Client, axes_dim: list[int], theta: float
) -> None:
    torch = pytest.importorskip("torch")
    # Flux's image ids (0, h, w) and text ids (0, 0, 0); video grids (t, h, w).
    cells = np.indices((3, 24, 40)).reshape(3, -1).T
    spec = posenc.Spec("rotary_axes", axes_dim=axes_dim, rope_theta=theta)
    width = sum(axes_dim)
    # gptj: diffusers' repeat_interleave_real (Flux, HunyuanVideo, Wan, CogVideoX).
    parts = _diffusers(axes_dim, theta, cells, use_real=True, repeat_interleave_real=True)
    cos = torch.cat([c for c, _ in parts], dim=-1).numpy()
    sin = torch.cat([s for _, s in parts], dim=-1).numpy()
    ours = client.get_positions(cells, spec)
    np.testing.assert_allclose(ours[:, :width], cos, rtol=0, atol=2**-24)
    np.testing.assert_allclose(ours[:, width:], sin, rtol=0, atol=2**-24)
    # vllm: one cos and one sin per frequency, as diffusers' complex table (Lumina) holds.
    complex_parts = _diffusers(axes_dim, theta, cells, use_real=False)
    polar = torch.cat(complex_parts, dim=-1).numpy()
    compact = client.get_positions(
        cells,
        posenc.Spec("rotary_axes", axes_dim=axes_dim, rope_theta=theta, layout="vllm"),
        dtype="float64",
    )
    np.testing.assert_allclose(compact[:, : width // 2], polar.real, rtol=0, atol=2**-23)
    np.testing.assert_allclose(compact[:, width // 2 :], polar.imag, rtol=0, atol=2**-23)


def test_one_axis_positions_are_the_diagonal(client: posenc.Client) -> None:
    positions = np.arange(2**40, 2**40 + 5)
    by_position = client.get_range(2**40, 2**40 + 5, FLUX, dtype="float64")
    diagonal = client.get_positions(np.repeat(positions[:, None], 3, axis=1), FLUX, dtype="float64")
    np.testing.assert_array_equal(by_position, diagonal)


def _violations(call: Any) -> dict[str, str]:
    with pytest.raises(posenc.InvalidArgumentError) as raised:
        call()
    return dict(raised.value.field_violations)


@pytest.mark.parametrize(
    "axes_dim",
    [[16, 56], [16, 56, 56, 8], [15, 56, 56], [0, 0, 0], list(range(0, 2 * 100_000, 2))],
    ids=["two", "four", "odd", "zero", "huge-list"],
)
def test_bad_axes_are_refused_naming_the_field(client: posenc.Client, axes_dim: list[int]) -> None:
    spec = posenc.Spec("rotary_axes", axes_dim=axes_dim)
    violations = _violations(lambda: client.get_positions([[0, 1, 2]], spec))
    assert list(violations) == ["spec.rotary_axes.axes_dim"]
    assert len(violations["spec.rotary_axes.axes_dim"]) < 200  # the list is not echoed


def test_a_row_wider_than_the_limit_is_refused(client: posenc.Client) -> None:
    spec = posenc.Spec("rotary_axes", axes_dim=[20000, 20000, 20000])
    violations = _violations(lambda: client.get_positions([[0, 1, 2]], spec))
    assert "max_d_model" in violations["spec.rotary_axes.axes_dim"]
