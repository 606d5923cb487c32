"""Proportional: the default frequencies of a share of the rotary width."""

from __future__ import annotations

from decimal import Decimal

from posenc_server.tables.base import Checker, Limits, declared, parameter
from posenc_server.tables.scalings.base import FACTOR, Frequencies, Scaling, check_factor


@declared(
    "proportional",
    "proportional (Gemma 4): rotary_dim = head_dim, rope_theta ** (-2i / head_dim) over "
    "the partial_rotary_factor share, zero frequencies for the rest, all / factor",
)
class Proportional(Scaling):
    """Proportional RoPE (Gemma 4)."""

    factor: float | None = parameter(None, FACTOR, "1")

    def rotary_dim(self, head_dim: int, partial_rotary_factor: float) -> int:
        """Every column of the head: the unrotated ones get zero frequencies."""
        return head_dim

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """Every frequency / factor (the table as if wholly rotated)."""
        factor = Decimal(1 if self.factor is None else self.factor)
        return Frequencies([f / factor for f in inv_freq])

    def scale_table(
        self, inv_freq: list[Decimal], log_theta: Decimal, head_dim: int, partial: float
    ) -> Frequencies:
        """The first ``int(partial * head_dim // 2)`` frequencies (transformers' float
        arithmetic, which the count is defined by) / factor, zeros after them."""
        rotated = int(partial * head_dim // 2)
        scaled = self.scale(inv_freq[:rotated], log_theta, head_dim)
        return Frequencies(scaled.inv_freq + [Decimal(0)] * (len(inv_freq) - rotated))

    def check(self, check: Checker, limits: Limits) -> None:
        """factor in [min_factor, MAX_FACTOR]."""
        check_factor(check, limits, self.factor)
