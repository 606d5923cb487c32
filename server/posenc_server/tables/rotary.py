"""The rotary (RoPE) table kind: transformers' ``modeling_rope_utils`` in three layouts.

``inv_freq[i] = rope_theta ** (-2i / rotary_dim)``, then the scaling (a ``Scaling``, one
per case of ``RotaryTable.scaling``; none is transformers' "default" rope type). Every
quantity is the real number the formula defines, to 50 digits, including the discrete
choices (YaRN's truncated correction range, Llama 3's wavelength bands); the reference
computes the same formulas in float32.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import ClassVar

from posenc_server import engine, numerics
from posenc_server.errors import FieldViolation
from posenc_server.tables.base import (
    Checker,
    Doc,
    Documented,
    Limits,
    TableKind,
    max_frequency,
    number,
)

_MAX_COUNT = 1 << 62
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


_ORIGINAL = Doc("the pre-training context length, >= 1")
_FACTOR = Doc(
    "scaling factor, in [2**-10, 2**64] with the default position limit (docs: table kinds)"
)
_DERIVED_FACTOR = Doc(_FACTOR.description, "max_position_embeddings / original")
_CONFIG_LENGTH = Doc("the config's context length, only used to derive factor", "none")
# The parameters of a scaling whose factor may be derived from the two lengths (YaRN,
# LongRoPE: ``_check_derived_factor``).
_DERIVED_LENGTHS = {
    "factor": _DERIVED_FACTOR,
    "original_max_position_embeddings": _ORIGINAL,
    "max_position_embeddings": _CONFIG_LENGTH,
}


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


def _factor(factor: float | None, max_length: int | None, original: int) -> Decimal:
    """``factor``, else ``max_position_embeddings / original_max_position_embeddings``."""
    if factor is not None:
        return Decimal(factor)
    assert max_length is not None
    return Decimal(max_length) / Decimal(original)


def _check_factor(
    check: Checker, limits: Limits, value: float | None, name: str = "factor"
) -> bool:
    """A scaling factor (None: unset, valid) within [min_factor, MAX_FACTOR]."""
    return check.real(name, value, min_factor(limits), strict=False, high=MAX_FACTOR)


def _check_derived_factor(scaling: Yarn | LongRope, check: Checker, limits: Limits) -> bool:
    """factor, or the lengths it derives from; returns whether the factor is valid."""
    valid = True
    if scaling.factor is None and scaling.max_position_embeddings is None:
        check.add("factor", f"rope type {scaling.NAME} needs factor or max_position_embeddings")
        valid = False
    valid &= _check_factor(check, limits, scaling.factor)
    valid &= _check_lengths(
        scaling, check, "original_max_position_embeddings", "max_position_embeddings"
    )
    if valid and scaling.factor is None:
        derived = _factor(
            None, scaling.max_position_embeddings, scaling.original_max_position_embeddings
        )
        if derived < Decimal(min_factor(limits)):
            check.add(
                "max_position_embeddings",
                f"makes factor = max_position_embeddings / original_max_position_embeddings "
                f"= {float(derived):g}, under the smallest factor {number(min_factor(limits))}",
            )
            valid = False
    return valid


def _check_attention(
    check: Checker, scaling: Yarn | LongRope, attention: Decimal, cause: str
) -> None:
    """The attention factor (given or derived from ``cause``) within (0, MAX_ATTENTION]."""
    if scaling.attention_factor is not None or attention <= Decimal(MAX_ATTENTION):
        return  # a given attention_factor has its own range check
    check.add(
        cause,
        f"gives an attention factor of {float(attention):.6g}, over the largest the server "
        f"serves within its accuracy contract, {MAX_ATTENTION:g} (or set attention_factor)",
    )


def _cause_of_factor(scaling: Yarn | LongRope) -> str:
    """The field a derived quantity of the factor comes from."""
    return "factor" if scaling.factor is not None else "max_position_embeddings"


def _check_lengths(scaling: Scaling, check: Checker, *names: str) -> bool:
    """Each of the fields ``names`` (a length, or unset) is between 1 and 2**62."""
    valid = True
    for name in names:
        valid &= check.between(name, getattr(scaling, name), 1, _MAX_COUNT, "2**62")
    return valid


@dataclass(frozen=True)
class Linear(Scaling):
    """Position interpolation."""

    NAME: ClassVar[str] = "linear"
    DESCRIPTION: ClassVar[str] = "default / factor (position interpolation)"
    PARAMETERS: ClassVar = {"factor": _FACTOR}

    factor: float = 0.0

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """``inv_freq / factor``."""
        return Frequencies([f / Decimal(self.factor) for f in inv_freq])

    def check(self, check: Checker, limits: Limits) -> None:
        """factor in [min_factor, MAX_FACTOR]."""
        _check_factor(check, limits, self.factor)


@dataclass(frozen=True)
class Dynamic(Scaling):
    """Dynamic NTK."""

    NAME: ClassVar[str] = "dynamic"
    DESCRIPTION: ClassVar[str] = (
        "NTK-aware: rope_theta scaled for seq_len beyond max_position_embeddings"
    )
    PARAMETERS: ClassVar = {
        "factor": _FACTOR,
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
        _check_factor(check, limits, self.factor)
        _check_lengths(self, check, "max_position_embeddings", "seq_len")


def _mscale(scale: Decimal, weight: Decimal = Decimal(1)) -> Decimal:
    return Decimal(1) if scale <= 1 else Decimal("0.1") * weight * scale.ln() + 1


@dataclass(frozen=True)
class Yarn(Scaling):
    """YaRN."""

    NAME: ClassVar[str] = "yarn"
    DESCRIPTION: ClassVar[str] = (
        "YaRN: interpolation ramp between beta_fast and beta_slow, attention factor"
    )
    PARAMETERS: ClassVar = {
        **_DERIVED_LENGTHS,
        "beta_fast": Doc("YaRN beta_fast, > 0", "32"),
        "beta_slow": Doc("YaRN beta_slow, > 0", "1"),
        "mscale": Doc("YaRN mscale, >= 0", "none"),
        "mscale_all_dim": Doc("YaRN mscale_all_dim, >= 0", "none"),
        "truncate": Doc("floor and ceil the correction range", "true"),
        "attention_factor": Doc(
            "the scale of cos and sin, in (0, 2]", "0.1 ln(factor) + 1, or the mscale ratio"
        ),
    }

    factor: float | None = None
    original_max_position_embeddings: int = 0
    max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None

    def attention(self) -> Decimal:
        """The attention factor: given, the ratio of the mscales, or ``0.1 ln(factor) + 1``."""
        factor = _factor(
            self.factor, self.max_position_embeddings, self.original_max_position_embeddings
        )
        if self.attention_factor is not None:
            return Decimal(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _mscale(factor, Decimal(self.mscale)) / _mscale(
                factor, Decimal(self.mscale_all_dim)
            )
        return _mscale(factor)

    def scale(self, inv_freq: list[Decimal], log_theta: Decimal, rotary_dim: int) -> Frequencies:
        """Interpolated below the correction range, extrapolated above, a ramp between."""
        original_length = self.original_max_position_embeddings
        factor = _factor(self.factor, self.max_position_embeddings, original_length)
        attention = self.attention()
        # `or`: transformers treats 0 like unset.
        beta_fast = Decimal(self.beta_fast or 32)
        beta_slow = Decimal(self.beta_slow or 1)
        original = Decimal(self.original_max_position_embeddings)
        pi = numerics.TWO_PI / 2

        def correction_dim(rotations: Decimal) -> Decimal:
            return Decimal(rotary_dim) * (original / (rotations * 2 * pi)).ln() / (2 * log_theta)

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = Decimal(math.floor(low)), Decimal(math.ceil(high))
        low, high = max(low, Decimal(0)), min(high, Decimal(rotary_dim - 1))
        if low == high:
            high += Decimal("0.001")
        frequencies = []
        for i, extrapolation in enumerate(inv_freq):
            ramp = min(max((Decimal(i) - low) / (high - low), Decimal(0)), Decimal(1))
            # ramp = 1 - the extrapolation factor: interpolated (divided by factor) where 1.
            frequencies.append(extrapolation / factor * ramp + extrapolation * (1 - ramp))
        return Frequencies(frequencies, attention)

    def check(self, check: Checker, limits: Limits) -> None:
        """factor (or max_position_embeddings), lengths, betas, mscales, attention."""
        valid = _check_derived_factor(self, check, limits)
        for name in ("beta_fast", "beta_slow"):
            valid &= check.real(name, getattr(self, name), 0.0)
        valid &= check.real("attention_factor", self.attention_factor, 0.0, high=MAX_ATTENTION)
        for name in ("mscale", "mscale_all_dim"):
            valid &= check.real(name, getattr(self, name), 0.0, strict=False)
        if valid:
            with localcontext() as context:
                context.prec = engine.PRECISION
                both = self.mscale and self.mscale_all_dim
                cause = "mscale" if both else _cause_of_factor(self)
                _check_attention(check, self, self.attention(), cause)


@dataclass(frozen=True)
class LongRope(Scaling):
    """LongRoPE (Phi-3)."""

    NAME: ClassVar[str] = "longrope"
    DESCRIPTION: ClassVar[str] = (
        "LongRoPE (Phi-3): short or long factors by seq_len, attention factor"
    )
    PARAMETERS: ClassVar = {
        **_DERIVED_LENGTHS,
        "short_factor": Doc("rotary_dim / 2 factors, each in [2**-10, 2**64] (docs: table kinds)"),
        "long_factor": Doc("rotary_dim / 2 factors, each in [2**-10, 2**64] (docs: table kinds)"),
        "attention_factor": Doc(
            "the scale of cos and sin, in (0, 2]", "sqrt(1 + ln(factor) / ln(original))"
        ),
        "seq_len": Doc("long_factor when above original_max_position_embeddings", "short_factor"),
    }

    factor: float | None = None
    original_max_position_embeddings: int = 0
    max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    seq_len: int | None = None

    def attention(self) -> Decimal:
        """The attention factor: given, else ``sqrt(1 + ln(factor) / ln(original))`` (1 for
        a factor <= 1)."""
        original = self.original_max_position_embeddings
        factor = _factor(self.factor, self.max_position_embeddings, original)
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
        valid = _check_derived_factor(self, check, limits)
        valid &= check.real("attention_factor", self.attention_factor, 0.0, high=MAX_ATTENTION)
        _check_lengths(self, check, "seq_len")
        if not valid or self.attention_factor is not None:
            return
        with localcontext() as context:
            context.prec = engine.PRECISION
            factor = _factor(
                self.factor, self.max_position_embeddings, self.original_max_position_embeddings
            )
            if factor > 1 and self.original_max_position_embeddings == 1:
                # ln(original) = 0: transformers divides by zero too.
                check.add(
                    "original_max_position_embeddings",
                    "must be at least 2 to derive the attention factor of a factor > 1 "
                    "(or set attention_factor)",
                )
                return
            _check_attention(check, self, self.attention(), _cause_of_factor(self))

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


@dataclass(frozen=True)
class Llama3(Scaling):
    """Llama 3.1."""

    NAME: ClassVar[str] = "llama3"
    DESCRIPTION: ClassVar[str] = "Llama 3.1: low frequencies / factor, smooth band between"
    PARAMETERS: ClassVar = {
        "factor": _FACTOR,
        "original_max_position_embeddings": _ORIGINAL,
        "low_freq_factor": Doc("Llama 3 low_freq_factor, > 0"),
        "high_freq_factor": Doc("Llama 3 high_freq_factor, >= low_freq_factor"),
    }

    factor: float = 0.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0

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
        _check_factor(check, limits, self.factor)
        _check_lengths(self, check, "original_max_position_embeddings")
        low, high = self.low_freq_factor, self.high_freq_factor
        low_valid = check.real("low_freq_factor", low, 0.0)
        high_valid = check.real("high_freq_factor", high, 0.0)
        if low_valid and high_valid and not high >= low:
            check.add(
                "high_freq_factor", f"must be at least low_freq_factor ({low!r}), got {high!r}"
            )


@dataclass(frozen=True)
class GivenFrequencies(Scaling):
    """Explicit frequencies (a model's own ``inv_freq`` buffer, or a rope type computed by
    the caller)."""

    NAME: ClassVar[str] = "frequencies"
    DESCRIPTION: ClassVar[str] = (
        "explicit frequencies: inv_freq as given (rope_theta unused), exact angles of them"
    )
    PARAMETERS: ClassVar = {
        "inv_freq": Doc(
            "rotary_dim / 2 frequencies, each finite, |f| <= 1024 with the default position "
            "limit (docs: table kinds); 0 gives cos 1, sin 0"
        ),
        "attention_factor": Doc("the scale of cos and sin, in (0, 2]", "1"),
    }

    inv_freq: tuple[float, ...] = ()
    attention_factor: float | None = None

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


@dataclass(frozen=True)
class Proportional(Scaling):
    """Proportional RoPE (Gemma 4)."""

    NAME: ClassVar[str] = "proportional"
    DESCRIPTION: ClassVar[str] = (
        "proportional (Gemma 4): rotary_dim = head_dim, rope_theta ** (-2i / head_dim) over "
        "the partial_rotary_factor share, zero frequencies for the rest, all / factor"
    )
    PARAMETERS: ClassVar = {"factor": Doc(_FACTOR.description, "1")}

    factor: float | None = None

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
        _check_factor(check, limits, self.factor)


SCALINGS: dict[str, type[Scaling]] = {
    scaling.NAME: scaling
    for scaling in (Linear, Dynamic, Yarn, LongRope, Llama3, GivenFrequencies, Proportional)
}
"""The cases of ``RotaryTable.scaling`` by field name."""


def _transformers(target: engine.Rows, cos: engine.Float64Array, sin: engine.Float64Array) -> None:
    half = cos.shape[1]
    for index, values in enumerate((cos, cos, sin, sin)):
        target[:, index * half : (index + 1) * half] = values


def _vllm(target: engine.Rows, cos: engine.Float64Array, sin: engine.Float64Array) -> None:
    half = cos.shape[1]
    target[:, :half] = cos
    target[:, half:] = sin


def _gptj(target: engine.Rows, cos: engine.Float64Array, sin: engine.Float64Array) -> None:
    half = cos.shape[1]
    for index, values in enumerate((cos, sin)):
        part = target[:, index * 2 * half : (index + 1) * 2 * half]
        part[:, 0::2] = values
        part[:, 1::2] = values


LAYOUTS: dict[str, Callable[[engine.Rows, engine.Float64Array, engine.Float64Array], None]] = {
    "transformers": _transformers,
    "vllm": _vllm,
    "gptj": _gptj,
}
"""Column writers by ``posenc.v1.RopeLayout`` name."""


@dataclass(frozen=True)
class Rotary(TableKind):
    """A rotary cos/sin table."""

    NAME: ClassVar[str] = "rotary"
    DESCRIPTION: ClassVar[str] = (
        "transformers' rotary cos/sin: inv_freq[i] = rope_theta ** (-2i / rotary_dim), "
        "then the scaling (unset: the default rope type), times its attention factor"
    )
    PARAMETERS: ClassVar = {
        "head_dim": Doc("the attention head width, >= 2"),
        "rope_theta": Doc("frequency base, finite and > 1", "10000"),
        "partial_rotary_factor": Doc("rotary_dim = int(head_dim * it), in (0, 1]", "1"),
        "layout": Doc(
            "transformers (2 * rotary_dim columns), vllm (rotary_dim) or gptj (2 * rotary_dim)",
            "transformers",
        ),
    }
    VARIANTS: ClassVar = {"scaling": SCALINGS}

    head_dim: int = 0
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    layout: str = "transformers"
    scaling: Scaling | None = None

    @property
    def rotary_dim(self) -> int:
        """``int(head_dim * partial_rotary_factor)``, as transformers computes it (the
        scaling may say otherwise: proportional's is ``head_dim``)."""
        if self.scaling is not None:
            return self.scaling.rotary_dim(self.head_dim, self.partial_rotary_factor)
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def width(self) -> int:
        """Columns of a row in this layout."""
        return self.rotary_dim if self.layout == "vllm" else 2 * self.rotary_dim

    def waves(self) -> engine.Waves:
        """The scaled frequencies; the attention factor is the rows' amplitude."""
        scaled = self.frequencies()
        with localcontext() as context:
            context.prec = engine.PRECISION
            return engine.Waves([+f for f in scaled.inv_freq], float(scaled.attention))

    def frequencies(self) -> Frequencies:
        """The scaled frequencies and the attention factor, to ``engine.PRECISION`` digits
        (rounded when used in a context of that precision)."""
        dim = self.rotary_dim
        with localcontext() as context:
            context.prec = engine.PRECISION
            log_theta = Decimal(self.rope_theta).ln()
            if self.scaling is not None:
                log_theta = self.scaling.log_theta(log_theta, dim)
            # inv_freq[i] = ratio ** i: one product per frequency instead of one exp (which
            # would dominate a wide new spec's CPU); 16384 products lose under 1e-45.
            ratio = (-Decimal(2) / Decimal(dim) * log_theta).exp()
            inv_freq = [Decimal(1)]
            for _ in range(dim // 2 - 1):
                inv_freq.append(inv_freq[-1] * ratio)
            scaled = Frequencies(inv_freq)
            if self.scaling is not None:
                scaled = self.scaling.scale_table(
                    inv_freq, log_theta, self.head_dim, self.partial_rotary_factor
                )
            return scaled

    def write_columns(self, target: engine.Rows, rows: engine.ComplexRows) -> None:
        """cos and sin (``v = sin + i cos``) in the layout's order."""
        LAYOUTS[self.layout](target, rows.imag, rows.real)

    def validate(self, path: str, limits: Limits) -> list[FieldViolation]:
        """The fields, the scaling's, then rotary_dim and the width."""
        check = Checker(path)
        check.real("rope_theta", self.rope_theta, 1.0)
        if check.real("partial_rotary_factor", self.partial_rotary_factor, 0.0) and not (
            self.partial_rotary_factor <= 1.0
        ):
            check.add(
                "partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor!r}"
            )
        if self.head_dim < 2:
            check.add("head_dim", f"must be at least 2, got {self.head_dim}")
        check.one_of("layout", self.layout, LAYOUTS)
        scaling = None if self.scaling is None else check.nested(self.scaling.NAME)
        if self.scaling is not None and scaling is not None:
            self.scaling.check(scaling, limits)
        if check.violations:
            return check.violations
        dim = self.rotary_dim
        minimum = Scaling.MIN_ROTARY_DIM if self.scaling is None else self.scaling.MIN_ROTARY_DIM
        if dim < minimum or dim % 2:
            check.add(
                "head_dim",
                f"rotary_dim = int(head_dim * partial_rotary_factor) = {dim} must be even "
                f"and at least {minimum}",
            )
            return check.violations
        if self.scaling is not None and scaling is not None:
            self.scaling.check_rotary_dim(scaling, dim, limits)
        if self.width > limits.max_d_model:
            check.add(
                "head_dim",
                f"the row width {self.width} (layout {self.layout}, rotary_dim {dim}) is over "
                f"the server's max_d_model {limits.max_d_model}",
            )
        return check.violations
