"""Position interpolation: the default frequencies divided by a factor."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import ClassVar

from posenc_server.tables.base import Checker, Limits
from posenc_server.tables.scalings.base import (
    FACTOR,
    Frequencies,
    Scaling,
    check_factor,
)


@dataclass(frozen=True)
class Linear(Scaling):
    """Position interpolation."""

    NAME: ClassVar[str] = "linear"
    DESCRIPTION: ClassVar[str] = "default / factor (position interpolation)"
    PARAMETERS: ClassVar = {"factor": FACTOR}

    factor: float = 0.0

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """``inv_freq / factor``."""
        return Frequencies([f / Decimal(self.factor) for f in inv_freq])

    def check(self, check: Checker, limits: Limits) -> None:
        """factor in [min_factor, MAX_FACTOR]."""
        check_factor(check, limits, self.factor)
