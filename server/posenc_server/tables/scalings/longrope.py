"""LongRoPE (Phi-3): per-frequency short or long factors, and an attention factor."""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal, localcontext

from posenc_server import engine
from posenc_server.tables.base import Checker, Limits, declared, number, parameter
from posenc_server.tables.scalings.base import (
    MAX_ATTENTION,
    MAX_FACTOR,
    DerivedFactor,
    Frequencies,
    check_lengths,
    min_factor,
)

_FACTORS = "rotary_dim / 2 factors, each in [2**-10, 2**64] (docs: table kinds)"


@declared("longrope", "LongRoPE (Phi-3): short or long factors by seq_len, attention factor")
class LongRope(DerivedFactor):
    """LongRoPE (Phi-3)."""

    short_factor: tuple[float, ...] = parameter((), _FACTORS)
    long_factor: tuple[float, ...] = parameter((), _FACTORS)
    attention_factor: float | None = parameter(
        None, "the scale of cos and sin, in (0, 2]", "sqrt(1 + ln(factor) / ln(original))"
    )
    seq_len: int | None = parameter(
        None, "long_factor when above original_max_position_embeddings", "short_factor"
    )

    def attention(self) -> Decimal:
        """The attention factor: given, else ``sqrt(1 + ln(factor) / ln(original))`` (1 for
        a factor <= 1)."""
        original = self.original_max_position_embeddings
        factor = self.derived_factor()
        if self.attention_factor is not None:
            return Decimal(self.attention_factor)
        if factor <= 1:
            return Decimal(1)
        return (1 + factor.ln() / Decimal(original).ln()).sqrt()

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """Each frequency divided by its short or long factor."""
        long = self.seq_len is not None and self.seq_len > self.original_max_position_embeddings
        factors = self.long_factor if long else self.short_factor
        return Frequencies(
            [f / Decimal(s) for f, s in zip(inv_freq, factors, strict=True)], self.attention()
        )

    def check(self, check: Checker, limits: Limits) -> None:
        """factor (or max_position_embeddings), lengths, attention."""
        valid = self.check_derived_factor(check, limits)
        valid &= check.real("attention_factor", self.attention_factor, 0.0, high=MAX_ATTENTION)
        check_lengths(self, check, "seq_len")
        if not valid or self.attention_factor is not None:
            return
        with localcontext() as context:
            context.prec = engine.PRECISION
            if self.derived_factor() > 1 and self.original_max_position_embeddings == 1:
                # ln(original) = 0: transformers divides by zero too.
                check.add(
                    "original_max_position_embeddings",
                    "must be at least 2 to derive the attention factor of a factor > 1 "
                    "(or set attention_factor)",
                )
                return
            self.check_attention(check, self.attention_factor, self.attention())

    def check_rotary_dim(self, check: Checker, rotary_dim: int, limits: Limits) -> None:
        """rotary_dim / 2 factors each, each within [min_factor, MAX_FACTOR]."""
        low = min_factor(limits)
        for name in ("short_factor", "long_factor"):
            values: Sequence[float] = getattr(self, name)
            if len(values) != rotary_dim // 2:
                check.add(
                    name, f"must hold rotary_dim / 2 = {rotary_dim // 2} values, got {len(values)}"
                )
                continue
            bad = next(
                (
                    i
                    for i, v in enumerate(values)
                    if not (math.isfinite(v) and low <= v <= MAX_FACTOR)
                ),
                None,
            )
            if bad is not None:
                check.add(
                    name,
                    f"every factor must be finite and within [{number(low)}, "
                    f"{number(MAX_FACTOR)}], got {values[bad]!r} at index {bad}",
                )
