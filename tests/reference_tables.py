"""An independent mpmath reference for the table kinds: each family's formula as its code
writes it.

The sinusoidal formulas follow the paper (and Marian's create_weight for the split layout),
tensor2tensor's get_timing_signal_1d, fairseq's SinusoidalPositionalEmbedding.get_embedding
(and its transformers ports), Whisper's sinusoids and Transformer-XL's PositionalEmbedding;
the rotary ones follow transformers' modeling_rope_utils. Every quantity is evaluated as a
real number at 50 digits, with no shortcut shared with the server's decimal code.
test_presets_reference.py checks the reference against hand-computed values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mpmath

import posenc

mpmath.mp.dps = 50


# The parameters of each sinusoidal kind besides d_model, and what Sin calls its base.
_SIN_PARAMETERS: dict[str, tuple[str, ...]] = {
    "sinusoidal": ("layout",),
    "tensor2tensor": ("min_timescale", "start_index"),
    "whisper": (),
    "fairseq": ("padding_idx",),
    "transformer_xl": ("clamp_len", "key_length"),
}
_BASE_NAMES = {"tensor2tensor": "max_timescale", "whisper": "max_timescale"}


@dataclass(frozen=True)
class Sin:
    """A sinusoidal table: its kind, d_model, base (max_timescale) and its parameters."""

    kind: str
    d_model: int
    base: float = 10000.0
    layout: str = "interleaved"
    min_timescale: float = 1.0
    start_index: int = 0
    padding_idx: int = 1
    clamp_len: int = 0
    key_length: int | None = None

    def spec(self) -> posenc.Spec:
        """The table as the SDK names it (the parameters that differ from the defaults)."""
        parameters: dict[str, Any] = {"d_model": self.d_model}
        if self.base != 10000.0:
            parameters[_BASE_NAMES.get(self.kind, "base")] = self.base
        for name in _SIN_PARAMETERS[self.kind]:
            value = getattr(self, name)
            if value != self.__dataclass_fields__[name].default:
                parameters[name] = value
        return posenc.Spec(self.kind, **parameters)


def sinusoidal_exact(table: Sin, position: int, column: int) -> mpmath.mpf:
    """The exact value of row ``position``, column ``column`` of a sinusoidal table."""
    d, base = table.d_model, mpmath.mpf(table.base)
    name = table.kind
    if name in ("sinusoidal", "transformer_xl"):
        if name == "transformer_xl":
            r = position if table.key_length is None else table.key_length - 1 - position
            if table.clamp_len > 0:
                r = min(r, table.clamp_len)
            position = r
        n_sin = (d + 1) // 2
        if name == "sinusoidal" and table.layout == "interleaved":
            # sin_0, cos_0, sin_1, cos_1, ...
            i, role = column // 2, ("sin" if column % 2 == 0 else "cos")
        elif column < n_sin:
            i, role = column, "sin"
        else:
            i, role = column - n_sin, "cos"
        angle = position * base ** (-mpmath.mpf(2 * i) / d)
        return mpmath.sin(angle) if role == "sin" else mpmath.cos(angle)
    # tensor2tensor, whisper, fairseq: [sin | cos] over d // 2 timescales, zero padded.
    if name == "fairseq" and position == table.padding_idx:
        return mpmath.mpf(0)
    half = d // 2
    low = mpmath.mpf(table.min_timescale)
    if name == "tensor2tensor":
        increment = mpmath.log(base / low) / max(half - 1, 1)
        position += table.start_index
    else:  # whisper and fairseq divide by half - 1
        increment = mpmath.log(base) / (half - 1)
    if column >= 2 * half:
        return mpmath.mpf(0)
    i = column % half
    angle = position * low * mpmath.exp(-i * increment)
    return mpmath.sin(angle) if column < half else mpmath.cos(angle)


@dataclass(frozen=True)
class Rope:
    """A rotary table, with transformers' parameter names (``rope_type`` is the scaling)."""

    head_dim: int
    rope_type: str = "default"
    rope_theta: float = 10000.0
    layout: str = "transformers"
    partial_rotary_factor: float = 1.0
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
    short_factor: tuple[float, ...] = field(default=())
    long_factor: tuple[float, ...] = field(default=())
    seq_len: int | None = None
    inv_freq: tuple[float, ...] = field(default=())

    @property
    def dim(self) -> int:
        if self.rope_type == "proportional":
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def width(self) -> int:
        return self.dim if self.layout == "vllm" else 2 * self.dim

    def spec(self) -> posenc.Spec:
        """The table as the SDK names it (the parameters that differ from the defaults)."""
        parameters: dict[str, Any] = {"head_dim": self.head_dim}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            default = self.__dataclass_fields__[name].default
            if name == "rope_type":
                if value != "default":
                    parameters["scaling"] = value
            elif name != "head_dim" and value != default:
                parameters[name] = value
        return posenc.Spec("rotary", **parameters)

    @classmethod
    def of(cls, spec: posenc.Spec) -> Rope:
        """The rope of an SDK spec of kind rotary."""
        parameters = spec.parameters
        return cls(rope_type=parameters.pop("scaling", "default"), **parameters)


# Llama 3.1's published scaling (rope_scaling of its config.json), a case several tests share.
LLAMA3 = Rope(
    128,
    "llama3",
    500000.0,
    factor=8.0,
    original_max_position_embeddings=8192,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
)


