"""Presets: the exact tables of model families, by name and parameters.

Pass one as ``preset=`` to any table method of :class:`posenc.Client` or
:class:`posenc.AsyncClient`::

    client.get_range(0, 1500, 384, preset="whisper")
    client.get_range(0, 1026, 1024, preset=SinusoidalPreset("fairseq", padding_idx=1))
    client.get_range(0, 8192, preset=RotaryPreset(head_dim=128, rope_theta=500000.0, ...))

A sinusoidal preset takes ``d_model`` and ``base`` from the call as usual; a rotary preset
sets the row width itself (``d_model`` may be left out) and carries its ``rope_theta``.
The server checks every value; this module only builds the request.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from posenc._checks import INT64_MAX, INT64_MIN, bad_argument, choice
from posenc.v1 import posenc_pb2 as pb

__all__ = [
    "ROPE_LAYOUTS",
    "ROPE_TYPES",
    "SINUSOIDAL_PRESETS",
    "Preset",
    "RotaryPreset",
    "SinusoidalPreset",
]

_SINUSOIDAL: Final[Mapping[str, pb.SinusoidalPresetName.ValueType]] = {
    "vaswani": pb.SINUSOIDAL_PRESET_NAME_VASWANI,
    "vaswani_split": pb.SINUSOIDAL_PRESET_NAME_VASWANI_SPLIT,
    "tensor2tensor": pb.SINUSOIDAL_PRESET_NAME_TENSOR2TENSOR,
    "whisper": pb.SINUSOIDAL_PRESET_NAME_WHISPER,
    "fairseq": pb.SINUSOIDAL_PRESET_NAME_FAIRSEQ,
    "transformer_xl": pb.SINUSOIDAL_PRESET_NAME_TRANSFORMER_XL,
}
_ROPE_TYPES: Final[Mapping[str, pb.RopeType.ValueType]] = {
    "default": pb.ROPE_TYPE_DEFAULT,
    "linear": pb.ROPE_TYPE_LINEAR,
    "dynamic": pb.ROPE_TYPE_DYNAMIC,
    "yarn": pb.ROPE_TYPE_YARN,
    "longrope": pb.ROPE_TYPE_LONGROPE,
    "llama3": pb.ROPE_TYPE_LLAMA3,
}
_ROPE_LAYOUTS: Final[Mapping[str, pb.RopeLayout.ValueType]] = {
    "transformers": pb.ROPE_LAYOUT_TRANSFORMERS,
    "vllm": pb.ROPE_LAYOUT_VLLM,
    "gptj": pb.ROPE_LAYOUT_GPTJ,
}

#: Names of the sinusoidal presets, rope types and rotary layouts.
SINUSOIDAL_PRESETS: Final = tuple(_SINUSOIDAL)
ROPE_TYPES: Final = tuple(_ROPE_TYPES)
ROPE_LAYOUTS: Final = tuple(_ROPE_LAYOUTS)


def _real(value: object, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_argument(field_name, f"must be a real number, got {type(value).__name__}")
    return float(value)


def _integer(value: object, field_name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise bad_argument(field_name, f"must be an integer, got {type(value).__name__}")
    number = int(value)
    if not low <= number <= high:
        # What the wire type cannot carry; the server judges the rest.
        raise bad_argument(field_name, f"must be between {low} and {high}, got {number}")
    return number


_UINT64: Final = (0, (1 << 64) - 1)


@dataclass(frozen=True)
class SinusoidalPreset:
    """A sinusoidal table of a model family (``d_model`` and ``base`` come from the call).

    Args:
        name: ``"vaswani"`` (the classic table), ``"vaswani_split"`` (Marian, Pegasus),
            ``"tensor2tensor"``, ``"whisper"``, ``"fairseq"`` (M2M100, Speech2Text, ...)
            or ``"transformer_xl"``.
        min_timescale: tensor2tensor's ``min_timescale`` (``base`` is its max_timescale).
        start_index: tensor2tensor's ``start_index``, added to every position.
        padding_idx: fairseq's padding index (default 1): its row is zero, and token ``t``
            of an unpadded sequence is row ``padding_idx + 1 + t``.
        clamp_len: Transformer-XL's ``clamp_len`` (``<= 0``: none).
        key_length: Transformer-XL's ``klen``: row ``p`` is relative position
            ``key_length - 1 - p``, so rows ``[0, klen)`` are the model's ``pos_emb``.
    """

    name: str
    min_timescale: float | None = None
    start_index: int | None = None
    padding_idx: int | None = None
    clamp_len: int | None = None
    key_length: int | None = None

    def to_proto(self) -> pb.SinusoidalPreset:
        """The ``spec.sinusoidal`` message."""
        message = pb.SinusoidalPreset(
            name=_SINUSOIDAL[choice(self.name, _SINUSOIDAL, "spec.sinusoidal.name")]
        )
        if self.min_timescale is not None:
            message.min_timescale = _real(self.min_timescale, "spec.sinusoidal.min_timescale")
        for name in ("start_index", "padding_idx", "clamp_len", "key_length"):
            value = getattr(self, name)
            if value is not None:
                setattr(
                    message, name, _integer(value, f"spec.sinusoidal.{name}", INT64_MIN, INT64_MAX)
                )
        return message


@dataclass(frozen=True)
class RotaryPreset:
    """A rotary (RoPE) cos/sin table, with transformers' ``modeling_rope_utils`` semantics.

    The fields are those of a model config's rope parameters; leave unset (``None``) those
    the rope type does not take. Every value is scaled by the rope type's attention factor.

    Args:
        head_dim: Attention head width (``config.head_dim``, else
            ``hidden_size // num_attention_heads``).
        rope_type: ``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``, ``"longrope"``
            or ``"llama3"``.
        rope_theta: The frequency base.
        layout: ``"transformers"`` (cos then sin, each ``rotary_dim`` wide with the halves
            duplicated, as ``LlamaRotaryEmbedding`` returns them), ``"vllm"`` (vLLM's
            ``cos_sin_cache`` row: ``rotary_dim / 2`` cos then as many sin) or ``"gptj"``
            (cos then sin, each value repeated twice: GPT-J's interleaved pairs).
        partial_rotary_factor: ``rotary_dim = int(head_dim * partial_rotary_factor)``.
        seq_len: ``dynamic`` and ``longrope``: the sequence length transformers computes
            the frequencies for (``max(position_ids) + 1`` of the longest forward so far);
            ``None`` for the model's initial table. For vLLM's dynamic-NTK cache, pass
            ``factor * max_position_embeddings``.
    """

    head_dim: int
    rope_type: str = "default"
    rope_theta: float = 10000.0
    layout: str = "transformers"
    partial_rotary_factor: float | None = None
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    attention_factor: float | None = None
    short_factor: Sequence[float] | None = field(default=None, hash=False)
    long_factor: Sequence[float] | None = field(default=None, hash=False)
    seq_len: int | None = None

    @property
    def rotary_dim(self) -> int:
        """``int(head_dim * partial_rotary_factor)``, as transformers computes it."""
        return int(
            self.head_dim
            * (1.0 if self.partial_rotary_factor is None else self.partial_rotary_factor)
        )

    @property
    def width(self) -> int:
        """Columns of a row: ``rotary_dim`` for vllm, ``2 * rotary_dim`` otherwise."""
        layout = str(self.layout).lower()
        return self.rotary_dim if layout == "vllm" else 2 * self.rotary_dim

    def to_proto(self) -> pb.RotaryPreset:
        """The ``spec.rotary`` message."""
        prefix = "spec.rotary"
        message = pb.RotaryPreset(
            rope_type=_ROPE_TYPES[choice(self.rope_type, _ROPE_TYPES, f"{prefix}.rope_type")],
            layout=_ROPE_LAYOUTS[choice(self.layout, _ROPE_LAYOUTS, f"{prefix}.layout")],
            head_dim=_integer(self.head_dim, f"{prefix}.head_dim", 0, (1 << 32) - 1),
            rope_theta=_real(self.rope_theta, f"{prefix}.rope_theta"),
        )
        for name in (
            "partial_rotary_factor",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, _real(value, f"{prefix}.{name}"))
        for name in ("original_max_position_embeddings", "max_position_embeddings", "seq_len"):
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, _integer(value, f"{prefix}.{name}", *_UINT64))
        if self.truncate is not None:
            message.truncate = bool(self.truncate)
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            if values is not None:
                getattr(message, name).extend(_real(v, f"{prefix}.{name}") for v in values)
        return message

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], *, layout: str = "transformers", seq_len: int | None = None
    ) -> RotaryPreset:
        """The preset of a transformers model config (``config.json`` as a dict).

        Reads ``head_dim`` (else ``hidden_size // num_attention_heads``), ``rope_theta``,
        ``partial_rotary_factor``, ``max_position_embeddings`` and the rope parameters from
        ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older configs). Keys the
        rope type does not take are dropped, as transformers ignores them.
        """
        if not isinstance(config, Mapping):
            raise bad_argument("config", "must be a model config (a JSON object)")
        parameters: dict[str, Any] = dict(
            config.get("rope_parameters") or config.get("rope_scaling") or {}
        )
        rope_type = str(parameters.get("rope_type") or parameters.get("type") or "default")
        try:
            head_dim = (
                config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            )
        except (KeyError, TypeError, ZeroDivisionError):
            raise bad_argument(
                "config", "needs head_dim, or hidden_size and num_attention_heads"
            ) from None
        theta: Any = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
        partial = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        taken = _CONFIG_FIELDS.get(rope_type, ())
        values = {name: parameters[name] for name in taken if parameters.get(name) is not None}
        if rope_type == "yarn" and values.get("factor") is None:
            taken = (*taken, "max_position_embeddings")  # factor = max / original
        if "max_position_embeddings" in taken and config.get("max_position_embeddings"):
            values["max_position_embeddings"] = config["max_position_embeddings"]
        if rope_type in ("dynamic", "longrope"):
            values["seq_len"] = seq_len
        return cls(
            head_dim=int(head_dim),
            rope_type=rope_type,
            rope_theta=float(theta),
            layout=layout,
            partial_rotary_factor=None if partial is None else float(partial),
            **values,
        )


_CONFIG_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "attention_factor",
    ),
    "longrope": (
        "factor",
        "original_max_position_embeddings",
        "max_position_embeddings",
        "short_factor",
        "long_factor",
        "attention_factor",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}

Preset: TypeAlias = str | SinusoidalPreset | RotaryPreset
"""What ``preset=`` accepts: a sinusoidal preset's name, or a preset object."""


def as_preset(preset: object) -> SinusoidalPreset | RotaryPreset:
    """Normalizes a ``preset=`` argument."""
    if isinstance(preset, str):
        return SinusoidalPreset(preset)
    if isinstance(preset, SinusoidalPreset | RotaryPreset):
        return preset
    raise bad_argument(
        "spec.preset", f"must be a preset name or object, got {type(preset).__name__}"
    )
