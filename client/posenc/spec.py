"""Table specs: which table a call asks for, checked against the protocol's own descriptors.

A table kind is a field of the ``EncodingSpec.table`` oneof (``"sinusoidal"``, ``"whisper"``,
``"rotary"``, ...), and its parameters are the fields of that kind's message. Nothing here
lists kinds, parameters or enum names by hand: they are read from ``posenc_protocol.v1``, so
a kind or a parameter added to the proto is accepted by :class:`Spec` (and the CLI) as it is::

    posenc.Spec("sinusoidal", d_model=512, layout="split")
    posenc.Spec("fairseq", d_model=1024, padding_idx=1)
    posenc.Spec("rotary", head_dim=128, rope_theta=500000.0, scaling="llama3", factor=8.0,
                original_max_position_embeddings=8192, low_freq_factor=1.0,
                high_freq_factor=4.0)

A kind message's own oneofs of messages (the rotary ``scaling``) are chosen by name with the
oneof's name as keyword (``scaling="yarn"``), and the chosen message's fields are given flat
beside the kind's own. The server judges the values; a spec only checks what the wire types
cannot carry, and names the request field of anything it refuses.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor, OneofDescriptor

from posenc._checks import bad_argument
from posenc._configs import table_from_config
from posenc_protocol.descriptors import (
    INTEGER_RANGES,
    REALS,
    TABLE,
    cases,
    choice_oneofs,
    enum_names,
    enum_of,
    kind_names,
    message_of,
    parameter_fields,
    value_names,
)
from posenc_protocol.v1 import posenc_pb2 as pb

__all__ = [
    "Spec",
    "cases",
    "choice_oneofs",
    "enum_name",
    "enum_names",
    "kind_message",
    "kind_names",
    "parameter_fields",
    "position_axes",
]


def enum_name(enum: EnumDescriptor, number: int) -> str:
    """The SDK name of an enum value; values this SDK does not know stay readable."""
    return value_names(enum).get(number, f"unknown({number})")


def kind_message(kind: str) -> Descriptor:
    """The message of table kind ``kind``; InvalidArgumentError naming the known ones."""
    kinds = cases(TABLE)
    if not isinstance(kind, str) or kind not in kinds:
        raise bad_argument("spec.table", f"{kind!r} is not a table kind: one of {', '.join(kinds)}")
    return message_of(kinds[kind])


def position_axes(kind: str) -> int:
    """Position axes of a kind's rows: its message's ``position_axes`` option, 1 when unset
    (``mrope``: 3, ``(t, h, w)``; ``sincos_grid_2d``: 2, ``(h, w)``)."""
    return kind_message(kind).GetOptions().Extensions[pb.position_axes] or 1


def _grid_fields(message: Descriptor) -> tuple[str, ...]:
    """A grid kind's cell counts, in axis order (``grid_frames``, ``grid_height``, ...)."""
    return tuple(field.name for field in message.fields if field.name.startswith("grid_"))


# -- values ---------------------------------------------------------------------------------


def _convert(field: FieldDescriptor, value: object, path: str) -> Any:
    """``value`` as field ``field`` holds it (enums: the SDK name), or InvalidArgumentError."""
    if field.is_repeated:
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            raise bad_argument(path, f"must be a sequence, got {type(value).__name__}")
        return tuple(_scalar(field, item, path) for item in value)
    return _scalar(field, value, path)


def _scalar(field: FieldDescriptor, value: object, path: str) -> Any:
    cpp_type = field.cpp_type
    if cpp_type == FieldDescriptor.CPPTYPE_ENUM:
        names = enum_names(enum_of(field))
        if isinstance(value, str) and value.lower() in names:
            return value.lower()
        raise bad_argument(path, f"{value!r} is not one of {', '.join(names)}")
    if cpp_type == FieldDescriptor.CPPTYPE_BOOL:
        if not isinstance(value, bool | np.bool_):
            raise bad_argument(path, f"must be true or false, got {value!r}")
        return bool(value)
    if isinstance(value, bool | np.bool_):  # an int to Python, a bug in a number field
        raise bad_argument(path, f"must be a number, got {value!r}")
    if cpp_type in INTEGER_RANGES:
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise bad_argument(path, f"must be an integer, got {type(value).__name__}") from None
        low, high = INTEGER_RANGES[cpp_type]
        # What the wire type cannot carry; the server judges the rest (its own ranges).
        if number < low:
            bound = "must not be negative" if low == 0 else f"must be at least {low}"
            raise bad_argument(path, f"{bound}, got {number}")
        if number > high:
            raise bad_argument(path, f"must be at most {high}, got {number}")
        return number
    if cpp_type in REALS:
        if not isinstance(value, numbers.Real):
            raise bad_argument(path, f"must be a real number, got {type(value).__name__}")
        # No table parameter is NaN or infinite (the server refuses them too): said here,
        # naming the field, before any call, and by Spec.from_config of a config holding one.
        if not math.isfinite(real := float(value)):
            raise bad_argument(path, f"must be a finite number, got {real}")
        return real
    if cpp_type == FieldDescriptor.CPPTYPE_STRING:
        if not isinstance(value, str):
            raise bad_argument(path, f"must be a string, got {type(value).__name__}")
        return value
    raise bad_argument(path, "is not a parameter the SDK can set")


