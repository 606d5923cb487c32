"""Table kinds with several position axes: M-RoPE and the 2D and 3D sin-cos grids.

Each frequency of such a table takes its angle from one axis of a row's coordinates (M-RoPE:
temporal, height or width by its section; a grid: the axis whose 1D table it belongs to).
Rows are composed per axis from the engine's own machinery: each axis's frequencies are an
``engine.Waves`` of their own, the distinct coordinates of that axis get their wave rows
(``engine.wave_rows``: a function of the position alone, within about 2**-51 of exact), and
each row gathers its axes' rows into the kind's frequency slots before the kind's column
writer lays them out. So every axis keeps the accuracy of a one-axis table, and a row is the
same whichever selection (range, list, coordinates) asks for it.

A grid's rational positions (diffusers' ``i * base_size / n / interpolation_scale``) are
folded into its frequencies, as rotary's linear scaling folds its factor: the position is
the integer ``i``, the frequency ``w * base_size / n / interpolation_scale``, computed to 50
digits, so no position is ever rounded.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from decimal import Decimal, localcontext
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from posenc_server import engine
from posenc_server.tables.base import (
    BASE,
    Checker,
    Doc,
    Limits,
    TableKind,
    declared,
    max_frequency,
    number,
    parameter,
)
from posenc_server.tables.rotary import LAYOUTS, Rotary

# Complex elements composed per pass: keeps a pass's scratch rows within a few MiB.
_ELEMENTS_PER_PASS = 1 << 16
_SLOTS = npt.NDArray[np.intp]


class AxisWaves(engine.Waves):
    """The waves of a several-axis table: one ``engine.Waves`` per axis, and the slots (of
    a row's ``slots`` frequencies) that axis fills. It has no frequencies of its own."""

    def __init__(self, axes: Sequence[tuple[Sequence[Decimal], Sequence[int]]], slots: int):
        super().__init__(())
        self.slots = slots
        self.axes = tuple(
            (engine.Waves(frequencies), np.asarray(filled, dtype=np.intp))
            for frequencies, filled in axes
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by every axis's frequencies and rotation table."""
        return super().nbytes + sum(w.nbytes + s.nbytes for w, s in self.axes)


class MultiAxis(TableKind):
    """A table kind with ``AXES`` position axes (an ``engine.AxisTable``)."""

    @property
    @abc.abstractmethod
    def slots(self) -> int:
        """Frequencies of a row (``v = sin + i cos`` values before the column writer)."""

    @abc.abstractmethod
    def axis_frequencies(self) -> list[tuple[list[Decimal], list[int]]]:
        """Per axis, in coordinate order: its angular frequencies (to ``engine.PRECISION``)
        and the slots of a row they fill, in the same order."""

    @abc.abstractmethod
    def coordinates(self, positions: engine.Int64Array) -> engine.Int64Array:
        """The ``[n, AXES]`` coordinates of one-axis positions (range and list selections)."""

    def waves(self) -> engine.Waves:
        """One ``engine.Waves`` per axis (``AxisWaves``)."""
        with localcontext() as context:
            context.prec = engine.PRECISION
            return AxisWaves(self.axis_frequencies(), self.slots)

    def encode(self, encoding: engine.Encoding, coordinates: engine.Int64Array) -> engine.Rows:
        """The rows of ``[n, AXES]`` coordinates: per axis, the wave rows of its distinct
        coordinates, gathered into their slots; then the kind's columns."""
        waves = encoding.waves
        assert isinstance(waves, AxisWaves)
        out = np.zeros((len(coordinates), self.width), dtype=encoding.dtype)
        step = max(1, _ELEMENTS_PER_PASS // max(waves.slots, 1))
        for first in range(0, len(coordinates), step):
            part = coordinates[first : first + step]
            rows = np.empty((len(part), waves.slots), dtype=np.complex128)
            for axis, (axis_waves, filled) in enumerate(waves.axes):
                if filled.size:
                    distinct, inverse = np.unique(part[:, axis], return_inverse=True)
                    rows[:, filled] = engine.wave_rows(axis_waves, distinct)[inverse]
            self.write_columns(out[first : first + len(part)], rows)
        return out


class RotaryMultiAxis(MultiAxis):
    """A several-axis rotary kind (M-RoPE, ``axes.RotaryAxes``): a one-axis position is the
    same coordinate on every axis, its columns a rotary ``layout``'s."""

    rope_theta: float
    layout: str

    def coordinates(self, positions: engine.Int64Array) -> engine.Int64Array:
        """A one-axis position p is the coordinates (p, p, p): a text token's."""
        return np.repeat(positions.reshape(-1, 1), self.AXES, axis=1)

    def write_columns(self, target: engine.Rows, rows: engine.ComplexRows) -> None:
        """cos and sin (``v = sin + i cos``) in the rotary layout's order."""
        LAYOUTS[self.layout](target, rows.imag, rows.real)

    def check_rotary(self, check: Checker) -> None:
        """``rope_theta`` a base, ``layout`` a rotary layout."""
        check.real("rope_theta", self.rope_theta, 1.0)
        check.one_of("layout", self.layout, LAYOUTS)

    def check_width(self, check: Checker, limits: Limits, name: str) -> None:
        """The row, in its layout, within the server's max_d_model (else a problem of
        ``name``)."""
        if self.width > limits.max_d_model:
            check.add(
                name,
                f"the row width {self.width} (layout {self.layout}) is over the server's "
                f"max_d_model {limits.max_d_model}",
            )


def _scaled(frequencies: Sequence[Decimal], scale: Decimal) -> list[Decimal]:
    return [frequency * scale for frequency in frequencies]


def _geometric(base: float, columns: int) -> list[Decimal]:
    """``base ** (-2k / columns)`` for ``k < columns / 2``: the frequencies of a 1D sin-cos
    table (and of a rotary table of that head width)."""
    return Rotary(head_dim=columns, rope_theta=base).frequencies().inv_freq


# -- M-RoPE ------------------------------------------------------------------------------------


@declared(
    "mrope",
    "M-RoPE: rotary cos/sin whose frequencies take their angles from the (t, h, w) "
    "axes by mrope_section, merged as the model applies them",
)
class MRope(RotaryMultiAxis):
    """Multimodal rotary (Qwen2-VL, Qwen2.5-VL; Qwen3-VL interleaved)."""

    AXES: ClassVar[int] = 3

    head_dim: int = parameter(0, "the attention head width, even, >= 2")
    rope_theta: float = parameter(10000.0, BASE)
    mrope_section: tuple[int, ...] = parameter(
        (), "frequencies of the t, h and w axes, summing to head_dim / 2"
    )
    interleaved: bool = parameter(
        False, "Qwen3-VL's interleaved sections (else consecutive runs)", "false"
    )
    layout: str = parameter(
        "transformers",
        "transformers (2 * head_dim columns), vllm (head_dim) or gptj (2 * head_dim)",
        "transformers",
    )

    @property
    def width(self) -> int:
        """Columns of a row in this layout."""
        return self.head_dim if self.layout == "vllm" else 2 * self.head_dim

    @property
    def slots(self) -> int:
        """The ``head_dim / 2`` rotary frequencies."""
        return self.head_dim // 2

    def axis_of_frequency(self) -> list[int]:
        """The axis (0: t, 1: h, 2: w) each frequency takes its angle from."""
        if not self.interleaved:
            return [axis for axis, count in enumerate(self.mrope_section) for _ in range(count)]
        # Qwen3-VL: T H W T H W ... from frequency 0, each of h and w for 3 * its section
        # frequencies; t keeps the rest.
        _, height, width = self.mrope_section
        return [
            1 if i % 3 == 1 and i < 3 * height else 2 if i % 3 == 2 and i < 3 * width else 0
            for i in range(self.slots)
        ]

    def axis_frequencies(self) -> list[tuple[list[Decimal], list[int]]]:
        """The rotary frequencies, split by axis."""
        inv_freq = _geometric(self.rope_theta, self.head_dim)
        axes = self.axis_of_frequency()
        out: list[tuple[list[Decimal], list[int]]] = []
        for axis in range(self.AXES):
            filled = [i for i, owner in enumerate(axes) if owner == axis]
            out.append(([inv_freq[i] for i in filled], filled))
        return out

    def check(self, check: Checker, limits: Limits) -> None:
        """theta, layout, head_dim, and sections that share out head_dim / 2."""
        self.check_rotary(check)
        if self.head_dim < 2 or self.head_dim % 2:
            check.add("head_dim", f"must be even and at least 2, got {self.head_dim}")
        elif len(self.mrope_section) != self.AXES or sum(self.mrope_section) != self.slots:
            check.add(
                "mrope_section",
                f"must be 3 counts (t, h, w) summing to head_dim / 2 = {self.slots}, got "
                + (
                    f"{list(self.mrope_section)} (sum {sum(self.mrope_section)})"
                    if len(self.mrope_section) <= 2 * self.AXES
                    else f"{len(self.mrope_section)} counts"
                ),
            )
        if not check.violations:
            self.check_width(check, limits, "head_dim")


# -- sin-cos grids -----------------------------------------------------------------------------


def _grid_columns(
    target: engine.Rows, rows: engine.ComplexRows, groups: Sequence[int], flip: bool
) -> None:
    """Consecutive 1D tables of ``groups[g]`` frequencies each, ``[sin | cos]`` (``[cos |
    sin]`` when ``flip``), from consecutive slots of ``rows``."""
    slot = column = 0
    for count in groups:
        sin, cos = rows.real[:, slot : slot + count], rows.imag[:, slot : slot + count]
        first, second = (cos, sin) if flip else (sin, cos)
        target[:, column : column + count] = first
        target[:, column + count : column + 2 * count] = second
        slot += count
        column += 2 * count


def _check_scale(check: Checker, limits: Limits, name: str, scale: Decimal, formula: str) -> None:
    """A position scale (the largest frequency it gives is ``scale``) within the contract."""
    highest = max_frequency(limits)
    if scale > Decimal(highest):
        check.add(
            name,
            f"makes the position scale {formula} = {float(scale):.6g}, over the largest the "
            f"server serves within its accuracy contract, {number(highest)}",
        )


def _check_cells(check: Checker, limits: Limits, axes: Sequence[tuple[str, int]]) -> bool:
    """Each axis has at least one cell, and the grid's rows are all valid positions."""
    valid = True
    for name, cells in axes:
        valid &= check.between(name, cells, 1, limits.max_abs_position + 1)
    if valid:
        total = 1
        for _, cells in axes:
            total *= cells
        if total - 1 > limits.max_abs_position:
            names = " * ".join(name for name, _ in axes)
            check.add(
                axes[0][0],
                f"the grid's {names} = {total} cells are over the position limit + 1 "
                f"({limits.max_abs_position + 1})",
            )
            valid = False
    return valid


def _grid_coordinates(positions: engine.Int64Array, shape: Sequence[int]) -> engine.Int64Array:
    """Row-major cells of flat indices (the first axis unbounded: rows past the grid
    continue it)."""
    flat = positions.reshape(-1)
    out = np.empty((flat.size, len(shape)), dtype=np.int64)
    rest = flat
    for axis in range(len(shape) - 1, 0, -1):
        rest, out[:, axis] = np.divmod(rest, shape[axis])
    out[:, 0] = rest
    return out


_SCALE = Doc("divides every position, finite and > 0", "1")


def _cells(axis: str) -> int:
    """The field of a grid's cell count on ``axis``."""
    return parameter(0, f"cells of the {axis} axis, >= 1")


@declared(
    "sincos_grid_2d",
    "2D sin-cos grid (diffusers get_2d_sincos_pos_embed, ViT-MAE): the width axis's 1D "
    "[sin | cos] table, then the height axis's",
)
class SinCosGrid2d(MultiAxis):
    """A 2D sin-cos grid (ViT-MAE, DiT, PixArt, SD3)."""

    AXES: ClassVar[int] = 2

    embed_dim: int = parameter(0, "columns of a row, a multiple of 4")
    grid_height: int = _cells("height")
    grid_width: int = _cells("width")
    base: float = parameter(10000.0, BASE)
    base_size: float | None = parameter(
        None,
        "index i of an axis of n cells is position i * base_size / n / interpolation_scale "
        "(diffusers)",
        "i / interpolation_scale",
    )
    interpolation_scale: float = parameter(1.0, _SCALE)
    height_first: bool = parameter(False, "the height axis's columns first", "false: width first")
    flip_sin_to_cos: bool = parameter(False, "each axis [cos | sin]", "false: [sin | cos]")

    @property
    def width(self) -> int:
        """``embed_dim`` columns."""
        return self.embed_dim

    @property
    def slots(self) -> int:
        """``embed_dim / 4`` frequencies per axis."""
        return 2 * (self.embed_dim // 4)

    def scale(self, cells: int) -> Decimal:
        """The position of index 1 on an axis of ``cells`` cells (in a 50-digit context)."""
        scale = 1 / Decimal(self.interpolation_scale)
        if self.base_size is not None:
            scale = scale * Decimal(self.base_size) / Decimal(cells)
        return scale

    def axis_frequencies(self) -> list[tuple[list[Decimal], list[int]]]:
        """(h, w): each axis's 1D frequencies times its position scale."""
        count = self.embed_dim // 4
        frequencies = _geometric(self.base, self.embed_dim // 2)
        first, second = list(range(count)), list(range(count, 2 * count))
        height_slots, width_slots = (first, second) if self.height_first else (second, first)
        return [
            (_scaled(frequencies, self.scale(self.grid_height)), height_slots),
            (_scaled(frequencies, self.scale(self.grid_width)), width_slots),
        ]

    def coordinates(self, positions: engine.Int64Array) -> engine.Int64Array:
        """Row r is the cell (r // grid_width, r mod grid_width)."""
        return _grid_coordinates(positions, (self.grid_height, self.grid_width))

    def write_columns(self, target: engine.Rows, rows: engine.ComplexRows) -> None:
        """Two 1D tables of ``embed_dim / 2`` columns."""
        _grid_columns(target, rows, (self.embed_dim // 4,) * 2, self.flip_sin_to_cos)

    def check(self, check: Checker, limits: Limits) -> None:
        """embed_dim, the grid, the base and the position scales."""
        if self.embed_dim < 4 or self.embed_dim % 4:
            check.add("embed_dim", f"must be a positive multiple of 4, got {self.embed_dim}")
        elif self.embed_dim > limits.max_d_model:
            check.add("embed_dim", f"is over the server's max_d_model {limits.max_d_model}")
        check.real("base", self.base, 1.0)
        scales = check.real("base_size", self.base_size, 0.0)
        scales &= check.real("interpolation_scale", self.interpolation_scale, 0.0)
        cells = (("grid_height", self.grid_height), ("grid_width", self.grid_width))
        if _check_cells(check, limits, cells) and scales:
            with localcontext() as context:
                context.prec = engine.PRECISION
                for name, count in cells:
                    formula = "1 / interpolation_scale"
                    if self.base_size is not None:
                        formula = f"base_size / {name} / interpolation_scale"
                    cause = "interpolation_scale" if self.base_size is None else "base_size"
                    _check_scale(check, limits, cause, self.scale(count), formula)


@declared(
    "sincos_grid_3d",
    "3D sin-cos grid (diffusers get_3d_sincos_pos_embed): the temporal axis's 1D "
    "[sin | cos] table, then the width axis's and the height axis's",
)
class SinCosGrid3d(MultiAxis):
    """A 3D sin-cos grid (video: CogVideoX, Latte)."""

    AXES: ClassVar[int] = 3

    embed_dim: int = parameter(0, "columns of a row: temporal_dim + a multiple of 4")
    grid_frames: int = _cells("temporal")
    grid_height: int = _cells("height")
    grid_width: int = _cells("width")
    base: float = parameter(10000.0, BASE)
    temporal_dim: int | None = parameter(
        None, "columns of the temporal table, even, >= 2", "embed_dim / 4"
    )
    spatial_interpolation_scale: float = parameter(1.0, _SCALE)
    temporal_interpolation_scale: float = parameter(1.0, _SCALE)

    @property
    def temporal(self) -> int:
        """Columns of the temporal table."""
        return self.embed_dim // 4 if self.temporal_dim is None else self.temporal_dim

    @property
    def width(self) -> int:
        """``embed_dim`` columns."""
        return self.embed_dim

    @property
    def slots(self) -> int:
        """Half the columns: a frequency per [sin, cos] pair."""
        return self.embed_dim // 2

    def axis_frequencies(self) -> list[tuple[list[Decimal], list[int]]]:
        """(t, h, w): the temporal table's frequencies, then the two spatial tables'."""
        temporal = self.temporal // 2
        spatial = (self.embed_dim - self.temporal) // 4
        spatial_frequencies = _scaled(
            _geometric(self.base, 2 * spatial), 1 / Decimal(self.spatial_interpolation_scale)
        )
        width_first = temporal
        return [
            (
                _scaled(
                    _geometric(self.base, self.temporal),
                    1 / Decimal(self.temporal_interpolation_scale),
                ),
                list(range(temporal)),
            ),
            (spatial_frequencies, list(range(width_first + spatial, width_first + 2 * spatial))),
            (spatial_frequencies, list(range(width_first, width_first + spatial))),
        ]

    def coordinates(self, positions: engine.Int64Array) -> engine.Int64Array:
        """Row r is the cell (t, h, w) of the row-major grid."""
        return _grid_coordinates(positions, (self.grid_frames, self.grid_height, self.grid_width))

    def write_columns(self, target: engine.Rows, rows: engine.ComplexRows) -> None:
        """Three 1D tables: temporal, width, height."""
        spatial = (self.embed_dim - self.temporal) // 4
        _grid_columns(target, rows, (self.temporal // 2, spatial, spatial), False)

    def check(self, check: Checker, limits: Limits) -> None:
        """The widths, the grid, the base and the scales."""
        temporal = self.temporal
        if self.temporal_dim is not None and (temporal < 2 or temporal % 2):
            check.add("temporal_dim", f"must be even and at least 2, got {temporal}")
        elif temporal < 2 or (self.embed_dim - temporal) < 4 or (self.embed_dim - temporal) % 4:
            check.add(
                "embed_dim",
                f"must be temporal_dim ({temporal}) + a positive multiple of 4, "
                f"got {self.embed_dim}",
            )
        elif self.embed_dim > limits.max_d_model:
            check.add("embed_dim", f"is over the server's max_d_model {limits.max_d_model}")
        check.real("base", self.base, 1.0)
        for name in ("spatial_interpolation_scale", "temporal_interpolation_scale"):
            value = getattr(self, name)
            if check.real(name, value, 0.0):
                with localcontext() as context:
                    context.prec = engine.PRECISION
                    _check_scale(check, limits, name, 1 / Decimal(value), f"1 / {name}")
        cells = (
            ("grid_frames", self.grid_frames),
            ("grid_height", self.grid_height),
            ("grid_width", self.grid_width),
        )
        _check_cells(check, limits, cells)
