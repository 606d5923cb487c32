"""Model-exact presets: the tables real model families use, computed with the engine's precision.

Sinusoidal presets (``vaswani`` ... ``transformer_xl``) are the engine's tables at mapped
positions (an offset, a descending order, a clamp) with the odd details of each family (a
zeroed padding row, a zero last column); ``tensor2tensor`` with a ``min_timescale`` has
frequencies of its own. Rotary presets are the cos/sin tables of transformers'
``modeling_rope_utils`` rope types in three layouts.

Every frequency is computed from its definition with 50 significant digits (``decimal``),
not in the float32 of the reference code, and rows come from the engine's ``Waves`` and
block rotation (``engine.wave_rows``), so the accuracy contract holds at any
accepted position. Each row remains a function of (spec, position) alone: the table objects
below are frozen dataclasses holding every parameter, and the service's cache key (the
``EncodingSpec`` that carries them) therefore covers every parameter.

This module knows no protobuf: the servicer maps a request's preset message to a
``SinusoidalRequest`` or ``RotaryRequest``, and ``catalog()`` to GetServerInfo's list.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from posenc_server import engine
from posenc_server.engine import EncodingSpec, Layout, Schedule
from posenc_server.errors import FieldViolation
from posenc_server.service import validate_spec

Float64Array = npt.NDArray[np.float64]
Int64Array = npt.NDArray[np.int64]
Table = npt.NDArray[np.generic]

# Positions after a preset's offset stay where float64 holds them exactly.
_MAX_MAPPED_POSITION: Final = 1 << 52


# ------------------------------------------------------------------------------------------
# Sinusoidal presets
# ------------------------------------------------------------------------------------------

# Parameters each sinusoidal preset takes (besides d_model, base and dtype).
_SINUSOIDAL_PARAMETERS: Final[dict[str, tuple[str, ...]]] = {
    "vaswani": (),
    "vaswani_split": (),
    "tensor2tensor": ("min_timescale", "start_index"),
    "whisper": (),
    "fairseq": ("padding_idx",),
    "transformer_xl": ("clamp_len", "key_length"),
}


@dataclass(frozen=True)
class SinusoidalRequest:
    """A request's sinusoidal preset: its name and the parameters it set (None: unset)."""

    name: str
    min_timescale: float | None = None
    start_index: int | None = None
    padding_idx: int | None = None
    clamp_len: int | None = None
    key_length: int | None = None


@dataclass(frozen=True)
class MappedSinusoid:
    """A sinusoidal preset's table: rows of a ``[sin | cos]``-style table at mapped positions.

    Row ``p`` is the base table's row at ``m(p) = offset - p`` (``descending``) or
    ``p + offset``, clamped to at most ``clamp_max``; the base table is the engine's
    ``inner`` spec, or the ``[sin | cos]`` of tensor2tensor ``timescales`` (with a
    ``min_timescale``). Row ``zero_row`` (fairseq's padding row) is all zeros.
    """

    inner: EncodingSpec | None
    timescales: tuple[int, float, float] | None = None
    """tensor2tensor's ``(d_model, min_timescale, max_timescale)`` when ``inner`` is None."""
    offset: int = 0
    descending: bool = False
    clamp_max: int | None = None
    zero_row: int | None = None

    def _mapped(self, positions: Int64Array) -> Int64Array:
        mapped = self.offset - positions if self.descending else positions + self.offset
        if self.clamp_max is not None:
            mapped = np.minimum(mapped, self.clamp_max)
        return mapped

    def encode_positions(self, spec: EncodingSpec, positions: Int64Array) -> Table:
        """The rows of ``positions`` (see ``engine.encode_positions``)."""
        mapped = self._mapped(positions)
        if self.inner is not None:
            out = engine.encode_positions(self.inner, mapped)
        else:
            out = np.zeros((mapped.size, spec.d_model), dtype=spec.numpy_dtype)
            _write_split(out, engine.wave_rows(self._waves(), mapped))
        if self.zero_row is not None:
            out[positions == self.zero_row] = 0
        return out

    def encode_range(self, spec: EncodingSpec, start: int, stop: int) -> Table:
        """The rows of ``start .. stop - 1`` (see ``engine.encode_range``)."""
        if self.descending or self.clamp_max is not None:
            return self.encode_positions(spec, np.arange(start, stop, dtype=np.int64))
        first, last = start + self.offset, stop + self.offset
        if self.inner is not None:
            out = engine.encode_range(self.inner, first, last)
        else:
            # Block by block, as engine.encode_range: no whole complex table at once.
            out = np.zeros((stop - start, spec.d_model), dtype=spec.numpy_dtype)
            for offset, rows in engine.wave_blocks(self._waves(), first, last):
                _write_split(out[offset : offset + len(rows)], rows)
        if self.zero_row is not None and start <= self.zero_row < stop:
            out[self.zero_row - start] = 0
        return out

    def _waves(self) -> engine.Waves:
        assert self.timescales is not None
        return _t2t_waves(*self.timescales)