def _set(message: Any, field: FieldDescriptor, value: Any) -> None:
    if field.cpp_type == FieldDescriptor.CPPTYPE_ENUM:
        value = enum_names(enum_of(field))[value]
    if field.is_repeated:
        getattr(message, field.name).extend(value)
    else:
        setattr(message, field.name, value)


# -- Spec -------------------------------------------------------------------------------------


class Spec:
    """One table: a kind (an ``EncodingSpec.table`` field name) and that kind's parameters.

    Args:
        kind: ``"sinusoidal"`` (the classic table), ``"tensor2tensor"``, ``"whisper"``,
            ``"fairseq"``, ``"transformer_xl"``, ``"rotary"``, or any kind the proto adds.
        parameters: The kind message's fields (see ``posenc_protocol.v1`` or ``posenc info``);
            enum fields take names (``layout="split"``, ``layout="vllm"``), case-insensitive.
            A oneof of the kind is chosen by name (``scaling="yarn"``) and its message's
            fields are given flat beside the kind's. Unset fields take the server's defaults.

    Raises:
        InvalidArgumentError: An unknown kind or parameter (the error names the request
            field and lists the known ones), or a value its wire type cannot carry.

    A spec is immutable and hashable; every table method of :class:`posenc.Client` and
    :class:`posenc.AsyncClient` takes one where it takes a ``d_model``.
    """

    __slots__ = ("_items", "_kind", "_message")

    def __init__(self, kind: str, /, **parameters: object) -> None:
        message_type = kind_message(kind)
        spec = pb.EncodingSpec()
        message = getattr(spec, kind)
        message.SetInParent()  # a kind with every parameter unset is still chosen
        # In the message's field order: equal specs list their parameters alike.
        items: dict[str, Any] = {}
        remaining = dict(parameters)
        for field in parameter_fields(message_type):
            if field.name in remaining:
                path = f"spec.{kind}.{field.name}"
                items[field.name] = _convert(field, remaining.pop(field.name), path)
                _set(message, field, items[field.name])
        for oneof in choice_oneofs(message_type):
            if oneof.name in remaining:
                choice, chosen = self._choose(kind, oneof, remaining)
                items[oneof.name] = choice
                items.update(chosen)
                self._fill(getattr(message, choice), chosen)
        if remaining:
            raise self._unknown(kind, message_type, next(iter(remaining)), items)
        self._kind = kind
        self._items = items
        self._message = spec

    @staticmethod
    def _choose(
        kind: str, oneof: OneofDescriptor, remaining: dict[str, object]
    ) -> tuple[str, dict[str, Any]]:
        """Pops ``oneof``'s choice and its message's fields from ``remaining``."""
        choice = remaining.pop(oneof.name)
        named = cases(oneof)
        if not isinstance(choice, str) or choice.lower() not in named:
            raise bad_argument(
                f"spec.{kind}.{oneof.name}", f"{choice!r} is not one of {', '.join(named)}"
            )
        case = named[choice.lower()]
        chosen: dict[str, Any] = {}
        for field in message_of(case).fields:
            if field.name in remaining:
                path = f"spec.{kind}.{case.name}.{field.name}"
                chosen[field.name] = _convert(field, remaining.pop(field.name), path)
        return case.name, chosen

    @staticmethod
    def _fill(message: Any, values: Mapping[str, Any]) -> None:
        message.SetInParent()  # a chosen message with every field unset is still chosen
        for name, value in values.items():
            _set(message, message.DESCRIPTOR.fields_by_name[name], value)

    @staticmethod
    def _unknown(
        kind: str, message_type: Descriptor, name: str, given: Mapping[str, Any]
    ) -> Exception:
        """The error for parameter ``name``, which ``kind`` does not take as ``given``."""
        own = [field.name for field in parameter_fields(message_type)]
        for oneof in choice_oneofs(message_type):
            named = cases(oneof)
            owners = [
                case for case, field in named.items() if name in message_of(field).fields_by_name
            ]
            chosen = given.get(oneof.name)
            if chosen is not None and owners:
                taken = ", ".join(message_of(named[chosen]).fields_by_name) or "nothing"
                return bad_argument(
                    f"spec.{kind}.{chosen}.{name}",
                    f"{oneof.name} {chosen} has no parameter {name!r} ({' or '.join(owners)} "
                    f"has); it takes {taken}",
                )
            if owners:
                return bad_argument(
                    f"spec.{kind}.{owners[0]}.{name}",
                    f"{name} belongs to {oneof.name} {' or '.join(owners)}: "
                    f"pass {oneof.name}={owners[0]!r} with it",
                )
            own.append(f"{oneof.name} ({', '.join(named)})")
        return bad_argument(
            f"spec.{kind}.{name}", f"{kind} has no parameter {name!r}; it takes {', '.join(own)}"
        )

    @property
    def kind(self) -> str:
        """The table kind: the ``EncodingSpec.table`` field this spec sets."""
        return self._kind

    @property
    def parameters(self) -> dict[str, Any]:
        """The parameters that were given (a new dict): enums by name, sequences as tuples."""
        return dict(self._items)

    @property
    def axes(self) -> int:
        """Position axes of the table's rows: positions of a several-axis kind have a
        trailing axis of this size (``get_positions``)."""
        return position_axes(self._kind)

    @property
    def grid_shape(self) -> tuple[int, ...] | None:
        """A grid kind's cells per axis (``(grid_height, grid_width)``, ...), else None."""
        names = _grid_fields(kind_message(self._kind))
        if not names:
            return None
        missing = [name for name in names if name not in self._items]
        if missing:
            raise bad_argument(f"spec.{self._kind}.{missing[0]}", "a grid needs its size")
        return tuple(int(self._items[name]) for name in names)

    def to_proto(self) -> pb.EncodingSpec:
        """A new ``EncodingSpec`` with this table set (and ``dtype`` unset)."""
        message = pb.EncodingSpec()
        message.CopyFrom(self._message)
        return message

    def __repr__(self) -> str:
        arguments = "".join(f", {name}={value!r}" for name, value in self._items.items())
        return f"Spec({self._kind!r}{arguments})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Spec):
            return NotImplemented
        return (self._kind, self._items) == (other._kind, other._items)

    def __hash__(self) -> int:
        return hash((self._kind, tuple(self._items.items())))

    @classmethod
    def from_config(
        cls,
        config: object,
        *,
        layout: str | None = None,
        seq_len: int | None = None,
        layer_type: str | None = None,
    ) -> Spec:
        """The spec of a model's positional table, from its config, read as transformers 5
        reads it.

        Args:
            config: ``config.json`` as a mapping, or a transformers ``PretrainedConfig``.
            layout: The rotary layout: ``"transformers"`` (``(cos, sin)`` as transformers'
                rotary modules return them), ``"vllm"`` (vLLM's ``cos_sin_cache``) or
                ``"gptj"``; ``None`` is the family's own (``"gptj"`` for GPT-J, else
                ``"transformers"``). Ignored by sinusoidal families.
            seq_len: For ``dynamic`` and ``longrope``: the sequence length transformers
                computes the frequencies for (``max(position_ids) + 1`` of the longest
                forward so far), normalised so that equal tables have equal specs (and share
                one server cache entry): dynamic NTK at or below ``max_position_embeddings``
                is the initial table (``seq_len`` unset); longrope has two tables, short
                (unset) and long (``original_max_position_embeddings + 1``).
            layer_type: For configs with rope parameters per layer type, which one.

        Rotary families (Llama 2/3/3.1/3.2, Mistral, Mixtral, Qwen2/2.5, Phi-3/3.5,
        Gemma/Gemma 2, GPT-NeoX/Pythia, GPT-J, DeepSeek-V2, and any config with
        transformers' rope parameters) give a ``"rotary"`` spec; sinusoidal ones (Whisper,
        M2M100/NLLB, Speech2Text, Marian/Pegasus, XLM) their own kind. Keys read:
        ``head_dim`` (DeepSeek: ``qk_rope_head_dim``; else ``hidden_size //
        num_attention_heads``, GPT-J's ``n_embd // n_head``); ``rope_theta`` (GPT-NeoX:
        ``rotary_emb_base``); ``partial_rotary_factor`` (GPT-NeoX: ``rotary_pct``, default
        0.25; GPT-J: ``rotary_dim``); ``rope_scaling`` or ``rope_parameters``
        (``rope_type``, or the older ``type``), each scaling's own fields by their proto
        names; a top-level ``original_max_position_embeddings`` before the rope
        parameters' (Phi-3-128k), as transformers gives it priority.

        Raises:
            InvalidArgumentError: A config without the keys of a width, a rope type posenc
                does not serve, or values the spec refuses.
        """
        kind, parameters = table_from_config(
            config, layout=layout, seq_len=seq_len, layer_type=layer_type
        )
        return cls(kind, **parameters)
