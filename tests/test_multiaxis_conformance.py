"""Conformance of the several-axis kinds against the models' own code.

M-RoPE: transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL (interleaved) rotary modules, at the
position ids their own ``get_rope_index`` builds for text-only, image and video sequences
(tiny random configs: nothing is downloaded). The 2D grid: transformers'
``build_2d_sinusoidal_position_embedding`` and ViT-MAE's initial position embeddings, and
diffusers' ``get_2d_sincos_pos_embed`` (DiT at its training size and at twice it, SD3's
``base_size``, PixArt's ``interpolation_scale``); the 3D grid: diffusers'
``get_3d_sincos_pos_embed`` (CogVideoX's spatial scale).

The references round positions (and M-RoPE's angles) to float32, so the tolerance grows with
the position as in tests/test_conformance.py; each test reports nothing but fails with the
worst element.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import grid_specs
import model_configs
import numpy as np
import pytest

import posenc
from posenc_server.app import RunningServer

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

EPS32 = 2.0**-24


def assert_close(ours: Any, theirs: Any, positions: Any) -> float:
    """Within float32's budget at ``positions`` (per row): 8 ulps plus 4 units of |p| 2^-24."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    error = np.abs(ours - theirs)
    scale = np.abs(np.asarray(positions, np.float64)).reshape((*error.shape[:-1], 1))
    allowed = 8 * EPS32 + 4 * EPS32 * scale
    worst = np.unravel_index(np.argmax(error - allowed), error.shape)
    assert (error <= allowed).all(), f"element {worst}: error {error[worst]:.3g}"
    return float(error.max())


@pytest.fixture
def client(server: RunningServer) -> Iterator[Any]:
    with posenc.Client(server.target) as c:
        yield c


# -- M-RoPE --------------------------------------------------------------------------------------

_TEXT = {
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "vocab_size": 64,
}


def _vl_model(name: str, vision: dict[str, Any], **text: Any) -> Any:
    """transformers' ``{name}Model`` with the tiny text model and the vision tower given."""
    import transformers

    # Copies: a config may rewrite the dicts it is given, and the settings are shared.
    config = getattr(transformers, f"{name}Config")(
        text_config=copy.deepcopy({**_TEXT, **text}), vision_config=copy.deepcopy(vision)
    )
    return getattr(transformers, f"{name}Model")(config)


def _qwen2_vl() -> Any:
    return _vl_model(
        "Qwen2VL", model_configs.QWEN2_VL_VISION, rope_parameters=model_configs.QWEN2_VL_MROPE
    )


def _qwen2_5_vl() -> Any:
    return _vl_model(
        "Qwen2_5_VL", model_configs.QWEN2_5_VL_VISION, rope_parameters=model_configs.QWEN2_VL_MROPE
    )


def _qwen3_vl() -> Any:
    # Qwen3-VL's sections at a tenth of its theta.
    return _vl_model(
        "Qwen3VL",
        model_configs.QWEN3_VL_VISION,
        head_dim=128,
        rope_parameters={**model_configs.QWEN3_VL_MROPE, "rope_theta": 5e5},
    )


# Token types: text 0, image 1, video 2; grids (t, h, w) before the 2x2 spatial merge.
_LAYOUTS = {
    "text": ([0] * 40, None, None),
    "image": ([0] * 5 + [1] * 6 + [0] * 4, [[1, 4, 6]], None),
    "video": ([0] * 3 + [2] * 12 + [0] * 2 + [1] * 4 + [0] * 3, [[1, 4, 4]], [[3, 4, 4]]),
}


def _position_ids(model: Any, layout: str) -> Any:
    types, images, videos = _LAYOUTS[layout]
    if layout == "video" and model.config.model_type == "qwen3_vl":
        # Qwen3-VL separates a video's frames by timestamp tokens: a vision group per frame.
        types = [0] * 3 + ([2] * 4 + [0] * 2) * 3 + [1] * 4 + [0] * 3
    if layout == "text":  # a text-only sequence: the model's own (p, p, p)
        return torch.arange(len(types))[None, None, :].expand(3, 1, -1)
    kwargs: dict[str, Any] = {}
    if images is not None:
        kwargs["image_grid_thw"] = torch.tensor(images)
    if videos is not None:
        kwargs["video_grid_thw"] = torch.tensor(videos)
        if "second_per_grid_ts" in model.get_rope_index.__code__.co_varnames:
            kwargs["second_per_grid_ts"] = torch.tensor([1.0])
    ids = torch.zeros(1, len(types), dtype=torch.long)
    mm = torch.tensor([types], dtype=torch.int32)
    position_ids, _ = model.get_rope_index(ids, mm, **kwargs)
    return position_ids


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("layout", ["text", "image", "video"])
def test_mrope_matches_the_models_rotary_module(client: Any, family: str, layout: str) -> None:
    with torch.device("cpu"):
        model = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl}[family]()
    spec = posenc.Spec.from_config(model.config)
    assert spec.kind == "mrope" and spec.parameters["interleaved"] == (family == "qwen3_vl")
    position_ids = _position_ids(model, layout)
    if layout != "text":  # the layout really has several axes
        assert not torch.equal(position_ids[0], position_ids[1])
    rotary = model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), position_ids)
    theirs = np.concatenate([cos.numpy(), sin.numpy()], axis=-1)  # [batch, seq, 2 * head_dim]
    coordinates = np.moveaxis(position_ids.numpy(), 0, -1)  # [batch, seq, 3]
    rows = client.get_positions(coordinates, spec, dtype="float64")
    assert_close(rows, theirs, coordinates.max(axis=-1))
    # float32 rows: transformers' dtype, within the same budget.
    assert_close(client.get_positions(coordinates, spec), theirs, coordinates.max(axis=-1))


