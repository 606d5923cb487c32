"""What the engine and its compiled kernels share: 2pi, and how a row is stored.

A module of its own so that the kernels (``kernel``, compiled when first imported) and the
engine that imports them late depend on it, not on each other.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Final

TWO_PI: Final = Decimal("6.28318530717958647692528676655900576839433879875021164194989")
"""2pi to 60 significant digits; the engine tests check it against mpmath."""

# How the kernels store a row's float64 values (their ``stored`` argument): cast to out's
# float32 or float64, or rounded to bfloat16 or float16, whose bits out holds as uint16.
STORE_VALUES: Final = 0
STORE_BFLOAT16: Final = 1
STORE_FLOAT16: Final = 2
