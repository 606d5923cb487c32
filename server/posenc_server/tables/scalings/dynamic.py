"""Dynamic NTK: rope_theta scaled for a sequence beyond the context length."""

from __future__ import annotations

from decimal import Decimal
from typing import ClassVar

from posenc_server.tables.base import Checker, Limits, declared, parameter
from posenc_server.tables.scalings.base import (
    FACTOR,
    Frequencies,
    Scaling,
    check_factor,
    check_lengths,
)


@declared("dynamic", "NTK-aware: rope_theta scaled for seq_len beyond max_position_embeddings")
class Dynamic(Scaling):
    """Dynamic NTK."""

    # It divides by rotary_dim - 2.
    MIN_ROTARY_DIM: ClassVar[int] = 4

    factor: float = parameter(0.0, FACTOR)
    max_position_embeddings: int = parameter(0, "the config's context length, >= 1")
    seq_len: int | None = parameter(
        None, "the sequence length the frequencies are for", "max_position_embeddings"
    )

    def log_theta(self, log_theta: Decimal, rotary_dim: int) -> Decimal:
        """``rope_theta * stretch ** (dim / (dim - 2))`` for the sequence length."""
        factor = Decimal(self.factor)
        original = Decimal(self.max_position_embeddings)
        length = Decimal(max(self.seq_len or 0, self.max_position_embeddings))
        stretch = factor * length / original - (factor - 1)
        return log_theta + Decimal(rotary_dim) / Decimal(rotary_dim - 2) * stretch.ln()

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """The default frequencies of the scaled theta."""
        return Frequencies(inv_freq)

    def check(self, check: Checker, limits: Limits) -> None:
        """factor in [min_factor, MAX_FACTOR], lengths >= 1."""
        check_factor(check, limits, self.factor)
        check_lengths(self, check, "max_position_embeddings", "seq_len")
