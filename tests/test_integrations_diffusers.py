"""``posenc.integrations.diffusers.patch`` on diffusers' own transformers, whole.

Tiny random-initialised models (one layer, two heads) built from configs with the published
models' grid settings (patch size, ``interpolation_scale``, SD3's ``pos_embed_max_size`` at
three times its training grid, CogVideoX's spatial scale 1.875 and temporal compression), at
sample sizes shrunk so that a float64 forward at four times the training resolution runs on
a CPU in seconds. Nothing is downloaded.

Each model runs three ways on the same inputs: native float32 (diffusers' grids, from
float32 positions), patched float32 (posenc's grids), and a float64 reference (the same
weights in float64, diffusers' own grid functions fed float64 positions). At the training
size patched equals native within float32 noise; at every other size the patched output is
at least as close to the reference as the native one. At these sizes a tiny model's own
float32 arithmetic (about 1e-6 of its outputs) hides the grids' drift, so the grids
themselves are compared too, at the published models' full sizes: there diffusers' grids are
off by 9e-7 to 1.8e-6 (their float32 positions are not exact: a third, a fifth of an
integer), posenc's by one float32 rounding (3e-8).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import grid_specs
import numpy as np
import pytest

import posenc

torch = pytest.importorskip("torch", reason="the conformance extra (make test installs it)")
diffusers = pytest.importorskip("diffusers")
embeddings = pytest.importorskip("diffusers.models.embeddings")
from posenc.integrations.diffusers import patch  # noqa: E402  (needs torch)

pytestmark = pytest.mark.slow

# Largest difference between patched and native outputs at the training size: both grids are
# within a few float32 ulps of exact there, and the model's float32 arithmetic adds its own.
SAME_SIZE_TOLERANCE = 2e-5


# -- the float64 reference: diffusers' grid functions with float64 positions -------------------


def _exact_2d(
    embed_dim: int,
    grid_size: Any,
    cls_token: bool = False,
    extra_tokens: int = 0,
    interpolation_scale: float = 1.0,
    base_size: int = 16,
    device: Any = None,
    output_type: str = "pt",
) -> Any:
    """diffusers' get_2d_sincos_pos_embed, positions in float64."""
    if isinstance(grid_size, int):
        grid_size = (grid_size, grid_size)
    f64 = torch.float64
    grid_h = torch.arange(grid_size[0], dtype=f64) * base_size / grid_size[0] / interpolation_scale
    grid_w = torch.arange(grid_size[1], dtype=f64) * base_size / grid_size[1] / interpolation_scale
    grid = torch.stack(torch.meshgrid(grid_w, grid_h, indexing="xy"), dim=0)
    grid = grid.reshape([2, 1, grid_size[1], grid_size[0]])
    return embeddings.get_2d_sincos_pos_embed_from_grid(embed_dim, grid).to(device)