def _write_split(target: Table, waves: npt.NDArray[np.complex128]) -> None:
    """``[sin | cos]`` into ``target`` (its columns past them stay as they are: zero)."""
    count = waves.shape[1]
    target[:, :count] = waves.real  # v = sin + i cos
    target[:, count : 2 * count] = waves.imag


@functools.lru_cache(maxsize=16)
def _t2t_waves(d_model: int, min_timescale: float, max_timescale: float) -> engine.Waves:
    return engine.Waves(_t2t_frequencies(d_model, min_timescale, max_timescale))


def _t2t_frequencies(
    d_model: int, min_timescale: float, max_timescale: float
) -> tuple[Decimal, ...]:
    """tensor2tensor: ``min * exp(-i * ln(max / min) / max(n - 1, 1))``, ``n = d // 2``."""
    count = d_model // 2
    with localcontext() as context:
        context.prec = engine.PRECISION
        low = Decimal(min_timescale)
        step = (Decimal(max_timescale) / low).ln() / Decimal(max(count - 1, 1))
        return tuple(low * (-step * i).exp() for i in range(count))


@dataclass
class _Checker:
    """Collects field violations of one preset."""

    prefix: str
    violations: list[FieldViolation]

    def add(self, field: str, description: str) -> None:
        self.violations.append(FieldViolation(f"{self.prefix}.{field}", description))


def sinusoidal_spec(
    request: SinusoidalRequest,
    d_model: int,
    base: float,
    dtype: str,
    limits: Any,
    violations: list[FieldViolation],
) -> EncodingSpec | None:
    """The spec of a sinusoidal preset, or None after appending its problems to violations.

    ``limits`` is the server config (``max_d_model``, ``max_abs_position``).
    """
    check = _Checker("spec.sinusoidal", violations)
    before = len(violations)
    name = request.name
    taken = _SINUSOIDAL_PARAMETERS[name]
    for field in ("min_timescale", "start_index", "padding_idx", "clamp_len", "key_length"):
        if getattr(request, field) is not None and field not in taken:
            check.add(field, f"is not a parameter of preset {name}; leave it unset")
    validate_spec(d_model, base, limits.max_d_model, violations)
    if name == "whisper" and (d_model % 2 or d_model < 4):
        rule = f"whisper needs an even d_model >= 4, got {d_model}"
    elif name == "fairseq" and d_model < 4:
        rule = f"fairseq needs d_model >= 4, got {d_model}"  # it divides by half_dim - 1
    elif name == "transformer_xl" and d_model % 2:
        # Its [sin | cos] of ceil(d / 2) frequencies each is d + 1 wide for odd d.
        rule = f"transformer_xl needs an even d_model, got {d_model}"
    else:
        rule = ""
    if rule and 1 <= d_model <= limits.max_d_model:  # else validate_spec reported it
        violations.append(FieldViolation("spec.d_model", rule))
    # Only parameters the request set are checked (the defaults are valid by construction).
    min_timescale = 1.0 if request.min_timescale is None else request.min_timescale
    if request.min_timescale is not None and not (
        math.isfinite(min_timescale) and 0 < min_timescale < base
    ):
        check.add("min_timescale", f"must be > 0 and below base ({base!r}), got {min_timescale!r}")
    # Offsets keep mapped positions where float64 is exact; padding_idx is a row.
    offset_limit = min(limits.max_abs_position, _MAX_MAPPED_POSITION - limits.max_abs_position)
    for field, low, high in (
        ("start_index", -offset_limit, offset_limit),
        ("padding_idx", 0, limits.max_abs_position),
        ("key_length", 0, offset_limit),
    ):
        value = getattr(request, field)
        if value is not None and not low <= value <= high:
            check.add(field, f"must be between {low} and {high}, got {value}")
    if len(violations) > before:
        return None

    split = EncodingSpec(d_model, base, dtype, Layout.SPLIT, Schedule.PAPER)
    if name == "vaswani":
        return EncodingSpec(d_model, base, dtype)
    if name == "vaswani_split":
        return split
    t2t = EncodingSpec(d_model, base, dtype, Layout.SPLIT, Schedule.TENSOR2TENSOR)
    if name == "whisper":
        return t2t
    if name == "tensor2tensor":
        start = request.start_index or 0
        if min_timescale == 1.0 and start == 0:
            return t2t
        if min_timescale == 1.0:
            table = MappedSinusoid(inner=t2t, offset=start)
        else:
            timescales = (d_model, min_timescale, base)
            table = MappedSinusoid(inner=None, timescales=timescales, offset=start)
        return EncodingSpec(d_model, base, dtype, preset=table)
    if name == "fairseq":
        padding = 1 if request.padding_idx is None else request.padding_idx
        return EncodingSpec(d_model, base, dtype, preset=MappedSinusoid(t2t, zero_row=padding))
    # transformer_xl
    clamp = request.clamp_len if request.clamp_len is not None and request.clamp_len > 0 else None
    if request.key_length is not None:
        table = MappedSinusoid(
            split, offset=request.key_length - 1, descending=True, clamp_max=clamp
        )
    else:
        table = MappedSinusoid(split, clamp_max=clamp)
    if table.clamp_max is None and not table.descending:
        return split
    return EncodingSpec(d_model, base, dtype, preset=table)


