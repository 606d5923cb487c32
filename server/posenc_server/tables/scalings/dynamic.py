"""Dynamic NTK: rope_theta scaled for a sequence beyond the context length."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import ClassVar

from posenc_server.tables.base import Checker, Doc, Limits
from posenc_server.tables.scalings.base import (
    FACTOR,
    Frequencies,
    Scaling,
    check_factor,
    check_lengths,
)


@dataclass(frozen=True)
class Dynamic(Scaling):
    """Dynamic NTK."""

    NAME: ClassVar[str] = "dynamic"
    DESCRIPTION: ClassVar[str] = (
        "NTK-aware: rope_theta scaled for seq_len beyond max_position_embeddings"
    )
    PARAMETERS: ClassVar = {
        "factor": FACTOR,
        "max_position_embeddings": Doc("the config's context length, >= 1"),
        "seq_len": Doc("the sequence length the frequencies are for", "max_position_embeddings"),
    }
    # It divides by rotary_dim - 2.
    MIN_ROTARY_DIM: ClassVar[int] = 4

    factor: float = 0.0
    max_position_embeddings: int = 0
    seq_len: int | None = None

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
