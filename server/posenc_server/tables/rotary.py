"""The rotary (RoPE) table kind: transformers' ``modeling_rope_utils`` in three layouts.

``inv_freq[i] = rope_theta ** (-2i / rotary_dim)``, then the scaling (a ``Scaling``, one
per case of ``RotaryTable.scaling``, each in a module of ``tables.scalings``; none is
transformers' "default" rope type). Every
quantity is the real number the formula defines, to 50 digits, including the discrete
choices (YaRN's truncated correction range, Llama 3's wavelength bands); the reference
computes the same formulas in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal, localcontext
from typing import ClassVar

from posenc_server import engine
from posenc_server.tables.base import BASE, Checker, Limits, TableKind, declared, parameter
from posenc_server.tables.scalings import SCALINGS, Frequencies, Scaling


def _transformers(target: engine.Rows, cos: engine.Float64Array, sin: engine.Float64Array) -> None:
    half = cos.shape[1]
    for index, values in enumerate((cos, cos, sin, sin)):
        target[:, index * half : (index + 1) * half] = values


def _vllm(target: engine.Rows, cos: engine.Float64Array, sin: engine.Float64Array) -> None:
    half = cos.shape[1]
    target[:, :half] = cos
    target[:, half:] = sin


def _gptj(target: engine.Rows, cos: engine.Float64Array, sin: engine.Float64Array) -> None:
    half = cos.shape[1]
    for index, values in enumerate((cos, sin)):
        part = target[:, index * 2 * half : (index + 1) * 2 * half]
        part[:, 0::2] = values
        part[:, 1::2] = values


LAYOUTS: dict[str, Callable[[engine.Rows, engine.Float64Array, engine.Float64Array], None]] = {
    "transformers": _transformers,
    "vllm": _vllm,
    "gptj": _gptj,
}
"""Column writers by ``posenc.v1.RopeLayout`` name."""


@declared(
    "rotary",
    "transformers' rotary cos/sin: inv_freq[i] = rope_theta ** (-2i / rotary_dim), "
    "then the scaling (unset: the default rope type), times its attention factor",
)
class Rotary(TableKind):
    """A rotary cos/sin table."""

    VARIANTS: ClassVar = {"scaling": SCALINGS}

    head_dim: int = parameter(0, "the attention head width, >= 2")
    rope_theta: float = parameter(10000.0, BASE)
    partial_rotary_factor: float = parameter(1.0, "rotary_dim = int(head_dim * it), in (0, 1]", "1")
    layout: str = parameter(
        "transformers",
        "transformers (2 * rotary_dim columns), vllm (rotary_dim) or gptj (2 * rotary_dim)",
        "transformers",
    )
    scaling: Scaling | None = None

    @property
    def rotary_dim(self) -> int:
        """``int(head_dim * partial_rotary_factor)``, as transformers computes it (the
        scaling may say otherwise: proportional's is ``head_dim``)."""
        if self.scaling is not None:
            return self.scaling.rotary_dim(self.head_dim, self.partial_rotary_factor)
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def width(self) -> int:
        """Columns of a row in this layout."""
        return self.rotary_dim if self.layout == "vllm" else 2 * self.rotary_dim

    def waves(self) -> engine.Waves:
        """The scaled frequencies; the attention factor is the rows' amplitude."""
        scaled = self.frequencies()
        with localcontext() as context:
            context.prec = engine.PRECISION
            return engine.Waves([+f for f in scaled.inv_freq], float(scaled.attention))

    def frequencies(self) -> Frequencies:
        """The scaled frequencies and the attention factor, to ``engine.PRECISION`` digits
        (rounded when used in a context of that precision)."""
        dim = self.rotary_dim
        with localcontext() as context:
            context.prec = engine.PRECISION
            log_theta = Decimal(self.rope_theta).ln()
            if self.scaling is not None:
                log_theta = self.scaling.log_theta(log_theta, dim)
            # inv_freq[i] = ratio ** i: one product per frequency instead of one exp (which
            # would dominate a wide new spec's CPU); 16384 products lose under 1e-45.
            ratio = (-Decimal(2) / Decimal(dim) * log_theta).exp()
            inv_freq = [Decimal(1)]
            for _ in range(dim // 2 - 1):
                inv_freq.append(inv_freq[-1] * ratio)
            scaled = Frequencies(inv_freq)
            if self.scaling is not None:
                scaled = self.scaling.scale_table(
                    inv_freq, log_theta, self.head_dim, self.partial_rotary_factor
                )
            return scaled

    def write_columns(self, target: engine.Rows, rows: engine.ComplexRows) -> None:
        """cos and sin (``v = sin + i cos``) in the layout's order."""
        LAYOUTS[self.layout](target, rows.imag, rows.real)

    def check(self, check: Checker, limits: Limits) -> None:
        """The fields, the scaling's, then rotary_dim and the width."""
        check.real("rope_theta", self.rope_theta, 1.0)
        if check.real("partial_rotary_factor", self.partial_rotary_factor, 0.0) and not (
            self.partial_rotary_factor <= 1.0
        ):
            check.add(
                "partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor!r}"
            )
        if self.head_dim < 2:
            check.add("head_dim", f"must be at least 2, got {self.head_dim}")
        check.one_of("layout", self.layout, LAYOUTS)
        scaling = None if self.scaling is None else check.nested(self.scaling.NAME)
        if self.scaling is not None and scaling is not None:
            self.scaling.check(scaling, limits)
        if check.violations:
            return
        dim = self.rotary_dim
        minimum = Scaling.MIN_ROTARY_DIM if self.scaling is None else self.scaling.MIN_ROTARY_DIM
        if dim < minimum or dim % 2:
            check.add(
                "head_dim",
                f"rotary_dim = int(head_dim * partial_rotary_factor) = {dim} must be even "
                f"and at least {minimum}",
            )
            return
        if self.scaling is not None and scaling is not None:
            self.scaling.check_rotary_dim(scaling, dim, limits)
        if self.width > limits.max_d_model:
            check.add(
                "head_dim",
                f"the row width {self.width} (layout {self.layout}, rotary_dim {dim}) is over "
                f"the server's max_d_model {limits.max_d_model}",
            )
