"""The sinusoidal table kinds: the classic table and the conventions of model families.

Each is ``[sin, cos]`` columns over geometric frequencies, at positions that may be mapped
(an offset, a descending order, a clamp), with the odd details of each family (a zeroed
padding row, a zero last column). Frequencies are computed from their definition with 50
significant digits, not in the float32 of the reference code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import ClassVar

import numpy as np

from posenc_server import engine
from posenc_server.tables.base import (
    BASE,
    MAX_MAPPED_POSITION,
    Checker,
    Limits,
    TableKind,
    declared,
    max_frequency,
    number,
    parameter,
)

DEFAULT_BASE = 10000.0


def geometric_frequencies(base: float, d_model: int, schedule: str) -> list[Decimal]:
    """``inv_freq`` of the classic schedules, one per sin column.

    paper: ``base ** (-2i / d_model)`` for ``i < ceil(d_model / 2)``; tensor2tensor:
    ``base ** (-i / max(h - 1, 1))`` for ``i < h = d_model // 2``.
    """
    count = _sin_columns(d_model, schedule)
    with localcontext() as context:
        context.prec = engine.PRECISION
        if schedule == "paper":
            exponent_step = Decimal(2) / Decimal(d_model)
        else:
            exponent_step = Decimal(1) / Decimal(max(count - 1, 1))
        ratio = (-exponent_step * Decimal(base).ln()).exp()
        # inv_freq[i] = ratio ** i: one product per column instead of one exp per column.
        frequencies = [Decimal(1)]
        for _ in range(count - 1):
            frequencies.append(frequencies[-1] * ratio)
    return frequencies[:count]


def _sin_columns(d_model: int, schedule: str) -> int:
    # tensor2tensor's odd widths end with a zero column, the paper's with a sin.
    return d_model // 2 if schedule == "tensor2tensor" else (d_model + 1) // 2


def _interleaved(target: engine.Rows, rows: engine.ComplexRows, n_sin: int, n_cos: int) -> None:
    # One contiguous conversion: [sin, cos] pairs are v's memory as it is.
    target[:, : n_sin + n_cos] = rows.view(np.float64)[:, : n_sin + n_cos]


def _split(target: engine.Rows, rows: engine.ComplexRows, n_sin: int, n_cos: int) -> None:
    # [sin | cos]; columns past them (tensor2tensor's odd width) stay zero.
    target[:, :n_sin] = rows.real
    target[:, n_sin : n_sin + n_cos] = rows.imag[:, :n_cos]


LAYOUTS = {"interleaved": _interleaved, "split": _split}
"""Column writers by ``posenc.v1.Layout`` name."""
SCHEDULES = ("paper", "tensor2tensor")
"""``posenc.v1.Schedule`` names."""


@dataclass(frozen=True)
class WidthRule:
    """What a kind needs of ``d_model`` besides the server's range: said once, for its
    documentation and for its check."""

    even: bool = False
    minimum: int = 1

    @property
    def doc(self) -> str:
        """The documentation of ``d_model``."""
        needs = (["even"] if self.even else []) + (
            [f">= {self.minimum}"] if self.minimum > 1 else []
        )
        return "row width, " + (" and ".join(needs) or "1 .. the server's max_d_model")

    def problem(self, kind: str, d_model: int) -> str | None:
        """What is wrong with ``d_model`` (within the server's range) for ``kind``."""
        if (self.even and d_model % 2) or d_model < self.minimum:
            even = "an even " if self.even else ""
            minimum = f" >= {self.minimum}" if self.minimum > 1 else ""
            return f"{kind} needs {even}d_model{minimum}, got {d_model}"
        return None


@dataclass(frozen=True)
class _Sinusoid(TableKind):
    """What the sinusoidal kinds share: a width and a frequency base."""

    WIDTH: ClassVar[WidthRule] = WidthRule()

    d_model: int = parameter(0, WIDTH.doc)

    @property
    def width(self) -> int:
        """``d_model`` columns."""
        return self.d_model

    def write_columns(self, target: engine.Rows, rows: engine.ComplexRows) -> None:
        """``[sin | cos]`` of ``d_model // 2`` columns each, and a zero last column for odd
        ``d_model`` (the families' layout; the classic table has its own)."""
        _split(target, rows, self.d_model // 2, self.d_model // 2)

    def _check(self, check: Checker, limits: Limits, base_field: str, base: float) -> None:
        """Check ``d_model`` (in range, then the kind's ``WIDTH``) and the base."""
        in_range = check.between("d_model", self.d_model, 1, limits.max_d_model)
        if not (math.isfinite(base) and base > 1.0):
            check.add(base_field, f"must be finite and greater than 1, got {base!r}")
        if in_range and (problem := self.WIDTH.problem(self.NAME, self.d_model)):
            check.add("d_model", problem)


def _offset_limit(limits: Limits) -> int:
    # Offsets keep mapped positions where float64 is exact.
    return min(limits.max_abs_position, MAX_MAPPED_POSITION - limits.max_abs_position)


@declared(
    "sinusoidal",
    "Vaswani et al. 2017: sin and cos of position * base ** (-2i / d_model), "
    "interleaved or split, or tensor2tensor's schedule",
)
class Sinusoidal(_Sinusoid):
    """The classic table (Vaswani et al. 2017) in either column order and schedule."""

    base: float = parameter(DEFAULT_BASE, BASE)
    layout: str = parameter(
        "interleaved", "interleaved (sin_0, cos_0, ...) or split ([sin | cos])", "interleaved"
    )
    schedule: str = parameter(
        "paper",
        "paper (base ** (-2i / d_model)) or tensor2tensor (base ** (-i / (h - 1)))",
        "paper",
    )

    def waves(self) -> engine.Waves:
        """The schedule's frequencies."""
        return engine.Waves(geometric_frequencies(self.base, self.d_model, self.schedule))

    def write_columns(self, target: engine.Rows, rows: engine.ComplexRows) -> None:
        """The layout's columns: ``ceil(d / 2)`` sin (paper) or ``d // 2`` (tensor2tensor),
        ``d // 2`` cos."""
        n_sin = _sin_columns(self.d_model, self.schedule)
        LAYOUTS[self.layout](target, rows, n_sin, self.d_model // 2)

    def check(self, check: Checker, limits: Limits) -> None:
        """d_model, base, layout and schedule."""
        self._check(check, limits, "base", self.base)
        check.one_of("layout", self.layout, LAYOUTS)
        check.one_of("schedule", self.schedule, dict.fromkeys(SCHEDULES))


@declared(
    "tensor2tensor",
    "tensor2tensor get_timing_signal_1d: [sin | cos] over d_model // 2 timescales from "
    "min_timescale to max_timescale, zero last column for odd d_model; row p is "
    "position p + start_index",
)
class Tensor2Tensor(_Sinusoid):
    """tensor2tensor's ``get_timing_signal_1d``."""

    max_timescale: float = parameter(
        DEFAULT_BASE, "largest timescale, finite and > min_timescale", "10000"
    )
    min_timescale: float = parameter(
        1.0, "smallest timescale, > 0, < max_timescale and <= 1024 (docs: table kinds)", "1"
    )
    start_index: int = parameter(0, "added to every position", "0")

    def waves(self) -> engine.Waves:
        """``min * exp(-i * ln(max / min) / max(n - 1, 1))`` for ``i < n = d // 2``."""
        if self.min_timescale == 1.0:
            # The classic tensor2tensor schedule, computed as it computes it: the same
            # bytes as the sinusoidal table with that schedule.
            return engine.Waves(
                geometric_frequencies(self.max_timescale, self.d_model, "tensor2tensor")
            )
        count = self.d_model // 2
        with localcontext() as context:
            context.prec = engine.PRECISION
            low = Decimal(self.min_timescale)
            step = (Decimal(self.max_timescale) / low).ln() / Decimal(max(count - 1, 1))
            # One exp, then a product per frequency (an exp each would dominate a new wide
            # spec's CPU); 32768 products lose under 1e-45.
            ratio = (-step).exp()
            frequencies = [low]
            for _ in range(count - 1):
                frequencies.append(frequencies[-1] * ratio)
            return engine.Waves(frequencies[:count])

    @property
    def position_map(self) -> engine.PositionMap:
        """Shifted by ``start_index``."""
        return engine.PositionMap(offset=self.start_index)

    def check(self, check: Checker, limits: Limits) -> None:
        """d_model, the timescales and start_index."""
        self._check(check, limits, "max_timescale", self.max_timescale)
        low, high = self.min_timescale, self.max_timescale
        high_valid = math.isfinite(high) and high > 1.0
        if not (math.isfinite(low) and low > 0) or (high_valid and not low < high):
            check.add(
                "min_timescale", f"must be > 0 and below max_timescale ({high!r}), got {low!r}"
            )
        offset_limit = _offset_limit(limits)
        if check.between("start_index", self.start_index, -offset_limit, offset_limit):
            # Its frequencies go up to min_timescale (the others' up to 1).
            highest = max_frequency(limits, self.start_index)
            if math.isfinite(low) and low > highest:
                check.add(
                    "min_timescale",
                    f"must be at most {number(highest)} (2**52 / the largest shifted "
                    f"position), got {low!r}",
                )


@declared(
    "whisper",
    "Whisper encoder sinusoids(length, d_model, max_timescale): [sin | cos], even d_model >= 4",
)
class Whisper(_Sinusoid):
    """Whisper's encoder ``sinusoids(length, d_model, max_timescale)``."""

    WIDTH: ClassVar[WidthRule] = WidthRule(even=True, minimum=4)

    d_model: int = parameter(0, WIDTH.doc)
    max_timescale: float = parameter(DEFAULT_BASE, "largest timescale, finite and > 1", "10000")

    def waves(self) -> engine.Waves:
        """tensor2tensor's schedule."""
        return engine.Waves(
            geometric_frequencies(self.max_timescale, self.d_model, "tensor2tensor")
        )

    def check(self, check: Checker, limits: Limits) -> None:
        """An even d_model >= 4 and max_timescale."""
        self._check(check, limits, "max_timescale", self.max_timescale)


@declared(
    "fairseq",
    "fairseq SinusoidalPositionalEmbedding and its ports (M2M100, NLLB, Speech2Text): "
    "row p is weight row p, token t is row padding_idx + 1 + t, row padding_idx is zero",
)
class Fairseq(_Sinusoid):
    """fairseq's ``SinusoidalPositionalEmbedding`` weights, padding row included."""

    # fairseq divides by half_dim - 1.
    WIDTH: ClassVar[WidthRule] = WidthRule(minimum=4)

    d_model: int = parameter(0, WIDTH.doc)
    base: float = parameter(DEFAULT_BASE, BASE)
    padding_idx: int = parameter(1, "the zero row, >= 0", "1")

    def waves(self) -> engine.Waves:
        """tensor2tensor's schedule (fairseq's ``log(base) / (half_dim - 1)`` step)."""
        return engine.Waves(geometric_frequencies(self.base, self.d_model, "tensor2tensor"))

    @property
    def position_map(self) -> engine.PositionMap:
        """Row ``padding_idx`` is zero."""
        return engine.PositionMap(zero_row=self.padding_idx)

    def check(self, check: Checker, limits: Limits) -> None:
        """d_model >= 4, base and padding_idx."""
        self._check(check, limits, "base", self.base)
        check.between("padding_idx", self.padding_idx, 0, limits.max_abs_position)


@declared(
    "transformer_xl",
    "Transformer-XL relative positions: [sin | cos] of min(r, clamp_len), "
    "r = key_length - 1 - p when key_length is set, else p; even d_model",
)
class TransformerXl(_Sinusoid):
    """Transformer-XL's relative position embedding of ``pos_seq``."""

    # Its [sin | cos] of ceil(d / 2) frequencies each is d + 1 wide for odd d.
    WIDTH: ClassVar[WidthRule] = WidthRule(even=True)

    d_model: int = parameter(0, WIDTH.doc)
    base: float = parameter(DEFAULT_BASE, BASE)
    clamp_len: int = parameter(0, "relative positions above it are clamped to it; <= 0: none", "0")
    key_length: int | None = parameter(
        None, "klen: row p is relative position key_length - 1 - p", "none"
    )

    def waves(self) -> engine.Waves:
        """The paper's schedule."""
        return engine.Waves(geometric_frequencies(self.base, self.d_model, "paper"))

    @property
    def position_map(self) -> engine.PositionMap:
        """Descending from ``key_length - 1`` when set; clamped at ``clamp_len`` > 0."""
        clamp = self.clamp_len if self.clamp_len > 0 else None
        if self.key_length is None:
            return engine.PositionMap(clamp=clamp)
        return engine.PositionMap(offset=self.key_length - 1, descending=True, clamp=clamp)

    def check(self, check: Checker, limits: Limits) -> None:
        """An even d_model, base and key_length."""
        self._check(check, limits, "base", self.base)
        check.between("key_length", self.key_length, 0, _offset_limit(limits))
