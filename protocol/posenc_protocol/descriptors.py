"""Names and kinds read from the ``posenc.v1`` descriptors, written once for the SDK, its CLI
and the server.

Nothing lists a table kind, a parameter or an enum name by hand: a kind is a field of the
``EncodingSpec.table`` oneof, its parameters are the fields of its message, and an enum value
is named by what follows the prefix its ``*_UNSPECIFIED`` value gives every value (buf's
ENUM_VALUE_PREFIX rule), lowercased: ``LAYOUT_SPLIT`` -> ``"split"``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor, OneofDescriptor

from posenc_protocol.v1 import posenc_pb2 as pb

__all__ = [
    "INTEGER_RANGES",
    "REALS",
    "TABLE",
    "cases",
    "choice_oneofs",
    "enum_names",
    "enum_of",
    "kind_names",
    "message_of",
    "parameter_fields",
    "value_names",
]

TABLE: Final[OneofDescriptor] = pb.EncodingSpec.DESCRIPTOR.oneofs_by_name["table"]
"""The oneof whose fields are the table kinds."""

INTEGER_RANGES: Final[Mapping[int, tuple[int, int]]] = MappingProxyType(
    {
        FieldDescriptor.CPPTYPE_INT32: (-(1 << 31), (1 << 31) - 1),
        FieldDescriptor.CPPTYPE_INT64: (-(1 << 63), (1 << 63) - 1),
        FieldDescriptor.CPPTYPE_UINT32: (0, (1 << 32) - 1),
        FieldDescriptor.CPPTYPE_UINT64: (0, (1 << 64) - 1),
    }
)
"""What each integer field type can carry, by ``FieldDescriptor.cpp_type``."""

REALS: Final = frozenset({FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT})
"""The ``cpp_type`` of real-number fields."""


@functools.cache
def enum_names(enum: EnumDescriptor) -> Mapping[str, int]:
    """An enum's value numbers by name: ``LAYOUT_SPLIT`` -> ``"split"``; the zero value
    (``*_UNSPECIFIED``, the server's default) left out."""
    prefix = enum.values_by_number[0].name.removesuffix("UNSPECIFIED")
    return MappingProxyType(
        {
            value.name.removeprefix(prefix).lower(): value.number
            for value in enum.values
            if value.number != 0
        }
    )


@functools.cache
def value_names(enum: EnumDescriptor) -> Mapping[int, str]:
    """An enum's value names by number: the inverse of :func:`enum_names`."""
    return MappingProxyType({number: name for name, number in enum_names(enum).items()})


def kind_names() -> tuple[str, ...]:
    """The table kinds: the fields of ``EncodingSpec.table``, in proto order."""
    return tuple(field.name for field in TABLE.fields)


def cases(oneof: OneofDescriptor) -> dict[str, FieldDescriptor]:
    """The fields of a oneof, by name."""
    return {field.name: field for field in oneof.fields}


def message_of(field: FieldDescriptor) -> Descriptor:
    """The message type of a message field."""
    message = field.message_type
    assert message is not None, f"{field.full_name} is a message field"
    return message


def enum_of(field: FieldDescriptor) -> EnumDescriptor:
    """The enum type of an enum field."""
    enum = field.enum_type
    assert enum is not None, f"{field.full_name} is an enum field"
    return enum


def _is_synthetic(oneof: OneofDescriptor) -> bool:
    # proto3 `optional` wraps its field in a oneof of its own, named after it.
    return len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name


def choice_oneofs(message: Descriptor) -> tuple[OneofDescriptor, ...]:
    """The oneofs a kind chooses a message from by name (the rotary ``scaling``)."""
    return tuple(oneof for oneof in message.oneofs if not _is_synthetic(oneof))


def parameter_fields(message: Descriptor) -> tuple[FieldDescriptor, ...]:
    """A message's own parameters: its fields outside the oneofs it chooses from."""
    chosen = {field.name for oneof in choice_oneofs(message) for field in oneof.fields}
    return tuple(field for field in message.fields if field.name not in chosen)
