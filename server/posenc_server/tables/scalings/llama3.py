"""Llama 3: the frequencies scaled by wavelength band."""

from __future__ import annotations

from decimal import Decimal

from posenc_server import numerics
from posenc_server.tables.base import Checker, Limits, declared, parameter
from posenc_server.tables.scalings.base import (
    FACTOR,
    ORIGINAL,
    Frequencies,
    Scaling,
    check_factor,
    check_lengths,
)


@declared("llama3", "Llama 3.1: low frequencies / factor, smooth band between")
class Llama3(Scaling):
    """Llama 3.1."""

    factor: float = parameter(0.0, FACTOR)
    original_max_position_embeddings: int = parameter(0, ORIGINAL)
    low_freq_factor: float = parameter(0.0, "Llama 3 low_freq_factor, > 0")
    high_freq_factor: float = parameter(0.0, "Llama 3 high_freq_factor, >= low_freq_factor")

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """Long wavelengths / factor, short ones kept, a smooth band between (none when the
        band factors are equal, as Llama 4 Scout's are)."""
        factor = Decimal(self.factor)
        original = Decimal(self.original_max_position_embeddings)
        low_factor, high_factor = Decimal(self.low_freq_factor), Decimal(self.high_freq_factor)
        low_wavelength, high_wavelength = original / low_factor, original / high_factor
        pi = numerics.TWO_PI / 2
        frequencies = []
        for frequency in inv_freq:
            wavelength = 2 * pi / frequency
            if wavelength > low_wavelength:
                frequencies.append(frequency / factor)
            elif wavelength < high_wavelength or high_factor == low_factor:
                frequencies.append(frequency)
            else:
                smooth = (original / wavelength - low_factor) / (high_factor - low_factor)
                frequencies.append((1 - smooth) * frequency / factor + smooth * frequency)
        return Frequencies(frequencies)

    def check(self, check: Checker, limits: Limits) -> None:
        """factor in [min_factor, MAX_FACTOR], positive band factors, high >= low."""
        check_factor(check, limits, self.factor)
        check_lengths(self, check, "original_max_position_embeddings")
        low, high = self.low_freq_factor, self.high_freq_factor
        low_valid = check.real("low_freq_factor", low, 0.0)
        high_valid = check.real("high_freq_factor", high, 0.0)
        if low_valid and high_valid and not high >= low:
            check.add(
                "high_freq_factor", f"must be at least low_freq_factor ({low!r}), got {high!r}"
            )
