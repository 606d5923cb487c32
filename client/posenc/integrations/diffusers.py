"""One call that makes a diffusers transformer take posenc's exact position tables.

::

    from posenc.integrations.diffusers import patch

    with posenc.Client(target) as client, patch(pipeline, client):
        image = pipeline(prompt, height=1024, width=768).images[0]

diffusers builds the sin-cos grid of a patch embedding from float32 positions
(``i / (n / base_size) / interpolation_scale``), and builds it again at every forward whose
latent size differs from the training size (DiT at 512 px, each PixArt aspect-ratio bucket,
SD3's crops, a longer CogVideoX video). Where those positions are not exact in float32 (a
third, a fifth: SD3's ``i / 3``, most PixArt buckets, CogVideoX's spatial scale 1.875), the
grid drifts from the model's definition. :func:`patch` makes each patch embedding take
posenc's grid instead, whose positions are exact rationals:

- ``PatchEmbed`` (DiT, PixArt-alpha and -sigma, SD3 and every model built on it): the grid of
  each latent size the model is run at; SD3's crop of its ``pos_embed_max_size`` grid as the
  coordinates of the crop;
- ``CogVideoXPatchEmbed`` with sin-cos positions (CogVideoX-2b): the 3D grid of each video
  size, after its text tokens' zero rows;
- the N-axis rotary embeddings of Flux (``FluxPosEmbed``: the ids of each forward), of
  HunyuanVideo and Wan (their ``(t, h, w)`` grid of each video size) and of Lumina-Image 2.0
  (caption and image ids): posenc's ``rotary_axes`` tables, exact at any coordinate
  (HunyuanVideo builds its frequencies in float32; Wan's own table stops at
  ``rope_max_seq_len`` positions per axis, Lumina 2's at ``axes_lens``);
- the 3D rotary of CogVideoX-5b and CogVideoX 1.5, which their pipelines build for each
  video size (``_prepare_rotary_positional_embeddings``): patch the pipeline. CogVideoX 1.5's
  positions are the integer cells at any size (its own table stops at the training grid).
  CogVideoX-5b spreads its training grid's positions over a video of another size
  (fractions such as ``i * 30 / n``): there posenc's integer coordinates do not apply, and the
  pipeline's own table is used; at the training size, any number of frames, the table is
  posenc's.

Each size's grid is fetched once and reused by every denoising step at that size. Learned
position embeddings (CogVideoX-5b-I2V) are weights, not tables: they are left alone and
named in :attr:`Patch.skipped`. The returned :class:`Patch` restores the model.
Importing this module imports torch, not diffusers: modules are recognised by their
attributes.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from importlib import metadata
from typing import Any, Final

import numpy as np
import torch
from torch import nn

import posenc
from posenc._output import as_tensor
from posenc.integrations._patch import Patched

__all__ = ["SUPPORTED_DIFFUSERS", "Patch", "UntestedReleaseWarning", "patch"]

log = logging.getLogger(__name__)


class UntestedReleaseWarning(UserWarning):
    """The installed diffusers is outside :data:`SUPPORTED_DIFFUSERS`: every grid is checked
    against the module's own before it is installed."""


#: The diffusers releases whose modules this integration is tested against.
SUPPORTED_DIFFUSERS: Final = ((0, 42), (0, 42))
# A grid compared with the module's own at its training size when patching: diffusers'
# float32 positions are within a few float32 ulps of exact there, so a larger difference
# means a misread module, not rounding.
_VERIFY_TOLERANCE: Final = 1e-4
# Rotary tables kept per model: one per size a model runs at (a pipeline's sizes are few).
_ROTARY_KEPT: Final = 16


