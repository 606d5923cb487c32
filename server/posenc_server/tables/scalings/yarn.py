"""YaRN: an interpolation ramp between two wavelengths, and an attention factor."""

from __future__ import annotations

import math
from decimal import Decimal, localcontext

from posenc_server import engine, numerics
from posenc_server.tables.base import Checker, Limits, declared, parameter
from posenc_server.tables.scalings.base import MAX_ATTENTION, DerivedFactor, Frequencies


def _mscale(scale: Decimal, weight: Decimal = Decimal(1)) -> Decimal:
    return Decimal(1) if scale <= 1 else Decimal("0.1") * weight * scale.ln() + 1


@declared("yarn", "YaRN: interpolation ramp between beta_fast and beta_slow, attention factor")
class Yarn(DerivedFactor):
    """YaRN."""

    beta_fast: float | None = parameter(None, "YaRN beta_fast, > 0", "32")
    beta_slow: float | None = parameter(None, "YaRN beta_slow, > 0", "1")
    mscale: float | None = parameter(None, "YaRN mscale, >= 0", "none")
    mscale_all_dim: float | None = parameter(None, "YaRN mscale_all_dim, >= 0", "none")
    truncate: bool = parameter(True, "floor and ceil the correction range", "true")
    attention_factor: float | None = parameter(
        None, "the scale of cos and sin, in (0, 2]", "0.1 ln(factor) + 1, or the mscale ratio"
    )

    def attention(self) -> Decimal:
        """The attention factor: given, the ratio of the mscales, or ``0.1 ln(factor) + 1``."""
        factor = self.derived_factor()
        if self.attention_factor is not None:
            return Decimal(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _mscale(factor, Decimal(self.mscale)) / _mscale(
                factor, Decimal(self.mscale_all_dim)
            )
        return _mscale(factor)

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """Interpolated below the correction range, extrapolated above, a ramp between."""
        factor = self.derived_factor()
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
        valid = self.check_derived_factor(check, limits)
        for name in ("beta_fast", "beta_slow"):
            valid &= check.real(name, getattr(self, name), 0.0)
        valid &= check.real("attention_factor", self.attention_factor, 0.0, high=MAX_ATTENTION)
        for name in ("mscale", "mscale_all_dim"):
            valid &= check.real(name, getattr(self, name), 0.0, strict=False)
        if valid:
            with localcontext() as context:
                context.prec = engine.PRECISION
                cause = "mscale" if self.mscale and self.mscale_all_dim else ""
                self.check_attention(check, self.attention_factor, self.attention(), cause)