# ------------------------------------------------------------------------------------------
# Rotary presets
# ------------------------------------------------------------------------------------------

# Optional and required fields of each rope type, beyond rope_type, layout, head_dim,
# rope_theta and partial_rotary_factor.
_ROPE_FIELDS: Final[dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor", "max_position_embeddings"), ("seq_len",)),
    "yarn": (
        ("original_max_position_embeddings",),
        (
            "factor",
            "max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
            "attention_factor",
        ),
    ),
    "longrope": (
        ("original_max_position_embeddings", "short_factor", "long_factor"),
        ("factor", "max_position_embeddings", "attention_factor", "seq_len"),
    ),
    "llama3": (
        ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
        (),
    ),
}
_SCALAR_ROPE_FIELDS: Final = (
    "factor",
    "original_max_position_embeddings",
    "max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "attention_factor",
    "seq_len",
)
# The rotary parameters that are single values (and may be unset).
ROTARY_PARAMETERS: Final = ("rope_theta", "partial_rotary_factor", *_SCALAR_ROPE_FIELDS)


@dataclass(frozen=True)
class RotaryTable:
    """A rotary cos/sin table; every field of the request is here (the cache key)."""

    rope_type: str
    layout: str
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    seq_len: int | None = None

    @property
    def rotary_dim(self) -> int:
        """``int(head_dim * partial_rotary_factor)``, as transformers computes it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def width(self) -> int:
        """Columns of a row in this layout."""
        return self.rotary_dim if self.layout == "vllm" else 2 * self.rotary_dim

    def encode_positions(self, spec: EncodingSpec, positions: Int64Array) -> Table:
        """The rows of ``positions``: cos and sin times the attention factor, in the layout."""
        out = np.empty((positions.size, spec.d_model), dtype=spec.numpy_dtype)
        self._write(out, engine.wave_rows(_rope_waves(self), positions))
        return out

    def encode_range(self, spec: EncodingSpec, start: int, stop: int) -> Table:
        """The rows of ``start .. stop - 1``, block by block as ``engine.encode_range``."""
        out = np.empty((max(stop - start, 0), spec.d_model), dtype=spec.numpy_dtype)
        for offset, rows in engine.wave_blocks(_rope_waves(self), start, stop):
            self._write(out[offset : offset + len(rows)], rows)
        return out

    def _write(self, target: Table, waves: npt.NDArray[np.complex128]) -> None:
        """Rows of ``waves`` into ``target`` in the table's layout (scales ``waves``)."""
        _, attention = _rope(self)
        if attention != 1.0:
            waves *= attention
        sin, cos = waves.real, waves.imag  # v = sin + i cos
        half = waves.shape[1]
        if self.layout == "vllm":
            target[:, :half] = cos
            target[:, half:] = sin
        elif self.layout == "transformers":
            for index, values in enumerate((cos, cos, sin, sin)):
                target[:, index * half : (index + 1) * half] = values
        else:  # gptj
            for index, values in enumerate((cos, sin)):
                part = target[:, index * 2 * half : (index + 1) * 2 * half]
                part[:, 0::2] = values
                part[:, 1::2] = values