class Patch(Patched):
    """What :func:`patch` changed in a model: undone by :meth:`undo` or on leaving a ``with``.

    Attributes:
        specs: The spec of each patched module's table (a grid: at its training size), by
            module name.
        skipped: Modules holding positions posenc leaves alone, by name, with the reason.
        fetches: How many grids were fetched (one per spec: later forwards reuse them).
    """

    def __init__(self, client: posenc.Client) -> None:
        super().__init__(client)
        self.fetches = 0
        self._grids: dict[posenc.Spec, torch.Tensor] = {}
        self._rotary: dict[tuple[Any, ...], torch.Tensor] = {}

    def rotary(
        self, spec: posenc.Spec, coordinates: torch.Tensor, dtype: str = "float32"
    ) -> torch.Tensor:
        """The rows of an N-axis rotary spec at ``[rows, 3]`` integer coordinates, fetched
        once per coordinates (every denoising step of a size asks for the same)."""
        array = np.ascontiguousarray(coordinates.detach().cpu().numpy().astype(np.int64))
        digest = hashlib.blake2b(array.tobytes(), digest_size=16).digest()
        key = (spec, dtype, array.shape, digest)
        rows = self._rotary.get(key)
        if rows is None:
            rows = as_tensor(self.client.get_positions(array, spec, dtype=dtype))
            if len(self._rotary) >= _ROTARY_KEPT:
                self._rotary.pop(next(iter(self._rotary)))
            self._rotary[key] = rows
            self.fetches += 1
        return rows

    def grid(self, spec: posenc.Spec) -> torch.Tensor:
        """The float32 rows of a grid spec, ``[cells, embed_dim]`` in row-major cell order,
        fetched once."""
        rows = self._grids.get(spec)
        if rows is None:
            grid = self.client.get_grid(spec, dtype="float32")
            rows = as_tensor(np.ascontiguousarray(grid.reshape(-1, grid.shape[-1])))
            self._grids[spec] = rows
            self.fetches += 1
        return rows

    def _forget(self) -> None:
        self._grids.clear()
        self._rotary.clear()


def patch(model: Any, client: posenc.Client, *, verify: bool = True) -> Patch:
    """Makes every forward of a diffusers transformer take posenc's exact position tables.

    Args:
        model: A diffusers model (``DiTTransformer2DModel``, ``PixArtTransformer2DModel``,
            ``SD3Transformer2DModel``, ``CogVideoXTransformer3DModel``,
            ``FluxTransformer2DModel``, ``HunyuanVideoTransformer3DModel``,
            ``WanTransformer3DModel``, ``Lumina2Transformer2DModel``, any ``nn.Module``
            holding their position modules) or a pipeline (its ``transformer`` is patched;
            a CogVideoX pipeline's 3D rotary too).
        client: The :class:`posenc.Client` grids are fetched with; it must stay open while
            the model runs patched.
        verify: Compare each module's grid at its training size with the module's own
            before replacing it, refusing (``ValueError``) a difference beyond float32
            rounding: the sign of a module read differently from diffusers. Always on
            with a diffusers outside :data:`SUPPORTED_DIFFUSERS`.

    Returns:
        The :class:`Patch`: ``undo()`` (or use it as a context manager) restores the model.

    Raises:
        ValueError: The model holds no table posenc serves, or (``verify``) a table differs
            from the module's own.
    """
    # Outside the tested releases the check against the module's own grid is what makes a
    # table safe to install, so it runs whatever ``verify`` says.
    verify = _check_release() or verify
    module = getattr(model, "transformer", model)
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a diffusers model or pipeline, got {type(model).__name__}")
    handle = Patch(client)
    try:
        if _builds_cogvideox_rotary(module):
            if model is module:
                handle.skipped[""] = (
                    "CogVideoX's 3D rotary comes from its pipeline: patch the pipeline"
                )
            else:
                _CogVideoXRotary(handle, model).install(verify)
        for name, child in module.named_modules():
            kind = type(child).__name__
            if _is_patch_embed(child):
                _PatchEmbed(handle, name, child).install(verify)
            elif _is_cogvideox_embed(child):
                if child.use_learned_positional_embeddings:
                    handle.skipped[name] = "learned position embeddings (weights, not a table)"
                else:
                    _CogVideoXEmbed(handle, name, child).install(verify)
            elif kind in _ROTARY:
                _ROTARY[kind](handle, name, child).install(verify)
            elif kind.endswith(("RotaryPosEmbed", "PosEmbed")):
                handle.skipped[name] = f"{kind}: not served (its positions or layout differ)"
    except BaseException:
        handle.undo()
        raise
    for name, reason in handle.skipped.items():
        log.info("posenc left %s alone: %s", name or type(module).__name__, reason)
    if not handle.specs:
        reasons = "".join(f"; {name or 'the model'}: {why}" for name, why in handle.skipped.items())
        raise ValueError(
            f"{type(module).__name__} holds no positional table posenc serves{reasons}"
        )
    return handle


