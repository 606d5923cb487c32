"""Position interpolation: the default frequencies divided by a factor."""

from __future__ import annotations

from decimal import Decimal

from posenc_server.tables.base import Checker, Limits, declared, parameter
from posenc_server.tables.scalings.base import FACTOR, Frequencies, Scaling, check_factor


@declared("linear", "default / factor (position interpolation)")
class Linear(Scaling):
    """Position interpolation."""

    factor: float = parameter(0.0, FACTOR)

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """``inv_freq / factor``."""
        return Frequencies([f / Decimal(self.factor) for f in inv_freq])

    def check(self, check: Checker, limits: Limits) -> None:
        """factor in [min_factor, MAX_FACTOR]."""
        check_factor(check, limits, self.factor)
