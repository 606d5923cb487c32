"""YaRN: an interpolation ramp between two wavelengths, and an attention factor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import ClassVar

from posenc_server import engine, numerics
from posenc_server.tables.base import Checker, Doc, Limits
from posenc_server.tables.scalings.base import (
    DERIVED_LENGTHS,
    MAX_ATTENTION,
    Frequencies,
    Scaling,
    cause_of_factor,
    check_attention,
    check_derived_factor,
    derived_factor,
)


def _mscale(scale: Decimal, weight: Decimal = Decimal(1)) -> Decimal:
    return Decimal(1) if scale <= 1 else Decimal("0.1") * weight * scale.ln() + 1


@dataclass(frozen=True)
class Yarn(Scaling):
    """YaRN."""

    NAME: ClassVar[str] = "yarn"
    DESCRIPTION: ClassVar[str] = (
        "YaRN: interpolation ramp between beta_fast and beta_slow, attention factor"
    )
    PARAMETERS: ClassVar = {
        **DERIVED_LENGTHS,
        "beta_fast": Doc("YaRN beta_fast, > 0", "32"),
        "beta_slow": Doc("YaRN beta_slow, > 0", "1"),
        "mscale": Doc("YaRN mscale, >= 0", "none"),
        "mscale_all_dim": Doc("YaRN mscale_all_dim, >= 0", "none"),
        "truncate": Doc("floor and ceil the correction range", "true"),
        "attention_factor": Doc(
            "the scale of cos and sin, in (0, 2]", "0.1 ln(factor) + 1, or the mscale ratio"
        ),
    }

    factor: float | None = None
    original_max_position_embeddings: int = 0
    max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None

    def attention(self) -> Decimal:
        """The attention factor: given, the ratio of the mscales, or ``0.1 ln(factor) + 1``."""
        factor = derived_factor(
            self.factor, self.max_position_embeddings, self.original_max_position_embeddings
        )
        if self.attention_factor is not None:
            return Decimal(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _mscale(factor, Decimal(self.mscale)) / _mscale(
                factor, Decimal(self.mscale_all_dim)
            )
        return _mscale(factor)

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """Interpolated below the correction range, extrapolated above, a ramp between."""
        original_length = self.original_max_position_embeddings
        factor = derived_factor(self.factor, self.max_position_embeddings, original_length)
        attention = self.attention()
        # `or`: transformers treats 0 like unset.
        beta_fast = Decimal(self.beta_fast or 32)
        beta_slow = Decimal(self.beta_slow or 1)
        original = Decimal(self.original_max_position_embeddings)
        pi = numerics.TWO_PI / 2

        def correction_dim(rotations: Decimal) -> Decimal:
            return Decimal(rotary_dim) * (original / (rotations * 2 * pi)).ln() / (2 * log_theta)

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = Decimal(math.floor(low)), Decimal(math.ceil(high))
        low, high = max(low, Decimal(0)), min(high, Decimal(rotary_dim - 1))
        if low == high:
            high += Decimal("0.001")
        frequencies = []
        for i, extrapolation in enumerate(inv_freq):
            ramp = min(max((Decimal(i) - low) / (high - low), Decimal(0)), Decimal(1))
            # ramp = 1 - the extrapolation factor: interpolated (divided by factor) where 1.
            frequencies.append(extrapolation / factor * ramp + extrapolation * (1 - ramp))
        return Frequencies(frequencies, attention)

    def check(self, check: Checker, limits: Limits) -> None:
        """factor (or max_position_embeddings), lengths, betas, mscales, attention."""
        valid = check_derived_factor(self, check, limits)
        for name in ("beta_fast", "beta_slow"):
            valid &= check.real(name, getattr(self, name), 0.0)
        valid &= check.real("attention_factor", self.attention_factor, 0.0, high=MAX_ATTENTION)
        for name in ("mscale", "mscale_all_dim"):
            valid &= check.real(name, getattr(self, name), 0.0, strict=False)
        if valid:
            with localcontext() as context:
                context.prec = engine.PRECISION
                both = self.mscale and self.mscale_all_dim
                cause = "mscale" if both else cause_of_factor(self)
                check_attention(check, self, self.attention(), cause)