def _check_release() -> bool:
    """Warns, and returns True, when the installed diffusers is outside the tested releases.

    The modules are recognised by their attributes, so a newer release is served, but it may
    build its grids differently: each grid is then compared with the module's own at its
    training size before it is installed, and refused if it differs.
    """
    try:
        version = metadata.version("diffusers")
    except metadata.PackageNotFoundError:
        return False  # a model built without the package (a copy of its modules)
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    oldest, newest = SUPPORTED_DIFFUSERS
    if oldest <= release <= newest:
        return False
    tested = f"{'.'.join(map(str, oldest))} to {'.'.join(map(str, newest))}.x"
    warnings.warn(
        f"posenc.integrations.diffusers is tested with diffusers {tested}, not {version}: "
        "each grid is compared with the module's own before it is installed, and refused "
        "if it differs",
        UntestedReleaseWarning,
        stacklevel=3,
    )
    return True


# -- recognising modules ------------------------------------------------------------------


def _is_patch_embed(module: nn.Module) -> bool:
    # diffusers' PatchEmbed: a conv projection and a sin-cos pos_embed of base_size cells.
    # Looked up in the instance's own attributes: a diffusers model answers unknown names
    # from its config, with a deprecation warning.
    attributes = vars(module)
    return {
        "pos_embed_max_size",
        "base_size",
        "interpolation_scale",
    } <= attributes.keys() and module._buffers.get("pos_embed") is not None


def _is_cogvideox_embed(module: nn.Module) -> bool:
    attributes = vars(module)
    return (
        {"max_text_seq_length", "spatial_interpolation_scale"} <= attributes.keys()
        and hasattr(module, "_get_positional_embeddings")
        and bool(attributes.get("use_positional_embeddings"))
    )


