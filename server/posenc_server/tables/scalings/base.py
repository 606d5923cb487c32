"""What every rotary scaling is: a ``Scaling`` (how it changes the default frequencies, and the
checks of its fields), and the limits and checks several scalings share."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from decimal import Decimal
from typing import ClassVar

from posenc_server.tables.base import (
    Checker,
    Doc,
    Documented,
    Limits,
    max_frequency,
    number,
    parameter,
)

MAX_COUNT = 1 << 62
MAX_FACTOR = 2.0**64
"""Largest scaling factor: dynamic NTK's ``factor * length / original - (factor - 1)`` then
keeps 30 of its 50 digits, and no quotient leaves float64's range."""
MAX_ATTENTION = 2.0
"""Largest attention factor (the scale of cos and sin): float64 rows stay within the
contract's 2**-50 up to it, with room to spare (tests/test_table_ranges.py checks sampled
elements at 2.0)."""


def min_factor(limits: Limits) -> float:
    """Smallest factor a frequency may be divided by: the scaled frequencies stay within
    ``max_frequency`` (the unscaled ones are at most 1): 2**-10 with the default limits."""
    return 1.0 / max_frequency(limits)


ORIGINAL = Doc("the pre-training context length, >= 1")
FACTOR = Doc(
    "scaling factor, in [2**-10, 2**64] with the default position limit (docs: table kinds)"
)


@dataclass(frozen=True)
class Frequencies:
    """What a scaling makes of the default frequencies."""

    inv_freq: list[Decimal]
    attention: Decimal = Decimal(1)
    """The scale of cos and sin."""


class Scaling(Documented):
    """A rope type: how it changes the default frequencies, and the checks of its fields."""

    MIN_ROTARY_DIM: ClassVar[int] = 2

    def log_theta(self, log_theta: Decimal, rotary_dim: int) -> Decimal:
        """``ln(rope_theta)`` as the scaling sees it (dynamic NTK changes it)."""
        return log_theta

    @abc.abstractmethod
    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """The scaled frequencies of the default ``inv_freq`` (in a 50-digit context)."""

    @abc.abstractmethod
    def check(self, check: Checker, limits: Limits) -> None:
        """Check the fields on their own, and what they derive (the attention factor)."""

    def check_rotary_dim(self, check: Checker, rotary_dim: int, limits: Limits) -> None:
        """Check the fields that depend on ``rotary_dim`` (once the others are valid)."""

    def rotary_dim(self, head_dim: int, partial_rotary_factor: float) -> int:
        """The table's rotary_dim: ``int(head_dim * partial_rotary_factor)``, as transformers
        computes it, unless the rope type says otherwise."""
        return int(head_dim * partial_rotary_factor)

    def scale_table(
        self, inv_freq: list[Decimal], log_theta: Decimal, head_dim: int, partial: float
    ) -> Frequencies:
        """The scaled frequencies of a table of this ``head_dim`` and partial factor."""
        return self.scale(inv_freq, log_theta, self.rotary_dim(head_dim, partial))


@dataclass(frozen=True)
class DerivedFactor(Scaling):
    """A scaling whose factor may be derived from the two context lengths (YaRN, LongRoPE),
    and that derives an attention factor from it."""

    factor: float | None = parameter(None, FACTOR, "max_position_embeddings / original")
    original_max_position_embeddings: int = parameter(0, ORIGINAL)
    max_position_embeddings: int | None = parameter(
        None, "the config's context length, only used to derive factor", "none"
    )

    def derived_factor(self) -> Decimal:
        """``factor``, else ``max_position_embeddings / original_max_position_embeddings``."""
        if self.factor is not None:
            return Decimal(self.factor)
        assert self.max_position_embeddings is not None
        return Decimal(self.max_position_embeddings) / Decimal(
            self.original_max_position_embeddings
        )

    def check_derived_factor(self, check: Checker, limits: Limits) -> bool:
        """factor, or the lengths it derives from; returns whether the factor is valid."""
        valid = True
        if self.factor is None and self.max_position_embeddings is None:
            check.add("factor", f"rope type {self.NAME} needs factor or max_position_embeddings")
            valid = False
        valid &= check_factor(check, limits, self.factor)
        valid &= check_lengths(
            self, check, "original_max_position_embeddings", "max_position_embeddings"
        )
        if valid and self.factor is None:
            derived = self.derived_factor()
            if derived < Decimal(min_factor(limits)):
                check.add(
                    "max_position_embeddings",
                    f"makes factor = max_position_embeddings / original_max_position_embeddings "
                    f"= {float(derived):g}, under the smallest factor "
                    f"{number(min_factor(limits))}",
                )
                valid = False
        return valid

    def check_attention(
        self, check: Checker, given: float | None, attention: Decimal, cause: str = ""
    ) -> None:
        """The attention factor (``given``, or derived from ``cause``: by default the field
        the factor comes from) within (0, MAX_ATTENTION]."""
        if given is not None or attention <= Decimal(MAX_ATTENTION):
            return  # a given attention_factor has its own range check
        check.add(
            cause or ("factor" if self.factor is not None else "max_position_embeddings"),
            f"gives an attention factor of {float(attention):.6g}, over the largest the server "
            f"serves within its accuracy contract, {MAX_ATTENTION:g} (or set attention_factor)",
        )


def check_factor(check: Checker, limits: Limits, value: float | None, name: str = "factor") -> bool:
    """A scaling factor (None: unset, valid) within [min_factor, MAX_FACTOR]."""
    return check.real(name, value, min_factor(limits), strict=False, high=MAX_FACTOR)


def check_lengths(scaling: object, check: Checker, *names: str) -> bool:
    """Each of the fields ``names`` (a length, or unset) is between 1 and 2**62."""
    valid = True
    for name in names:
        valid &= check.between(name, getattr(scaling, name), 1, MAX_COUNT, "2**62")
    return valid