# -- 2D and 3D sin-cos grids ----------------------------------------------------------------------


def test_grid_2d_matches_transformers_builder_and_vit_mae(client: Any) -> None:
    from transformers.models.vit_mae.modeling_vit_mae import (
        build_2d_sinusoidal_position_embedding,
    )

    theirs = build_2d_sinusoidal_position_embedding(6, 9, embed_dim=64, dtype=torch.float64)
    spec = posenc.Spec(
        "sincos_grid_2d", embed_dim=64, grid_height=6, grid_width=9, height_first=True
    )
    grid = client.get_grid(spec, dtype="float64")
    assert grid.shape == (6, 9, 64)
    cells = np.indices((6, 9)).reshape(2, -1).T
    assert_close(grid.reshape(-1, 64), theirs.numpy(), cells.max(axis=1))

    # ViTMAEEmbeddings.initialize_weights: the builder's table with its halves swapped
    # (width first), the layout of the pretrained weights.
    half = theirs.shape[-1] // 2
    weights = torch.cat([theirs[..., half:], theirs[..., :half]], dim=-1).numpy()
    mae = posenc.Spec("sincos_grid_2d", embed_dim=64, grid_height=6, grid_width=9)
    assert_close(client.get_range(0, 54, mae), weights, cells.max(axis=1))


_DIFFUSERS_2D = {
    # name: (embed_dim, (height, width), base_size, interpolation_scale)
    "dit-training": (64, (16, 16), 16, 1.0),
    "dit-twice-resolution": (64, (32, 32), 16, 1.0),
    "sd3-max-size": (64, (24, 24), 8, 1.0),
    "pixart-scale-2": (32, (8, 12), 8, 2.0),
}


@pytest.mark.parametrize("case", list(_DIFFUSERS_2D))
def test_grid_2d_matches_diffusers(client: Any, case: str) -> None:
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    embed_dim, (height, width), base_size, scale = _DIFFUSERS_2D[case]
    theirs = embeddings.get_2d_sincos_pos_embed(
        embed_dim, (height, width), base_size=base_size, interpolation_scale=scale
    ).numpy()
    spec = grid_specs.sincos_grid_2d(embed_dim, (height, width), base_size, scale)
    grid = client.get_grid(spec, dtype="float64").reshape(-1, embed_dim)
    cells = np.indices((height, width)).reshape(2, -1).T
    assert_close(grid, theirs, cells.max(axis=1) * base_size / min(height, width) / scale)


@pytest.mark.parametrize(
    ("frames", "height", "width", "spatial_scale", "temporal_scale"),
    [(3, 4, 6, 1.0, 1.0), (5, 6, 4, 1.875, 1.0), (4, 3, 3, 1.0, 2.0)],
)
def test_grid_3d_matches_diffusers(
    client: Any, frames: int, height: int, width: int, spatial_scale: float, temporal_scale: float
) -> None:
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    # diffusers' spatial_size is (width, height).
    theirs = embeddings.get_3d_sincos_pos_embed(
        64, (width, height), frames, spatial_scale, temporal_scale
    ).numpy()
    spec = grid_specs.sincos_grid_3d(64, (width, height), frames, spatial_scale, temporal_scale)
    grid = client.get_grid(spec, dtype="float64")
    assert grid.shape == (frames, height, width, 64)
    cells = np.indices((frames, height, width)).reshape(3, frames, -1)
    assert_close(grid.reshape(frames, -1, 64), theirs, cells.max(axis=0) + 1)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_transformers_drop_in_serves_mrope(server: RunningServer, family: str) -> None:
    from posenc.integrations.transformers import patch

    torch.manual_seed(0)
    model = {"qwen2_vl": _qwen2_vl, "qwen3_vl": _qwen3_vl}[family]()
    language = model.language_model.eval()
    for layout in ("video", "text"):
        position_ids = _position_ids(model, layout)
        embeds = torch.randn(1, position_ids.shape[-1], 256)
        with torch.no_grad():
            native = language(inputs_embeds=embeds, position_ids=position_ids)
            # The whole model, as users patch it (its vision tower is left alone).
            with posenc.Client(server.target) as client, patch(model, client) as patched:
                assert next(iter(patched.specs.values())).kind == "mrope"
                ours = language(inputs_embeds=embeds, position_ids=position_ids)
        difference = (ours.last_hidden_state - native.last_hidden_state).abs().max()
        assert float(difference) < 1e-4, (layout, float(difference))
