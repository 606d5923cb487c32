"""The N-axis rotary table of diffusion transformers (Flux, HunyuanVideo, Wan, CogVideoX's 3D
rotary, Lumina): each axis a rotary table of its own width, its frequencies taking their
angles from one coordinate of a row, the axes' cos/sin concatenated in axis order.

It is a several-axis kind like M-RoPE (``multiaxis.MultiAxis``): each axis's frequencies are
an ``engine.Waves`` of their own, so every axis keeps a one-axis table's accuracy up to the
position limit.
"""

from __future__ import annotations

from decimal import Decimal
from typing import ClassVar

from posenc_server.tables.base import BASE, Checker, Limits, declared, parameter
from posenc_server.tables.multiaxis import RotaryMultiAxis
from posenc_server.tables.rotary import Rotary


@declared(
    "rotary_axes",
    "N-axis rotary cos/sin (diffusers' get_1d_rotary_pos_embed per axis, concatenated: "
    "Flux, HunyuanVideo, Wan, CogVideoX, Lumina): axis a has the frequencies "
    "rope_theta ** (-2k / axes_dim[a]) at coordinate a",
)
class RotaryAxes(RotaryMultiAxis):
    """Rotary over three coordinate axes, each with its own width (``axes_dim``)."""

    AXES: ClassVar[int] = 3

    axes_dim: tuple[int, ...] = parameter(
        (), "the rotary width of each of the 3 axes, each even (0: left out)"
    )
    rope_theta: float = parameter(10000.0, BASE)
    layout: str = parameter(
        "gptj",
        "gptj (diffusers' interleaved pairs, 2 * sum(axes_dim) columns), transformers "
        "(2 * sum(axes_dim)) or vllm (sum(axes_dim))",
        "gptj",
    )

    @property
    def slots(self) -> int:
        """The frequencies of every axis: ``sum(axes_dim) / 2``."""
        return sum(self.axes_dim) // 2

    @property
    def width(self) -> int:
        """Columns of a row in this layout."""
        return self.slots * (2 if self.layout == "vllm" else 4)

    def axis_frequencies(self) -> list[tuple[list[Decimal], list[int]]]:
        """Each axis's rotary frequencies, filling consecutive slots in axis order."""
        out: list[tuple[list[Decimal], list[int]]] = []
        first = 0
        for dim in self.axes_dim:
            count = dim // 2
            frequencies = []
            if count:
                frequencies = (
                    Rotary(head_dim=dim, rope_theta=self.rope_theta).frequencies().inv_freq
                )
            out.append((frequencies, list(range(first, first + count))))
            first += count
        return out

    def check(self, check: Checker, limits: Limits) -> None:
        """Three even widths, not all zero, the row within max_d_model; theta; layout."""
        self.check_rotary(check)
        if len(self.axes_dim) != self.AXES:
            check.add("axes_dim", f"must be 3 widths, got {len(self.axes_dim)} values")
        elif any(dim % 2 for dim in self.axes_dim) or not any(self.axes_dim):
            check.add(
                "axes_dim",
                f"each width must be even and at least one positive, got {list(self.axes_dim)}",
            )
        else:
            self.check_width(check, limits, "axes_dim")