def _builds_cogvideox_rotary(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return type(module).__name__ == "CogVideoXTransformer3DModel" and bool(
        getattr(config, "use_rotary_positional_embeddings", False)
    )


def _check(name: str, spec: posenc.Spec, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    theirs = theirs.detach().to("cpu", torch.float32).reshape(ours.shape)
    difference = float((ours - theirs).abs().max()) if ours.numel() else 0.0
    if not difference <= _VERIFY_TOLERANCE:
        raise ValueError(
            f"{name or 'the model'}: posenc's {spec.kind} differs from the module's own table by "
            f"{difference:.3g} at its training size: the module was read wrongly "
            "(patch(..., verify=False) skips this check)"
        )


# -- the patch embeddings -----------------------------------------------------------------


class _PatchEmbed:
    """diffusers' ``PatchEmbed``: a 2D grid per latent size, or SD3's crop of one grid."""

    def __init__(self, handle: Patch, name: str, module: Any) -> None:
        self.handle, self.name, self.module = handle, name, module
        self.embed_dim = int(module.pos_embed.shape[-1])

    def spec(self, height: int, width: int) -> posenc.Spec:
        # diffusers' position of index i on an axis of n cells: i / (n / base_size) / scale.
        return posenc.Spec(
            "sincos_grid_2d",
            embed_dim=self.embed_dim,
            grid_height=height,
            grid_width=width,
            base_size=float(self.module.base_size),
            interpolation_scale=float(self.module.interpolation_scale),
        )

    def install(self, verify: bool) -> None:
        module = self.module
        if module.pos_embed_max_size:
            size = int(module.pos_embed_max_size)
            spec = self.spec(size, size)
            if verify:
                _check(self.name, spec, self.handle.grid(spec), module.pos_embed)
            self.handle.specs[self.name] = spec
            self.handle._override(module, "cropped_pos_embed", self.cropped)
            return
        spec = self.spec(int(module.height), int(module.width))
        if verify:
            _check(self.name, spec, self.handle.grid(spec), module.pos_embed)
        self.handle.specs[self.name] = spec
        # forward uses the pos_embed buffer when the latent's grid is (height, width), and
        # rebuilds the grid in float32 otherwise: before each forward, the buffer becomes
        # posenc's grid of the latent's size, and (height, width) that size.
        self.handle._replace(module, "pos_embed", module.pos_embed)
        self.handle._replace(module, "height", module.height)
        self.handle._replace(module, "width", module.width)
        hook = module.register_forward_pre_hook(self.before_forward)
        self.handle._undo.append(hook.remove)

    def before_forward(self, module: Any, args: tuple[Any, ...]) -> None:
        latent = args[0]
        height = latent.shape[-2] // module.patch_size
        width = latent.shape[-1] // module.patch_size
        grid = self.handle.grid(self.spec(height, width))
        module.pos_embed = grid.to(latent.device).unsqueeze(0)
        module.height, module.width = height, width

    def cropped(self, height: int, width: int) -> torch.Tensor:
        """SD3's crop: the centred ``height x width`` patches of the largest grid."""
        module = self.module
        size = int(module.pos_embed_max_size)
        height, width = height // module.patch_size, width // module.patch_size
        if height > size or width > size:
            raise ValueError(
                f"a latent of {height} x {width} patches exceeds pos_embed_max_size {size}"
            )
        top, left = (size - height) // 2, (size - width) // 2
        grid = self.handle.grid(self.spec(size, size)).reshape(size, size, -1)
        crop = grid[top : top + height, left : left + width].reshape(1, -1, self.embed_dim)
        return crop.to(module.pos_embed.device)


class _CogVideoXEmbed:
    """CogVideoX's patch embedding with sin-cos positions: the 3D grid of each video size,
    after ``max_text_seq_length`` zero rows for the text tokens."""

    def __init__(self, handle: Patch, name: str, module: Any) -> None:
        self.handle, self.name, self.module = handle, name, module

    def spec(self, height: int, width: int, frames: int) -> posenc.Spec:
        module = self.module
        return posenc.Spec(
            "sincos_grid_3d",
            embed_dim=int(module.embed_dim),
            grid_frames=(frames - 1) // module.temporal_compression_ratio + 1,
            grid_height=height // module.patch_size,
            grid_width=width // module.patch_size,
            spatial_interpolation_scale=float(module.spatial_interpolation_scale),
            temporal_interpolation_scale=float(module.temporal_interpolation_scale),
        )

    def install(self, verify: bool) -> None:
        module = self.module
        size = (module.sample_height, module.sample_width, module.sample_frames)
        spec = self.spec(*size)
        ours = self.joint(*size)
        if verify:
            _check(self.name, spec, ours, module.pos_embedding)
        self.handle.specs[self.name] = spec
        self.handle._replace(module, "pos_embedding", ours.to(module.pos_embedding.device))
        self.handle._override(module, "_get_positional_embeddings", self.joint)

    def joint(
        self, height: int, width: int, frames: int, device: torch.device | None = None
    ) -> torch.Tensor:
        """``[1, text + cells, embed_dim]``: zero rows for the text, then the grid."""
        grid = self.handle.grid(self.spec(height, width, frames))
        text = grid.new_zeros(int(self.module.max_text_seq_length), grid.shape[1])
        joint = torch.cat([text, grid]).unsqueeze(0)
        return joint if device is None else joint.to(device)


# -- N-axis rotary ------------------------------------------------------------------------


class _AxesRotary:
    """A diffusers rotary module whose method ``METHOD`` gives the rotations of integer
    coordinates (``(cos, sin)`` in diffusers' interleaved-pairs layout, posenc's ``gptj``,
    unless a subclass says otherwise)."""

    #: The module's method that gives its tables, which the patch replaces.
    METHOD = "forward"
    #: The module's attribute holding each axis's width (its ``theta`` is the base).
    DIMS = "axes_dim"

    def __init__(self, handle: Patch, name: str, module: Any) -> None:
        self.handle, self.name, self.module = handle, name, module
        self.native = getattr(module, self.METHOD)

    @property
    def spec(self) -> posenc.Spec:
        dims = [int(dim) for dim in getattr(self.module, self.DIMS)]
        if len(dims) > 3:
            raise ValueError(f"{self.name}: {len(dims)} rotary axes, posenc serves at most 3")
        return posenc.Spec(
            "rotary_axes",
            axes_dim=dims + [0] * (3 - len(dims)),
            rope_theta=float(self.module.theta),
        )

    def sample(self) -> tuple[Any, ...]:
        """Arguments of a small call of the method, to compare with the native one."""
        raise NotImplementedError

    @staticmethod
    def values(tables: Any) -> torch.Tensor:
        """What the method gave, as one real tensor: ``cos | sin``."""
        return torch.cat(tables, dim=-1)

    def install(self, verify: bool) -> None:
        spec = self.spec
        if verify:
            with torch.no_grad():
                theirs = self.values(self.native(*self.sample()))
                ours = self.values(self(*self.sample()))
            _check(self.name, spec, ours.reshape(-1), theirs.reshape(-1))
        self.handle.specs[self.name] = spec
        self.handle._override(self.module, self.METHOD, self)

    def cos_sin(self, coordinates: torch.Tensor, like: torch.Tensor) -> tuple[Any, Any]:
        rows = self.handle.rotary(self.spec, coordinates).to(like.device)
        half = rows.shape[-1] // 2
        return rows[:, :half], rows[:, half:]

    def __call__(self, *args: Any) -> Any:
        raise NotImplementedError


def _grid_cells(*sizes: int) -> torch.Tensor:
    """``[prod(sizes), len(sizes)]`` cells of a grid, row-major."""
    axes = [torch.arange(size) for size in sizes]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(sizes))


class _Flux(_AxesRotary):
    """``FluxPosEmbed``: the ids of each forward (text ``(0, 0, 0)``, image ``(0, h, w)``)."""

    def sample(self) -> tuple[Any, ...]:
        return (_grid_cells(1, 3, 4)[:, : len(self.module.axes_dim)].float(),)

    def __call__(self, ids: torch.Tensor) -> Any:
        coordinates = ids.detach().to("cpu", torch.float64)
        if not torch.equal(coordinates, coordinates.round()):
            return self.native(ids)  # positions posenc cannot hold exactly: the model's own
        padded = torch.zeros(len(coordinates), 3, dtype=torch.int64)
        padded[:, : coordinates.shape[-1]] = coordinates.to(torch.int64)
        return self.cos_sin(padded, ids)


class _HunyuanVideo(_AxesRotary):
    """``HunyuanVideoRotaryPosEmbed``: the (t, h, w) grid of the latent's patches."""

    DIMS = "rope_dim"

    def sample(self) -> tuple[Any, ...]:
        p, pt = self.module.patch_size, self.module.patch_size_t
        return (torch.zeros(1, 1, 2 * pt, 3 * p, 4 * p),)

    def __call__(self, hidden_states: torch.Tensor) -> Any:
        _, _, frames, height, width = hidden_states.shape
        p, pt = self.module.patch_size, self.module.patch_size_t
        return self.cos_sin(_grid_cells(frames // pt, height // p, width // p), hidden_states)


class _Wan(_AxesRotary):
    """``WanRotaryPosEmbed``: the (t, h, w) grid of the latent's patches, at any size (the
    module's own table stops at ``max_seq_len`` per axis)."""

    # The rotary base WanTransformer3DModel builds its module with (not kept by the module;
    # install's comparison with the module's own table checks it).
    THETA: Final = 10000.0

    @property
    def spec(self) -> posenc.Spec:
        module = self.module
        return posenc.Spec(
            "rotary_axes",
            axes_dim=[module.t_dim, module.h_dim, module.w_dim],
            rope_theta=self.THETA,
        )

    def sample(self) -> tuple[Any, ...]:
        p_t, p_h, p_w = self.module.patch_size
        return (torch.zeros(1, 1, 2 * p_t, 3 * p_h, 4 * p_w),)

    def __call__(self, hidden_states: torch.Tensor) -> Any:
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.module.patch_size
        cells = _grid_cells(frames // p_t, height // p_h, width // p_w)
        cos, sin = self.cos_sin(cells, hidden_states)
        return cos.reshape(1, len(cells), 1, -1), sin.reshape(1, len(cells), 1, -1)


class _Lumina2(_AxesRotary):
    """``Lumina2RotaryPosEmbed``: complex rotations of the ids it builds for the caption
    tokens ``(i, 0, 0)`` and the image patches ``(caption length, h, w)``, at any size (the
    module's own table stops at ``axes_lens`` positions per axis). Its own are built from
    float64 frequencies and kept in complex128: so are posenc's, fetched in float64."""

    METHOD = "_get_freqs_cis"

    def sample(self) -> tuple[Any, ...]:
        return (_grid_cells(2, 3, 4).unsqueeze(0),)

    @staticmethod
    def values(tables: Any) -> torch.Tensor:
        return torch.view_as_real(tables)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """``[batch, tokens, head / 2]`` complex rotations of ``[batch, tokens, 3]`` ids."""
        rows = self.handle.rotary(self.spec, ids.reshape(-1, 3), dtype="float64")
        half = rows.shape[-1] // 2
        # diffusers' interleaved pairs repeat each value: one per pair makes the rotation.
        rotations = torch.complex(rows[:, :half:2], rows[:, half::2])
        return rotations.reshape(*ids.shape[:-1], -1).to(ids.device)


_ROTARY: Final[dict[str, type[_AxesRotary]]] = {
    "FluxPosEmbed": _Flux,
    "HunyuanVideoRotaryPosEmbed": _HunyuanVideo,
    "WanRotaryPosEmbed": _Wan,
    "Lumina2RotaryPosEmbed": _Lumina2,
}


class _CogVideoXRotary(_AxesRotary):
    """The 3D rotary a CogVideoX pipeline builds for each video size and passes to every
    denoising step: cells ``(t, h, w)``, axes of ``head // 4``, ``head // 8 * 3`` and
    ``head // 8 * 3`` columns, theta 10000, diffusers' interleaved pairs. Its module is the
    pipeline."""

    METHOD = "_prepare_rotary_positional_embeddings"

    def __init__(self, handle: Patch, pipeline: Any) -> None:
        super().__init__(handle, self.METHOD, pipeline)
        self.config = pipeline.transformer.config

    @property
    def spec(self) -> posenc.Spec:
        head = int(self.config.attention_head_dim)
        return posenc.Spec(
            "rotary_axes", axes_dim=[head // 4, head // 8 * 3, head // 8 * 3], rope_theta=10000.0
        )

    def sample(self) -> tuple[Any, ...]:
        """The training size, where every version's cells are integers."""
        scale = int(self.module.vae_scale_factor_spatial)
        frames = (self.config.sample_frames - 1) // self.config.temporal_compression_ratio + 1
        height, width = self.config.sample_height * scale, self.config.sample_width * scale
        return (height, width, frames, torch.device("cpu"))

    def __call__(
        self, height: int, width: int, num_frames: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, ``[cells, head]`` each, for a video of ``num_frames`` latent
        frames and ``height x width`` pixels."""
        patch = int(self.config.patch_size)
        scale = int(self.module.vae_scale_factor_spatial)
        rows, columns = height // (scale * patch), width // (scale * patch)
        patch_t = self.config.patch_size_t
        if patch_t is None:  # CogVideoX 1.0: the training grid, resized over this one
            if self._crop(rows, columns) != ((0, 0), (rows, columns)):
                return self.native(height, width, num_frames, device)  # type: ignore[no-any-return]
            frames = num_frames
        else:  # CogVideoX 1.5: the first cells of each axis
            frames = (num_frames + patch_t - 1) // patch_t
        table = self.handle.rotary(self.spec, _grid_cells(frames, rows, columns)).to(device)
        half = table.shape[-1] // 2
        return table[:, :half], table[:, half:]

    def _crop(self, rows: int, columns: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The pipeline's crop of its training grid for a grid of ``rows x columns``: the
        ``n`` cells of an axis lie at ``linspace(top, bottom * (n - 1) / n, n)`` there,
        the integers ``0 .. n - 1`` when the crop is the grid itself (``top`` 0, ``bottom``
        ``n``), fractions otherwise."""
        patch = int(self.config.patch_size)
        tall, wide = self.config.sample_height // patch, self.config.sample_width // patch
        if rows / columns > tall / wide:
            high, broad = tall, round(tall / rows * columns)
        else:
            high, broad = round(wide / columns * rows), wide
        top, left = round((tall - high) / 2.0), round((wide - broad) / 2.0)
        return (top, left), (top + high, left + broad)
