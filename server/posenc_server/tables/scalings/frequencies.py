"""Explicit frequencies: the module's own inverse frequencies, as given."""

from __future__ import annotations

import math
from decimal import Decimal

from posenc_server.tables.base import (
    Checker,
    Limits,
    declared,
    max_frequency,
    number,
    parameter,
)
from posenc_server.tables.scalings.base import MAX_ATTENTION, Frequencies, Scaling


@declared(
    "frequencies",
    "explicit frequencies: inv_freq as given (rope_theta unused), exact angles of them",
)
class GivenFrequencies(Scaling):
    """Explicit frequencies (a model's own ``inv_freq`` buffer, or a rope type computed by
    the caller)."""

    inv_freq: tuple[float, ...] = parameter(
        (),
        "rotary_dim / 2 frequencies, each finite, |f| <= 1024 with the default position "
        "limit (docs: table kinds); 0 gives cos 1, sin 0",
    )
    attention_factor: float | None = parameter(None, "the scale of cos and sin, in (0, 2]", "1")

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """The given frequencies, exactly (a double is a dyadic rational: Decimal holds it
        to its last digit), and the attention factor."""
        attention = Decimal(1) if self.attention_factor is None else Decimal(self.attention_factor)
        return Frequencies([Decimal(f) for f in self.inv_freq], attention)

    def check(self, check: Checker, limits: Limits) -> None:
        """The attention factor in (0, MAX_ATTENTION]; every frequency finite and within
        ``max_frequency``, so that every angle stays within the engine's exact range."""
        check.real("attention_factor", self.attention_factor, 0.0, high=MAX_ATTENTION)
        highest = max_frequency(limits)
        bad = next(
            (
                i
                for i, f in enumerate(self.inv_freq)
                if not (math.isfinite(f) and abs(f) <= highest)
            ),
            None,
        )
        if bad is not None:
            check.add(
                "inv_freq",
                f"every frequency must be finite with magnitude at most {number(highest)} "
                f"(the largest whose angles stay exact at the server's position limit), got "
                f"{self.inv_freq[bad]!r} at index {bad}",
            )

    def check_rotary_dim(self, check: Checker, rotary_dim: int, limits: Limits) -> None:
        """rotary_dim / 2 frequencies."""
        if len(self.inv_freq) != rotary_dim // 2:
            check.add(
                "inv_freq",
                f"must hold rotary_dim / 2 = {rotary_dim // 2} frequencies, got "
                f"{len(self.inv_freq)}",
            )