def rope_frequencies(rope: Rope) -> tuple[list[mpmath.mpf], mpmath.mpf]:
    """inv_freq and the attention factor of modeling_rope_utils, as real numbers."""
    dim, theta = rope.dim, mpmath.mpf(rope.rope_theta)
    exponents = [mpmath.mpf(2 * i) / dim for i in range(dim // 2)]
    attention = mpmath.mpf(1)
    kind = rope.rope_type
    if kind == "frequencies":
        given = mpmath.mpf(1) if rope.attention_factor is None else rope.attention_factor
        return [mpmath.mpf(f) for f in rope.inv_freq], mpmath.mpf(given)
    if kind == "proportional":
        # _compute_proportional_rope_parameters: base ** (-2i / head_dim) for the first
        # int(partial * head_dim // 2) (Python float arithmetic), zeros after, all / factor.
        rotated = int(rope.partial_rotary_factor * rope.head_dim // 2)
        factor = mpmath.mpf(1 if rope.factor is None else rope.factor)
        scaled = [theta ** -(mpmath.mpf(2 * i) / rope.head_dim) / factor for i in range(rotated)]
        return scaled + [mpmath.mpf(0)] * (rope.head_dim // 2 - rotated), attention
    if kind == "dynamic":
        assert rope.factor is not None and rope.max_position_embeddings is not None
        seq_len = max(rope.seq_len or 0, rope.max_position_embeddings)
        factor = mpmath.mpf(rope.factor)
        theta = theta * (factor * seq_len / rope.max_position_embeddings - (factor - 1)) ** (
            mpmath.mpf(dim) / (dim - 2)
        )
    inv = [1 / theta**e for e in exponents]
    if kind in ("default", "dynamic"):
        return inv, attention
    if kind == "linear":
        assert rope.factor is not None
        return [f / rope.factor for f in inv], attention
    if kind in ("yarn", "longrope"):
        original = rope.original_max_position_embeddings
        assert original is not None
        if rope.factor is not None:
            factor = mpmath.mpf(rope.factor)
        else:
            assert rope.max_position_embeddings is not None
            factor = mpmath.mpf(rope.max_position_embeddings) / original
    if kind == "yarn":

        def get_mscale(scale: mpmath.mpf, m: float = 1.0) -> mpmath.mpf:
            return mpmath.mpf(1) if scale <= 1 else mpmath.mpf("0.1") * m * mpmath.log(scale) + 1

        if rope.attention_factor is not None:
            attention = mpmath.mpf(rope.attention_factor)
        elif rope.mscale and rope.mscale_all_dim:
            attention = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention = get_mscale(factor)
        beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

        def correction_dim(rotations: float) -> mpmath.mpf:
            # mpf first: a huge float beta times 2 would overflow to infinity as a float.
            return (dim * mpmath.log(original / (mpmath.mpf(rotations) * 2 * mpmath.pi))) / (
                2 * mpmath.log(theta)
            )

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rope.truncate:
            low, high = mpmath.floor(low), mpmath.ceil(high)
        # mpf bounds: with int ones, (i - low) / (high - low) would be a float division.
        low, high = max(low, mpmath.mpf(0)), min(high, mpmath.mpf(dim - 1))
        if low == high:
            high += mpmath.mpf("0.001")
        out = []
        for i, f in enumerate(inv):
            ramp = min(max((i - low) / (high - low), 0), 1)
            extrapolation = 1 - ramp
            out.append(f / factor * (1 - extrapolation) + f * extrapolation)
        return out, attention
    if kind == "longrope":
        if rope.attention_factor is not None:
            attention = mpmath.mpf(rope.attention_factor)
        elif factor <= 1:
            attention = mpmath.mpf(1)
        else:
            attention = mpmath.sqrt(1 + mpmath.log(factor) / mpmath.log(original))
        long = rope.seq_len is not None and rope.seq_len > original
        factors = rope.long_factor if long else rope.short_factor
        return [1 / (mpmath.mpf(s) * theta**e) for s, e in zip(factors, exponents, strict=True)], (
            attention
        )
    assert kind == "llama3"
    assert rope.factor is not None and rope.original_max_position_embeddings is not None
    assert rope.low_freq_factor is not None and rope.high_freq_factor is not None
    old = rope.original_max_position_embeddings
    low_wavelen = mpmath.mpf(old) / rope.low_freq_factor
    high_wavelen = mpmath.mpf(old) / rope.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * mpmath.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / rope.factor)
        else:
            # mpf difference: the float one is rounded.
            low_factor = mpmath.mpf(rope.low_freq_factor)
            smooth = (old / wavelen - low_factor) / (rope.high_freq_factor - low_factor)
            out.append((1 - smooth) * f / rope.factor + smooth * f)
    return out, attention


def rope_column(rope: Rope, column: int) -> tuple[str, int]:
    """("cos" | "sin", frequency index) of a column in the rope's layout."""
    half = rope.dim // 2
    if rope.layout == "vllm":
        return ("cos", column) if column < half else ("sin", column - half)
    if rope.layout == "transformers":
        return ("cos" if column < 2 * half else "sin"), column % half
    return ("cos" if column < 2 * half else "sin"), (column % (2 * half)) // 2


def rope_exact(
    rope: Rope, position: int, column: int, cache: dict[Rope, Any] | None = None
) -> mpmath.mpf:
    """The exact value of row ``position``, column ``column`` of a rotary table."""
    if cache is not None and rope in cache:
        inv, attention = cache[rope]
    else:
        inv, attention = rope_frequencies(rope)
        if cache is not None:
            cache[rope] = (inv, attention)
    role, i = rope_column(rope, column)
    angle = position * inv[i]
    return attention * (mpmath.cos(angle) if role == "cos" else mpmath.sin(angle))


def columns_of(width: int, extra: Sequence[int] = ()) -> list[int]:
    """The first, second, last and a few given columns of a row."""
    return sorted({0, min(1, width - 1), width - 1, *(c for c in extra if c < width)})
