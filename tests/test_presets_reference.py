"""The mpmath reference of the table kinds (reference_tables.py) against hand-computed values."""

from __future__ import annotations

import mpmath
from reference_tables import LLAMA3, Rope, Sin, rope_frequencies, sinusoidal_exact


def test_vaswani_reference_is_the_paper() -> None:
    preset = Sin("sinusoidal", 4)
    assert sinusoidal_exact(preset, 3, 0) == mpmath.sin(3)
    assert sinusoidal_exact(preset, 3, 3) == mpmath.cos(3 * mpmath.mpf(10000) ** -0.5)


def test_fairseq_reference_has_a_zero_padding_row_and_a_zero_last_column() -> None:
    preset = Sin("fairseq", 5, padding_idx=1)
    assert sinusoidal_exact(preset, 1, 0) == 0
    assert sinusoidal_exact(preset, 2, 4) == 0
    assert sinusoidal_exact(preset, 2, 2) == mpmath.cos(2)


def test_llama3_reference_bands() -> None:
    inv, attention = rope_frequencies(LLAMA3)
    assert attention == 1
    assert inv[0] == 1  # the highest frequency is kept
    assert abs(inv[-1] - mpmath.mpf(500000) ** (-mpmath.mpf(126) / 128) / 8) < mpmath.mpf(10) ** -45


def test_proportional_reference_rotates_a_share_of_the_head() -> None:
    # Gemma 4's full attention: 512 columns, a quarter rotated (64 frequencies), 192 zeros.
    rope = Rope(512, "proportional", 1e6, partial_rotary_factor=0.25, factor=2.0)
    inv, attention = rope_frequencies(rope)
    assert len(inv) == 256 and attention == 1
    assert inv[0] == mpmath.mpf("0.5")
    assert abs(inv[63] - mpmath.mpf(10) ** (-6 * mpmath.mpf(126) / 512) / 2) < mpmath.mpf(10) ** -45
    assert inv[64:] == [0] * 192