def _exact_3d(
    embed_dim: int,
    spatial_size: Any,
    temporal_size: int,
    spatial_interpolation_scale: float = 1.0,
    temporal_interpolation_scale: float = 1.0,
    device: Any = None,
    output_type: str = "pt",
) -> Any:
    """diffusers' get_3d_sincos_pos_embed, positions in float64."""
    f64 = torch.float64
    grid_h = torch.arange(spatial_size[1], dtype=f64) / spatial_interpolation_scale
    grid_w = torch.arange(spatial_size[0], dtype=f64) / spatial_interpolation_scale
    grid = torch.stack(torch.meshgrid(grid_w, grid_h, indexing="xy"), dim=0)
    grid = grid.reshape([2, 1, spatial_size[1], spatial_size[0]])
    spatial = embeddings.get_2d_sincos_pos_embed_from_grid(3 * embed_dim // 4, grid)
    grid_t = torch.arange(temporal_size, dtype=f64) / temporal_interpolation_scale
    temporal = embeddings.get_1d_sincos_pos_embed_from_grid(embed_dim // 4, grid_t)
    cells = spatial_size[0] * spatial_size[1]
    spatial = spatial[None].repeat_interleave(temporal_size, dim=0)
    temporal = temporal[:, None].repeat_interleave(cells, dim=1)
    return torch.concat([temporal, spatial], dim=-1).to(device)


def _reference(model: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``model`` in float64, building every grid from float64 positions at every forward."""
    exact = copy.deepcopy(model).double()
    monkeypatch.setattr(embeddings, "get_2d_sincos_pos_embed", _exact_2d)
    monkeypatch.setattr(embeddings, "get_3d_sincos_pos_embed", _exact_3d)
    for module in exact.modules():
        if type(module).__name__ == "PatchEmbed":
            if module.pos_embed_max_size:  # SD3 crops its one grid: make that grid exact
                size = module.pos_embed_max_size
                grid = _exact_2d(
                    module.pos_embed.shape[-1],
                    size,
                    base_size=module.base_size,
                    interpolation_scale=module.interpolation_scale,
                )
                module.pos_embed = grid.unsqueeze(0)
            else:
                module.height = module.width = -1  # never the latent's: always rebuilt
        if type(module).__name__ == "CogVideoXPatchEmbed":
            module.sample_height = -1
    return exact


def _run(model: Any, inputs: dict[str, Any]) -> Any:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].double()


Errors = dict[str, tuple[float, float, float]]


def _compare(
    model: Any,
    client: posenc.Client,
    monkeypatch: pytest.MonkeyPatch,
    sizes: dict[str, Callable[[Any], dict[str, Any]]],
) -> Errors:
    """Per size: the largest error of native and of patched float32 outputs against the
    float64 reference, and the largest difference between native and patched."""
    model = model.eval()
    inputs = {}
    for name, make in sizes.items():
        torch.manual_seed(1)
        inputs[name] = make(torch.float32)
    # diffusers' grid functions are exact only while the reference runs: the native runs
    # build their grids as diffusers does.
    with monkeypatch.context() as exact_grids:
        reference = _reference(model, exact_grids)
        exact = {
            name: _run(reference, {k: _double(v) for k, v in inputs[name].items()})
            for name in sizes
        }
    return _measure(model, client, inputs, exact)


def _measure(
    model: Any,
    client: posenc.Client,
    inputs: dict[str, dict[str, Any]],
    exact: dict[str, Any],
) -> Errors:
    native = {name: _run(model, inputs[name]) for name in inputs}
    with patch(model, client) as patched:
        assert patched.specs, "nothing was patched"
        ours = {name: _run(model, inputs[name]) for name in inputs}
        fetches = patched.fetches
        for name in inputs:  # a size met again is not fetched again
            _run(model, inputs[name])
        assert patched.fetches == fetches
    errors = {
        name: (
            float((native[name] - exact[name]).abs().max()),
            float((ours[name] - exact[name]).abs().max()),
            float((ours[name] - native[name]).abs().max()),
        )
        for name in inputs
    }
    # Undone: the model is native again.
    first = next(iter(inputs))
    assert torch.equal(_run(model, inputs[first]), native[first])
    return errors


def _double(value: Any) -> Any:
    return (
        value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    )


def _report(errors: dict[str, tuple[float, float, float]]) -> str:
    return "; ".join(
        f"{name}: native {n:.3g}, posenc {p:.3g} ({n / max(p, 1e-300):.1f}x)"
        for name, (n, p, _) in errors.items()
    )


def _assert_no_worse(errors: dict[str, tuple[float, float, float]]) -> None:
    """Equal to native at the training size; elsewhere no further from the reference (a
    quarter of slack: the float32 arithmetic's own noise, a few 1e-7, dominates)."""
    assert errors["training"][2] <= SAME_SIZE_TOLERANCE, _report(errors)
    for name, (native, ours, _) in errors.items():
        assert ours <= 1.25 * native + 1e-7, (name, _report(errors))


# -- the models --------------------------------------------------------------------------------

# Every model is the smallest its settings allow: one layer of two heads over four latent
# channels.
_TINY = {"num_layers": 1, "num_attention_heads": 2, "in_channels": 4, "out_channels": 4}


def _tiny(name: str, **settings: Any) -> Any:
    """diffusers' transformer ``name`` with the :data:`_TINY` sizes (``settings`` take
    precedence), its weights drawn from seed 0."""
    torch.manual_seed(0)
    return getattr(diffusers, name)(**{**_TINY, **settings})


def _inputs(latents: tuple[int, ...], **conditions: Any) -> Callable[[Any], dict[str, Any]]:
    """A model's inputs in a given dtype: random latents of shape ``latents``, then each
    condition, a shape (random, drawn in this order, in that dtype) or a value."""

    def make(dtype: Any) -> dict[str, Any]:
        return {
            "hidden_states": torch.randn(*latents, dtype=dtype),
            **{
                name: torch.randn(*value, dtype=dtype) if isinstance(value, tuple) else value
                for name, value in conditions.items()
            },
        }

    return make


_STEP = torch.tensor([500])


def _dit() -> Any:
    # DiT-XL/2's grid settings (patch 2, no interpolation scale), sample 16 latents.
    return _tiny(
        "DiTTransformer2DModel",
        attention_head_dim=32,
        norm_num_groups=32,
        sample_size=16,
        patch_size=2,
    )


def _dit_inputs(latent: int) -> Callable[[Any], dict[str, Any]]:
    return _inputs((1, 4, latent, latent), timestep=_STEP, class_labels=torch.tensor([3]))


def _pixart() -> Any:
    # PixArt-alpha 1024's grid settings (patch 2, interpolation_scale 2), sample 16 latents.
    return _tiny(
        "PixArtTransformer2DModel",
        out_channels=8,
        attention_head_dim=32,
        cross_attention_dim=64,
        caption_channels=16,
        sample_size=16,
        patch_size=2,
        interpolation_scale=2,
    )


def _pixart_inputs(height: int, width: int) -> Callable[[Any], dict[str, Any]]:
    return _inputs(
        (1, 4, height, width),
        encoder_hidden_states=(1, 6, 16),
        timestep=_STEP,
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
    )


def _sd3() -> Any:
    # SD3's grid settings: patch 2, pos_embed_max_size three times the training grid (its
    # positions i / 3), sample 16 latents.
    return _tiny(
        "SD3Transformer2DModel",
        sample_size=16,
        patch_size=2,
        attention_head_dim=32,
        joint_attention_dim=32,
        caption_projection_dim=64,
        pooled_projection_dim=16,
        pos_embed_max_size=24,
    )


def _sd3_inputs(height: int, width: int) -> Callable[[Any], dict[str, Any]]:
    return _inputs(
        (1, 4, height, width),
        encoder_hidden_states=(1, 6, 32),
        pooled_projections=(1, 16),
        timestep=_STEP,
    )


# CogVideoX's settings besides its positions: patch 2, temporal compression 4, 8 text tokens.
_COGVIDEOX = {
    "time_embed_dim": 32,
    "text_embed_dim": 16,
    "patch_size": 2,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 8,
}


def _cogvideox() -> Any:
    # CogVideoX-2b's grid settings: spatial scale 1.875, sin-cos positions; 8 x 8 latents of
    # 5 frames.
    return _tiny(
        "CogVideoXTransformer3DModel",
        **_COGVIDEOX,
        attention_head_dim=32,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        spatial_interpolation_scale=1.875,
        temporal_interpolation_scale=1.0,
    )


def _cogvideox_inputs(frames: int, size: int) -> Callable[[Any], dict[str, Any]]:
    return _inputs((1, frames, 4, size, size), encoder_hidden_states=(1, 8, 16), timestep=_STEP)


# name: the model, its inputs, the arguments of its inputs at each size, and whether the
# model's own grid is exact at every size (else at the training size only).
_GRID_MODELS: dict[str, tuple[Callable[[], Any], Callable[..., Any], dict[str, Any], bool]] = {
    # DiT's positions i / 1, i / 2, i / 4 are exact in float32: both grids are exact, and the
    # outputs agree at every size.
    "dit": (_dit, _dit_inputs, {"training": (16,), "2x": (32,), "4x": (64,)}, True),
    # Aspect-ratio buckets: a grid of n cells has positions i * 8 / n / 2, a third or a fifth
    # of an integer for n = 12, 20, 24, 40.
    "pixart": (
        _pixart,
        _pixart_inputs,
        {
            "training": (16, 16),
            "bucket 24x40": (24, 40),
            "2x bucket 48x80": (48, 80),
            "4x": (64, 64),
        },
        False,
    ),
    # SD3 cannot run past pos_embed_max_size: 3x its training grid is its largest.
    "sd3": (
        _sd3,
        _sd3_inputs,
        {"training": (16, 16), "2x": (32, 32), "3x": (48, 48), "crop 48x20": (48, 20)},
        False,
    ),
    # Latent frames (5 - 1) // 4 + 1 = 2 at training; twice the frames and 2x, 4x the size.
    "cogvideox": (
        _cogvideox,
        _cogvideox_inputs,
        {"training": (2, 8), "2x frames": (4, 8), "2x": (2, 16), "4x": (2, 32)},
        False,
    ),
}


@pytest.mark.parametrize("model", list(_GRID_MODELS))
def test_patched_grids_are_exact_at_every_size(
    client: posenc.Client, monkeypatch: Any, model: str
) -> None:
    build, inputs, sizes, exact_everywhere = _GRID_MODELS[model]
    errors = _compare(
        build(), client, monkeypatch, {size: inputs(*args) for size, args in sizes.items()}
    )
    if exact_everywhere:
        for name, (_, _, difference) in errors.items():
            assert difference <= SAME_SIZE_TOLERANCE, (name, _report(errors))
    _assert_no_worse(errors)


# -- the grids at the published models' full sizes ----------------------------------------------

# The drift is a function of the positions, not of the width: 64 columns (frequencies 1 down
# to 10000 ** -15/16) stand for each model's.
# name: (embed_dim, (height, width) in patches, base_size, interpolation_scale, crop of a
# larger grid (SD3: its pos_embed_max_size grid, centred) or None)
_GRIDS_2D = {
    # PixArt-alpha 1024 (base 64 patches, scale 2), its 768 x 1344 px aspect-ratio bucket.
    "pixart-1024 bucket 768x1344": (64, (48, 84), 64, 2.0, None),
    # SD3 medium: a 1024 x 1024 px image is the centred 64 x 64 crop of its 192 x 192 grid.
    "sd3 1024x1024": (64, (64, 64), 64, 1.0, 192),
    "sd3 1536x1024": (64, (96, 64), 64, 1.0, 192),
}


def _cropped(grid: Any, size: int, height: int, width: int) -> Any:
    top, left = (size - height) // 2, (size - width) // 2
    return grid.reshape(size, size, -1)[top : top + height, left : left + width].reshape(
        height * width, -1
    )


@pytest.mark.parametrize("case", list(_GRIDS_2D))
def test_published_2d_grids_drift_where_posenc_does_not(client: posenc.Client, case: str) -> None:
    embed_dim, (height, width), base_size, scale, crop = _GRIDS_2D[case]
    size = (crop, crop) if crop else (height, width)
    native = embeddings.get_2d_sincos_pos_embed(
        embed_dim, size, base_size=base_size, interpolation_scale=scale
    ).float()
    exact = _exact_2d(embed_dim, size, base_size=base_size, interpolation_scale=scale)
    spec = grid_specs.sincos_grid_2d(embed_dim, size, base_size, scale)
    ours = torch.from_numpy(client.get_grid(spec, dtype="float32").reshape(-1, embed_dim))
    if crop:
        native, exact, ours = (_cropped(g, crop, height, width) for g in (native, exact, ours))
    _assert_drift(native, ours, exact)


@pytest.mark.parametrize(("height", "width", "frames"), [(480, 720, 49), (960, 1440, 97)])
def test_published_3d_grid_drifts_where_posenc_does_not(
    client: posenc.Client, height: int, width: int, frames: int
) -> None:
    # CogVideoX-2b at 720 x 480 px and 49 frames (45 x 30 patches, 13 latent frames), and at
    # twice that in every axis; spatial positions i / 1.875; 64 columns as above.
    grid_w, grid_h, grid_t = width // 16, height // 16, (frames - 1) // 4 + 1
    native = embeddings.get_3d_sincos_pos_embed(64, (grid_w, grid_h), grid_t, 1.875, 1.0)
    exact = _exact_3d(64, (grid_w, grid_h), grid_t, 1.875, 1.0)
    spec = grid_specs.sincos_grid_3d(64, (grid_w, grid_h), grid_t, 1.875)
    ours = torch.from_numpy(client.get_grid(spec, dtype="float32").reshape(-1, 64))
    _assert_drift(native.reshape(-1, 64).float(), ours, exact.reshape(-1, 64))


def _assert_drift(native: Any, ours: Any, exact: Any) -> None:
    """posenc's float32 grid within one float32 rounding of exact (3e-8 at most here);
    diffusers' at least 16 times further off (9e-7 to 1.8e-6 here)."""
    ours_error = float((ours.double() - exact).abs().max())
    native_error = float((native.double() - exact).abs().max())
    assert ours_error <= 2.0**-24, ours_error
    assert native_error >= 16 * ours_error, (native_error, ours_error)


def test_a_pipeline_is_patched_through_its_transformer(client: posenc.Client) -> None:
    from types import SimpleNamespace

    model = _dit()
    with patch(SimpleNamespace(transformer=model), client) as patched:
        assert list(patched.specs) == ["pos_embed"]
        assert patched.specs["pos_embed"].kind == "sincos_grid_2d"


def test_a_grid_read_wrongly_is_refused_and_nothing_is_patched(client: posenc.Client) -> None:
    model = _dit()
    module = model.pos_embed
    module.interpolation_scale = 2.0  # not what its buffer was built with
    hooks = dict(module._forward_pre_hooks)
    with pytest.raises(ValueError, match="differs from the module's own table"):
        patch(model, client)
    assert dict(module._forward_pre_hooks) == hooks


@pytest.mark.parametrize("version", ["0.41.0", "0.99.0"])
def test_an_untested_release_is_served_when_its_grids_agree(
    client: posenc.Client, monkeypatch: Any, version: str
) -> None:
    from posenc.integrations import diffusers as integration

    monkeypatch.setattr(integration.metadata, "version", lambda name: version)
    with (
        pytest.warns(integration.UntestedReleaseWarning, match=f"not {version}: each grid"),
        patch(_dit(), client, verify=False) as patched,
    ):
        assert list(patched.specs) == ["pos_embed"]


def test_an_untested_release_is_verified_even_when_told_not_to(
    client: posenc.Client, monkeypatch: Any
) -> None:
    from posenc.integrations import diffusers as integration

    monkeypatch.setattr(integration.metadata, "version", lambda name: "0.99.0")
    model = _dit()
    model.pos_embed.interpolation_scale = 2.0  # a release that builds its grid otherwise
    hooks = dict(model.pos_embed._forward_pre_hooks)
    with (
        pytest.warns(integration.UntestedReleaseWarning),
        pytest.raises(ValueError, match="differs from the module's own table"),
    ):
        patch(model, client, verify=False)
    assert dict(model.pos_embed._forward_pre_hooks) == hooks


def test_a_model_without_a_grid_is_refused(client: posenc.Client) -> None:
    with pytest.raises(ValueError, match="holds no positional table"):
        patch(torch.nn.Linear(2, 2), client)


# -- N-axis rotary models ----------------------------------------------------------------------


def _flux() -> Any:
    # Flux's rotary settings (head 128, axes (16, 56, 56), theta 10000), one layer of each.
    return _tiny(
        "FluxTransformer2DModel",
        patch_size=1,
        num_single_layers=1,
        attention_head_dim=128,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(16, 56, 56),
    )


def _flux_inputs(side: int) -> dict[str, Any]:
    torch.manual_seed(1)
    image_ids = torch.zeros(side, side, 3)
    image_ids[..., 1] = torch.arange(side)[:, None]
    image_ids[..., 2] = torch.arange(side)[None, :]
    return {
        "hidden_states": torch.randn(1, side * side, 4),
        "encoder_hidden_states": torch.randn(1, 4, 32),
        "pooled_projections": torch.randn(1, 16),
        "timestep": torch.tensor([0.5]),
        "img_ids": image_ids.reshape(-1, 3),
        "txt_ids": torch.zeros(4, 3),
    }


def test_flux_takes_its_rotary_tables_from_posenc(client: posenc.Client) -> None:
    model = _flux().eval()
    sizes = {"training": 8, "2x": 16, "4x": 32}
    native = {name: _run(model, _flux_inputs(side)) for name, side in sizes.items()}
    with patch(model, client) as patched:
        assert patched.specs["pos_embed"] == posenc.Spec(
            "rotary_axes", axes_dim=[16, 56, 56], rope_theta=10000.0
        )
        for name, side in sizes.items():
            ours = _run(model, _flux_inputs(side))
            # Flux builds its tables from float64 frequencies at integer ids: exact, as
            # posenc's are; the outputs agree to float32 noise.
            assert float((ours - native[name]).abs().max()) <= SAME_SIZE_TOLERANCE, name
        fetches = patched.fetches
        _run(model, _flux_inputs(8))  # the next denoising step at a size met before
        assert patched.fetches == fetches
    assert torch.equal(_run(model, _flux_inputs(8)), native["training"])


def _hunyuan_video() -> Any:
    # HunyuanVideo's rotary settings: head 128, rope_axes_dim (16, 56, 56), theta 256,
    # patch 2 x 2 in space and 1 in time.
    return _tiny(
        "HunyuanVideoTransformer3DModel",
        attention_head_dim=128,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=32,
        pooled_projection_dim=16,
        rope_axes_dim=(16, 56, 56),
    )


def _video_inputs(frames: int, size: int, text: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, frames, size, size),
        "timestep": torch.tensor([500]),
        **{name: make() for name, make in text.items()},
    }


_HUNYUAN_TEXT = {
    "encoder_hidden_states": lambda: torch.randn(1, 4, 32),
    "encoder_attention_mask": lambda: torch.ones(1, 4),
    "pooled_projections": lambda: torch.randn(1, 16),
    "guidance": lambda: torch.tensor([3500.0]),
}


def test_hunyuan_video_takes_exact_rotary_tables(client: posenc.Client) -> None:
    model = _hunyuan_video().eval()
    rope = model.rope
    with patch(model, client) as patched:
        assert patched.specs["rope"].parameters["rope_theta"] == 256.0
        # Its own tables are built from float32 frequencies: at 2x frames, and at 4x the
        # size, they are off by 2.8e-7 and 1.2e-6 against float64, posenc's by 3e-8.
        for frames, size in ((2, 16), (4, 64)):
            latent = torch.zeros(1, 4, frames, size, size)
            cells = _grid_cells(frames, size // 2, size // 2)
            exact = _exact_rotary(patched.specs["rope"], cells)
            ours = torch.cat(rope(latent), dim=-1).double()
            theirs = torch.cat(type(rope).forward(rope, latent), dim=-1).double()
            ours_error = float((ours - exact).abs().max())
            native_error = float((theirs - exact).abs().max())
            assert ours_error <= 2.0**-24 and native_error >= 8 * ours_error, (
                native_error,
                ours_error,
            )
        output = _run(model, _video_inputs(2, 16, _HUNYUAN_TEXT))
    native = _run(model, _video_inputs(2, 16, _HUNYUAN_TEXT))
    assert float((output - native).abs().max()) <= 1e-3


def _grid_cells(*sizes: int) -> Any:
    axes = [torch.arange(size) for size in sizes]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(sizes))


def _exact_rotary(spec: posenc.Spec, cells: Any) -> Any:
    """cos | sin of an N-axis rotary spec in float64 (frequencies and angles in float64: far
    within float32's rounding at these coordinates), diffusers' interleaved pairs."""
    theta = spec.parameters.get("rope_theta", 10000.0)
    cos, sin = [], []
    for axis, dim in enumerate(spec.parameters["axes_dim"]):
        frequencies = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.outer(cells[:, axis].double(), frequencies)
        cos.append(angles.cos().repeat_interleave(2, dim=1))
        sin.append(angles.sin().repeat_interleave(2, dim=1))
    return torch.cat([*cos, *sin], dim=-1)


def _wan(max_seq_len: int = 1024) -> Any:
    # Wan's rotary settings: head 128 split (44, 42, 42), theta 10000, patch (1, 2, 2).
    return _tiny(
        "WanTransformer3DModel",
        patch_size=(1, 2, 2),
        attention_head_dim=128,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        rope_max_seq_len=max_seq_len,
    )


_WAN_TEXT = {"encoder_hidden_states": lambda: torch.randn(1, 4, 32)}


def test_wan_takes_its_rotary_tables_from_posenc_past_its_own_length(
    client: posenc.Client,
) -> None:
    model = _wan(max_seq_len=16).eval()
    inside = _video_inputs(2, 16, _WAN_TEXT)  # 8 x 8 patches: within its 16-row table
    beyond = _video_inputs(2, 48, _WAN_TEXT)  # 24 x 24 patches: past it
    native = _run(model, inside)
    with pytest.raises(RuntimeError):
        _run(model, beyond)  # its table has 16 rows per axis
    with patch(model, client) as patched:
        assert patched.specs["rope"].parameters["axes_dim"] == (44, 42, 42)
        ours = _run(model, inside)
        assert float((ours - native).abs().max()) <= SAME_SIZE_TOLERANCE
        cells = _grid_cells(2, 24, 24)
        exact = _exact_rotary(patched.specs["rope"], cells)
        rows = torch.cat(model.rope(beyond["hidden_states"]), dim=-1).reshape(len(cells), -1)
        assert float((rows.double() - exact).abs().max()) <= 2.0**-24
        assert torch.isfinite(_run(model, beyond)).all()


# -- CogVideoX-5b and 1.5: the 3D rotary their pipelines build --------------------------------

_PREPARE = "_prepare_rotary_positional_embeddings"


def _cogvideox_pipeline(patch_size_t: int | None, sample: tuple[int, int, int] = (8, 12, 5)) -> Any:
    from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline

    height, width, frames = sample
    # CogVideoX-5b's rotary settings: head 64 (axes 16, 24, 24), theta 10000, patch 2,
    # temporal compression 4; CogVideoX 1.5 adds a temporal patch of 2. Latent sample sizes
    # shrunk (the published 60 x 90 for the tables only).
    transformer = _tiny(
        "CogVideoXTransformer3DModel",
        **_COGVIDEOX,
        attention_head_dim=64,
        sample_height=height,
        sample_width=width,
        sample_frames=frames,
        patch_size_t=patch_size_t,
        use_rotary_positional_embeddings=True,
    )
    # The prompt comes as embeddings and the video goes out as latents: no tokenizer, text
    # encoder or VAE to build; the denoising loop, the scheduler and the tables are the
    # pipeline's own.
    pipeline = CogVideoXPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        transformer=transformer.eval(),
        scheduler=CogVideoXDDIMScheduler(),
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _generate(pipeline: Any, height: int, width: int, frames: int) -> Any:
    torch.manual_seed(1)
    with torch.no_grad():
        return pipeline(
            prompt_embeds=torch.randn(1, 8, 16),
            height=height,
            width=width,
            num_frames=frames,
            num_inference_steps=2,
            guidance_scale=1.0,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
            return_dict=False,
        )[0].double()


def _table_errors(patched: posenc.integrations.diffusers.Patch, pipeline: Any, *size: int) -> Any:
    """The largest errors of the pipeline's own float32 table and of posenc's, against
    float64, for a video of ``size`` (pixels, pixels, latent frames), both built as the
    pipeline builds them for its denoising steps."""
    height, width, frames = size
    cpu = torch.device("cpu")
    ours = torch.cat(getattr(pipeline, _PREPARE)(height, width, frames, cpu), dim=-1)
    theirs = torch.cat(
        type(pipeline)._prepare_rotary_positional_embeddings(pipeline, height, width, frames, cpu),
        dim=-1,
    )
    grid = (height // 16, width // 16)
    cells = _grid_cells(ours.shape[0] // (grid[0] * grid[1]), *grid)
    exact = _exact_rotary(patched.specs[_PREPARE], cells)
    return (
        float((theirs.double() - exact).abs().max()),
        float((ours.double() - exact).abs().max()),
    )


def test_cogvideox_5b_takes_exact_rotary_tables_from_its_pipeline(
    client: posenc.Client,
) -> None:
    pipeline = _cogvideox_pipeline(None)
    native = _generate(pipeline, 64, 96, 5)  # the training size: 8 x 12 latents, 2 frames
    bigger = _generate(pipeline, 128, 192, 5)
    with patch(pipeline, client) as patched:
        assert patched.specs == {
            _PREPARE: posenc.Spec("rotary_axes", axes_dim=[16, 24, 24], rope_theta=10000.0)
        }
        ours = _generate(pipeline, 64, 96, 5)
        assert float((ours - native).abs().max()) <= SAME_SIZE_TOLERANCE
        fetches = patched.fetches
        assert torch.isfinite(_generate(pipeline, 64, 96, 13)).all()  # 2x the frames
        assert patched.fetches == fetches + 1
        # At another size its training grid's positions are spread over the video (i * 8 /
        # 16): not posenc's integer cells, so the pipeline's own table serves it.
        assert torch.equal(_generate(pipeline, 128, 192, 5), bigger)
        assert patched.fetches == fetches + 1
    assert torch.equal(_generate(pipeline, 64, 96, 5), native)

    # The tables at the published size (720 x 480 px, 13 latent frames) and twice the frames:
    # the pipeline's own are built from float32 positions and frequencies.
    published = _cogvideox_pipeline(None, (60, 90, 49))
    with patch(published, client) as patched:
        for frames in (13, 26):
            native_error, ours_error = _table_errors(patched, published, 480, 720, frames)
            assert ours_error <= 2.0**-24 and native_error >= 16 * ours_error, (
                frames,
                native_error,
                ours_error,
            )


def test_cogvideox_1_5_takes_rotary_tables_past_its_training_grid(
    client: posenc.Client,
) -> None:
    pipeline = _cogvideox_pipeline(2)
    native = _generate(pipeline, 64, 96, 5)
    with pytest.raises(RuntimeError):
        _generate(pipeline, 128, 192, 5)  # its own table stops at the training grid
    with patch(pipeline, client) as patched:
        ours = _generate(pipeline, 64, 96, 5)
        assert float((ours - native).abs().max()) <= SAME_SIZE_TOLERANCE
        for height, width in ((128, 192), (256, 384)):  # 2x and 4x the training size
            assert torch.isfinite(_generate(pipeline, height, width, 5)).all()
            cells = _grid_cells(1, height // 16, width // 16)
            exact = _exact_rotary(patched.specs[_PREPARE], cells)
            rows = torch.cat(getattr(pipeline, _PREPARE)(height, width, 2, torch.device("cpu")), -1)
            assert float((rows.double() - exact).abs().max()) <= 2.0**-24


def test_a_cogvideox_rotary_transformer_alone_names_its_pipeline(client: posenc.Client) -> None:
    with pytest.raises(ValueError, match=r"holds no positional table.*patch the pipeline"):
        patch(_cogvideox_pipeline(None).transformer, client)


def _lumina2(axes_lens: tuple[int, int, int]) -> Any:
    # Lumina-Image 2.0's rotary settings shrunk: three axes (caption index, h, w), theta
    # 10000, patch 2; a head of 32 split (8, 12, 12).
    return _tiny(
        "Lumina2Transformer2DModel",
        sample_size=16,
        patch_size=2,
        hidden_size=64,
        num_refiner_layers=1,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(8, 12, 12),
        axes_lens=axes_lens,
        cap_feat_dim=16,
    )


_LUMINA_TEXT = {
    "encoder_hidden_states": lambda: torch.randn(1, 4, 16),
    "encoder_attention_mask": lambda: torch.ones(1, 4, dtype=torch.bool),
}


def _image_inputs(size: int, text: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, size, size),
        "timestep": torch.tensor([0.5]),
        **{name: make() for name, make in text.items()},
    }


def test_lumina2_takes_its_rotary_tables_from_posenc_past_its_own_length(
    client: posenc.Client,
) -> None:
    model = _lumina2(axes_lens=(32, 16, 16)).eval()
    inside = _image_inputs(16, _LUMINA_TEXT)  # 8 x 8 patches: within its 16-row tables
    beyond = _image_inputs(48, _LUMINA_TEXT)  # 24 x 24 patches: past them
    native = _run(model, inside)
    with pytest.raises(RuntimeError):
        _run(model, beyond)
    with patch(model, client) as patched:
        assert patched.specs["rope_embedder"] == posenc.Spec(
            "rotary_axes", axes_dim=[8, 12, 12], rope_theta=10000.0
        )
        # Its own tables come from float64 frequencies, in complex128, as posenc's here.
        assert float((_run(model, inside) - native).abs().max()) <= SAME_SIZE_TOLERANCE
        fetches = patched.fetches
        _run(model, inside)  # the next denoising step
        assert patched.fetches == fetches
        assert torch.isfinite(_run(model, beyond)).all()
        cells = _grid_cells(1, 24, 24) + torch.tensor([4, 0, 0])  # after 4 caption tokens
        rotations = model.rope_embedder._get_freqs_cis(cells.unsqueeze(0))[0]
        exact = _exact_rotary(patched.specs["rope_embedder"], cells)
        half = exact.shape[-1] // 2
        expected = torch.complex(exact[:, :half:2], exact[:, half::2])
        # float64 either way: as close as the float64 reference's own rounding.
        assert float((rotations - expected).abs().max()) <= 1e-13
    assert torch.equal(_run(model, inside), native)


def test_the_grid_drift_figure_measures_diffusers_own_grids(client: posenc.Client) -> None:
    """``posenc plot grid-drift`` builds its float32-position grids itself (the plot extra
    needs no diffusers): their errors are those of diffusers' own function."""
    from posenc import plot

    spec = plot.default_spec("grid-drift")
    sides = [48, 64, 84]
    data = plot.grid_drift(client, spec, sides=np.asarray(sides))
    for side, measured in zip(sides, data.float32_positions, strict=True):
        native = embeddings.get_2d_sincos_pos_embed(
            64, side, base_size=64, interpolation_scale=2.0
        ).float()
        exact = _exact_2d(64, side, base_size=64, interpolation_scale=2.0)
        # The exact grids (posenc's float64, and the float64 one here) differ by 1e-15.
        assert abs(measured - float((native.double() - exact).abs().max())) <= 1e-12, side
