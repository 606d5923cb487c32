"""posenc's specs for the grids diffusers' sin-cos functions build, from those functions' own
arguments: one mapping, shared by the suites that compare the two."""

from __future__ import annotations

from typing import Any

import posenc


def sincos_grid_2d(
    embed_dim: int, grid_size: tuple[int, int], base_size: int, interpolation_scale: float
) -> posenc.Spec:
    """The spec of ``get_2d_sincos_pos_embed(embed_dim, grid_size, base_size=...,
    interpolation_scale=...)``; ``grid_size`` is (height, width)."""
    height, width = grid_size
    return posenc.Spec(
        "sincos_grid_2d",
        embed_dim=embed_dim,
        grid_height=height,
        grid_width=width,
        base_size=base_size,
        interpolation_scale=interpolation_scale,
    )


def sincos_grid_3d(
    embed_dim: int,
    spatial_size: tuple[int, int],
    temporal_size: int,
    spatial_interpolation_scale: float,
    temporal_interpolation_scale: float | None = None,
) -> posenc.Spec:
    """The spec of ``get_3d_sincos_pos_embed(embed_dim, spatial_size, temporal_size, ...)``;
    ``spatial_size`` is (width, height), as diffusers takes it. A temporal scale left out is
    left to the spec's default."""
    width, height = spatial_size
    temporal: dict[str, Any] = (
        {}
        if temporal_interpolation_scale is None
        else {"temporal_interpolation_scale": temporal_interpolation_scale}
    )
    return posenc.Spec(
        "sincos_grid_3d",
        embed_dim=embed_dim,
        grid_frames=temporal_size,
        grid_height=height,
        grid_width=width,
        spatial_interpolation_scale=spatial_interpolation_scale,
        **temporal,
    )