@functools.lru_cache(maxsize=16)
def _rope_waves(table: RotaryTable) -> engine.Waves:
    return engine.Waves(_rope(table)[0])


@functools.lru_cache(maxsize=64)
def _rope(table: RotaryTable) -> tuple[tuple[Decimal, ...], float]:
    """inv_freq of ``modeling_rope_utils`` for the table's rope type, as exact real numbers.

    The reference computes the same formulas in float32 (exponents, ramps, factors); here
    every quantity is the real number the formula defines, to 50 digits, including the
    discrete choices (YaRN's truncated correction range, Llama 3's wavelength bands).
    """
    dim = table.rotary_dim
    with localcontext() as context:
        context.prec = engine.PRECISION
        pi = engine._TWO_PI / 2
        theta = Decimal(table.rope_theta)
        log_theta = theta.ln()
        kind = table.rope_type
        if kind == "dynamic":
            assert table.factor is not None and table.max_position_embeddings is not None
            factor = Decimal(table.factor)
            original = Decimal(table.max_position_embeddings)
            length = Decimal(max(table.seq_len or 0, table.max_position_embeddings))
            stretch = factor * length / original - (factor - 1)
            log_theta += Decimal(dim) / Decimal(dim - 2) * stretch.ln()
        base = [(-Decimal(2 * i) / Decimal(dim) * log_theta).exp() for i in range(dim // 2)]
        attention = Decimal(1)
        if kind in ("default", "dynamic"):
            frequencies = base
        elif kind == "linear":
            assert table.factor is not None
            frequencies = [f / Decimal(table.factor) for f in base]
        elif kind == "yarn":
            frequencies, attention = _yarn(table, base, log_theta, pi)
        elif kind == "longrope":
            frequencies, attention = _longrope(table, base)
        else:
            frequencies = _llama3(table, base, pi)
        return tuple(+f for f in frequencies), float(attention)


def _scaling_factor(table: RotaryTable) -> Decimal:
    """``factor``, else ``max_position_embeddings / original_max_position_embeddings``."""
    if table.factor is not None:
        return Decimal(table.factor)
    assert table.max_position_embeddings and table.original_max_position_embeddings
    return Decimal(table.max_position_embeddings) / Decimal(table.original_max_position_embeddings)


def _yarn(
    table: RotaryTable, base: list[Decimal], log_theta: Decimal, pi: Decimal
) -> tuple[list[Decimal], Decimal]:
    dim = table.rotary_dim
    factor = _scaling_factor(table)

    def mscale(scale: Decimal, weight: Decimal = Decimal(1)) -> Decimal:
        return Decimal(1) if scale <= 1 else Decimal("0.1") * weight * scale.ln() + 1

    if table.attention_factor is not None:
        attention = Decimal(table.attention_factor)
    elif table.mscale and table.mscale_all_dim:
        attention = mscale(factor, Decimal(table.mscale)) / mscale(
            factor, Decimal(table.mscale_all_dim)
        )
    else:
        attention = mscale(factor)
    # `or`: transformers treats 0 like unset.
    beta_fast = Decimal(table.beta_fast or 32)
    beta_slow = Decimal(table.beta_slow or 1)
    assert table.original_max_position_embeddings is not None
    original = Decimal(table.original_max_position_embeddings)

    def correction_dim(rotations: Decimal) -> Decimal:
        return Decimal(dim) * (original / (rotations * 2 * pi)).ln() / (2 * log_theta)

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if table.truncate:
        low, high = Decimal(math.floor(low)), Decimal(math.ceil(high))
    low, high = max(low, Decimal(0)), min(high, Decimal(dim - 1))
    if low == high:
        high += Decimal("0.001")
    frequencies = []
    for i, extrapolation in enumerate(base):
        ramp = min(max((Decimal(i) - low) / (high - low), Decimal(0)), Decimal(1))
        # ramp = 1 - the extrapolation factor: interpolated (divided by factor) where 1.
        frequencies.append(extrapolation / factor * ramp + extrapolation * (1 - ramp))
    return frequencies, attention


def _longrope(table: RotaryTable, base: list[Decimal]) -> tuple[list[Decimal], Decimal]:
    factor = _scaling_factor(table)
    assert table.original_max_position_embeddings is not None
    original = table.original_max_position_embeddings
    if table.attention_factor is not None:
        attention = Decimal(table.attention_factor)
    elif factor <= 1:
        attention = Decimal(1)
    else:
        attention = (1 + factor.ln() / Decimal(original).ln()).sqrt()
    long = table.seq_len is not None and table.seq_len > original
    factors = table.long_factor if long else table.short_factor
    return [f / Decimal(s) for f, s in zip(base, factors, strict=True)], attention


def _llama3(table: RotaryTable, base: list[Decimal], pi: Decimal) -> list[Decimal]:
    assert table.factor is not None and table.original_max_position_embeddings is not None
    assert table.low_freq_factor is not None and table.high_freq_factor is not None
    factor = Decimal(table.factor)
    original = Decimal(table.original_max_position_embeddings)
    low_factor, high_factor = Decimal(table.low_freq_factor), Decimal(table.high_freq_factor)
    low_wavelength, high_wavelength = original / low_factor, original / high_factor
    frequencies = []
    for frequency in base:
        wavelength = 2 * pi / frequency
        if wavelength > low_wavelength:
            frequencies.append(frequency / factor)
        elif wavelength < high_wavelength:
            frequencies.append(frequency)
        else:
            smooth = (original / wavelength - low_factor) / (high_factor - low_factor)
            frequencies.append((1 - smooth) * frequency / factor + smooth * frequency)
    return frequencies


@dataclass(frozen=True)
class RotaryRequest:
    """A request's rotary preset: rope type, layout, head width, and the parameters it set
    (``ROTARY_PARAMETERS``, ``short_factor``, ``long_factor``) by name."""

    rope_type: str
    layout: str
    head_dim: int
    parameters: Mapping[str, Any]


def rotary_spec(
    request: RotaryRequest,
    d_model: int,
    has_base: bool,
    dtype: str,
    limits: Any,
    violations: list[FieldViolation],
) -> EncodingSpec | None:
    """The spec of a rotary preset, or None after appending its problems to violations."""
    check = _Checker("spec.rotary", violations)
    before = len(violations)
    if has_base:
        violations.append(
            FieldViolation("spec.base", "must be unset with a rotary preset: set rotary.rope_theta")
        )
    kind, layout = request.rope_type, request.layout
    required, optional = _ROPE_FIELDS[kind]
    for field in (*_SCALAR_ROPE_FIELDS, "short_factor", "long_factor"):
        present = field in request.parameters
        if field in required and not present:
            check.add(field, f"is required by rope type {kind}")
        elif present and field not in required and field not in optional:
            check.add(field, f"is not a parameter of rope type {kind}; leave it unset")
    if (
        kind in ("yarn", "longrope")
        and "factor" not in request.parameters
        and "max_position_embeddings" not in request.parameters
    ):
        check.add("factor", f"rope type {kind} needs factor or max_position_embeddings")

    def real(field: str, default: float | None, low: float, *, strict: bool = True) -> float | None:
        value: float | None = request.parameters.get(field)
        if value is None:
            return default
        if not math.isfinite(value) or value < low or (strict and value == low):
            relation = ">" if strict else ">="
            check.add(field, f"must be finite and {relation} {low:g}, got {value!r}")
        return value

    def count(field: str, low: int) -> int | None:
        value: int | None = request.parameters.get(field)
        if value is None:
            return None
        if not low <= value <= 1 << 62:
            check.add(field, f"must be between {low} and 2**62, got {value}")
        return value

    theta = real("rope_theta", 10000.0, 1.0)
    partial = real("partial_rotary_factor", 1.0, 0.0)
    if partial is not None and partial > 1.0:
        check.add("partial_rotary_factor", f"must be in (0, 1], got {partial!r}")
    head_dim = request.head_dim
    if head_dim < 2:
        check.add("head_dim", f"must be at least 2, got {head_dim}")
    table_fields: dict[str, Any] = {
        "factor": real("factor", None, 0.0),
        "original_max_position_embeddings": count("original_max_position_embeddings", 1),
        "max_position_embeddings": count("max_position_embeddings", 1),
        "low_freq_factor": real("low_freq_factor", None, 0.0),
        "high_freq_factor": real("high_freq_factor", None, 0.0),
        "beta_fast": real("beta_fast", None, 0.0),
        "beta_slow": real("beta_slow", None, 0.0),
        "mscale": real("mscale", None, 0.0, strict=False),
        "mscale_all_dim": real("mscale_all_dim", None, 0.0, strict=False),
        "truncate": request.parameters.get("truncate", True),
        "attention_factor": real("attention_factor", None, 0.0),
        "seq_len": count("seq_len", 1),
    }
    low, high = table_fields["low_freq_factor"], table_fields["high_freq_factor"]
    if low is not None and high is not None and not high > low:
        check.add(
            "high_freq_factor", f"must be greater than low_freq_factor ({low!r}), got {high!r}"
        )
    if len(violations) > before:
        return None
    assert theta is not None and partial is not None
    rotary_dim = int(head_dim * partial)
    minimum = 4 if kind == "dynamic" else 2  # dynamic divides by rotary_dim - 2
    if rotary_dim < minimum or rotary_dim % 2:
        check.add(
            "head_dim",
            f"rotary_dim = int(head_dim * partial_rotary_factor) = {rotary_dim} must be even "
            f"and at least {minimum}",
        )
        return None
    for field in ("short_factor", "long_factor"):
        values: tuple[float, ...] = tuple(request.parameters.get(field, ()))
        if values and len(values) != rotary_dim // 2:
            check.add(
                field, f"must hold rotary_dim / 2 = {rotary_dim // 2} values, got {len(values)}"
            )
        elif not all(math.isfinite(v) and v > 0 for v in values):
            check.add(field, "every factor must be finite and > 0")
        table_fields[field] = values
    table = RotaryTable(
        rope_type=kind,
        layout=layout,
        head_dim=head_dim,
        rope_theta=theta,
        partial_rotary_factor=partial,
        **table_fields,
    )
    width = table.width
    if d_model == 0:
        d_model = width
    if d_model != width:
        violations.append(
            FieldViolation(
                "spec.d_model",
                f"must be 0 or the preset's row width {width} (layout {layout}, rotary_dim "
                f"{rotary_dim}), got {d_model}",
            )
        )
    elif width > limits.max_d_model:
        violations.append(
            FieldViolation(
                "spec.d_model",
                f"the preset's row width {width} is over the server's max_d_model "
                f"{limits.max_d_model}",
            )
        )
    if len(violations) > before:
        return None
    return EncodingSpec(d_model, theta, dtype, preset=table)


# ------------------------------------------------------------------------------------------
# Catalog (what GetServerInfo lists)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PresetParameter:
    """A parameter of a preset: its request field, meaning and default (empty: required)."""

    field: str
    description: str
    default: str = ""


@dataclass(frozen=True)
class PresetInfo:
    """A preset's name, what it is, and its parameters."""

    name: str
    description: str
    parameters: tuple[PresetParameter, ...]


_D_MODEL = "spec.d_model"
_BASE = "spec.base"
_SIN_DESCRIPTIONS: Final[dict[str, tuple[str, list[PresetParameter]]]] = {
    "vaswani": (
        "Vaswani et al. 2017: sin_0, cos_0, sin_1, cos_1, ...",
        [PresetParameter(_D_MODEL, "row width"), PresetParameter(_BASE, "frequency base", "10000")],
    ),
    "vaswani_split": (
        "Marian, Pegasus: the paper's frequencies, sin in the first ceil(d/2) columns",
        [PresetParameter(_D_MODEL, "row width"), PresetParameter(_BASE, "frequency base", "10000")],
    ),
    "tensor2tensor": (
        "tensor2tensor get_timing_signal_1d: [sin | cos] over d // 2 timescales, zero last "
        "column for odd d; row p is position p + start_index",
        [
            PresetParameter(_D_MODEL, "row width"),
            PresetParameter(_BASE, "max_timescale", "10000"),
            PresetParameter("spec.sinusoidal.min_timescale", "min_timescale, > 0 and < base", "1"),
            PresetParameter("spec.sinusoidal.start_index", "added to every position", "0"),
        ],
    ),
    "whisper": (
        "Whisper encoder sinusoids(length, d, max_timescale): [sin | cos], even d >= 4",
        [PresetParameter(_D_MODEL, "row width"), PresetParameter(_BASE, "max_timescale", "10000")],
    ),
    "fairseq": (
        "fairseq SinusoidalPositionalEmbedding and its ports (M2M100, Speech2Text): row p is "
        "weight row p, token t is row padding_idx + 1 + t, row padding_idx is zero",
        [
            PresetParameter(_D_MODEL, "row width, >= 4"),
            PresetParameter(_BASE, "frequency base", "10000"),
            PresetParameter("spec.sinusoidal.padding_idx", "the zero row", "1"),
        ],
    ),
    "transformer_xl": (
        "Transformer-XL relative positions: [sin | cos] of min(r, clamp_len), "
        "r = key_length - 1 - p when key_length is set, else p",
        [
            PresetParameter(_D_MODEL, "row width, even"),
            PresetParameter(_BASE, "frequency base", "10000"),
            PresetParameter("spec.sinusoidal.clamp_len", "clamp (<= 0: none)", "none"),
            PresetParameter(
                "spec.sinusoidal.key_length", "klen: rows descend from klen - 1", "none"
            ),
        ],
    ),
}

_ROPE_DESCRIPTIONS: Final[dict[str, str]] = {
    "default": "inv_freq[i] = rope_theta ** (-2i / rotary_dim)",
    "linear": "default / factor (position interpolation)",
    "dynamic": "NTK-aware: rope_theta scaled for seq_len beyond max_position_embeddings",
    "yarn": "YaRN: interpolation ramp between beta_fast and beta_slow, attention factor",
    "longrope": "LongRoPE (Phi-3): short or long factors by seq_len, attention factor",
    "llama3": "Llama 3.1: low frequencies / factor, smooth band between",
}
_ROPE_PARAMETER_DESCRIPTIONS: Final[dict[str, tuple[str, str]]] = {
    "factor": ("scaling factor", ""),
    "original_max_position_embeddings": ("pre-training context length", ""),
    "max_position_embeddings": ("context length of the config", ""),
    "low_freq_factor": ("Llama 3 low_freq_factor", ""),
    "high_freq_factor": ("Llama 3 high_freq_factor", ""),
    "beta_fast": ("YaRN beta_fast", "32"),
    "beta_slow": ("YaRN beta_slow", "1"),
    "mscale": ("YaRN mscale", "none"),
    "mscale_all_dim": ("YaRN mscale_all_dim", "none"),
    "truncate": ("YaRN: floor/ceil the correction range", "true"),
    "attention_factor": ("scale of cos and sin", "the rope type's"),
    "short_factor": ("rotary_dim / 2 factors", ""),
    "long_factor": ("rotary_dim / 2 factors", ""),
    "seq_len": ("sequence length the frequencies are for", "the initial table"),
}


def catalog() -> list[PresetInfo]:
    """Every preset with its parameters, as GetServerInfo lists them."""
    infos = [
        PresetInfo(name, description, tuple(parameters))
        for name, (description, parameters) in _SIN_DESCRIPTIONS.items()
    ]
    common = [
        PresetParameter("spec.rotary.head_dim", "attention head width"),
        PresetParameter("spec.rotary.rope_theta", "frequency base", "10000"),
        PresetParameter(
            "spec.rotary.partial_rotary_factor", "rotary_dim = int(head_dim * it)", "1"
        ),
        PresetParameter("spec.rotary.layout", "transformers, vllm or gptj", "transformers"),
        PresetParameter(_D_MODEL, "0, or the layout's row width", "0"),
    ]
    for kind, description in _ROPE_DESCRIPTIONS.items():
        required, optional = _ROPE_FIELDS[kind]
        parameters = list(common)
        for field in (*required, *optional):
            text, default = _ROPE_PARAMETER_DESCRIPTIONS[field]
            if field == "factor" and kind in ("yarn", "longrope"):
                text, default = text + " (or max_position_embeddings / original)", ""
            parameters.append(
                PresetParameter(f"spec.rotary.{field}", text, "" if field in required else default)
            )
        infos.append(PresetInfo(f"rotary:{kind}", description, tuple(parameters)))
    return infos
