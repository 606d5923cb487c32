"""Protobuf <-> domain, generic over the ``posenc.v1`` descriptors.

Nothing here lists a table kind's fields: a kind message's set fields become the keyword
arguments of its class (``tables.KINDS``, by the ``EncodingSpec.table`` field name), enum
numbers become the value names without their prefix, lowercased (``LAYOUT_SPLIT`` ->
``"split"``), and a set sub-message of a oneof becomes the class its kind lists for that
case (``TableKind.VARIANTS``). GetServerInfo's catalogue is built the same way, from the
descriptors and the documentation each kind keeps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import Descriptor, EnumDescriptor
from google.protobuf.message import DecodeError, Message

from posenc_protocol.descriptors import TABLE, value_names
from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_server import engine
from posenc_server.errors import FieldViolation, InvalidRequestError
from posenc_server.requests import CoordinateList, PositionList, PositionRange, Query, Selection
from posenc_server.service import ServerInfo
from posenc_server.tables import KINDS, Documented, Limits, TableKind

DEFAULT_DTYPE = "float32"
"""The dtype of a request that leaves it unset (``DTYPE_UNSPECIFIED``)."""

RequestT = TypeVar("RequestT", bound=Message)


# -- requests -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MalformedRequest:
    """Request bytes that do not parse as the method's message.

    gRPC's own deserialization failure is answered with INTERNAL; parsing through this
    placeholder lets the server answer INVALID_ARGUMENT instead, as for any bad input.
    """

    message_type: str
    error: str


def tolerant_parser(message_type: type[RequestT]) -> Callable[[bytes], RequestT | MalformedRequest]:
    """A request deserializer that never raises (see ``MalformedRequest``)."""

    def parse(data: bytes) -> RequestT | MalformedRequest:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            return MalformedRequest(message_type.DESCRIPTOR.full_name, str(error))

    return parse


def parsed(request: RequestT | MalformedRequest) -> RequestT:
    """The request, or InvalidRequestError when its bytes did not parse."""
    if isinstance(request, MalformedRequest):
        raise _malformed(request)
    return request


def _malformed(request: MalformedRequest) -> InvalidRequestError:
    description = f"not a valid {request.message_type} message: {request.error}"
    return InvalidRequestError([FieldViolation("request", description)])


def encoding_query(
    request: pb.GetEncodingRequest | pb.StreamEncodingRequest | MalformedRequest,
    limits: SelectionLimits,
) -> Query:
    """The domain form of a GetEncoding or StreamEncoding request, its selection checked."""
    if isinstance(request, MalformedRequest):
        raise _malformed(request)
    message = request
    violations: list[FieldViolation] = []
    spec = message.spec
    dtype = DEFAULT_DTYPE
    if spec.dtype:
        dtype = _enum_name(pb.Dtype.DESCRIPTOR, spec.dtype, "spec.dtype", violations)
    table = table_from_proto(spec, violations, limits.max_d_model)
    selection = _selection(message, limits, violations, table)
    session = getattr(message, "shared_memory_session", b"")
    if len(session) > _MAX_SESSION_BYTES:
        violations.append(
            FieldViolation("shared_memory_session", "is not a session of the region socket")
        )
    return Query(
        # A refused request needs no key (SpecTable.resolve refuses it): a spec holding
        # megabytes is not copied only to be refused.
        spec_key=b"" if violations else spec.SerializeToString(deterministic=True),
        table=table,
        dtype=dtype,
        dtype_code=_DTYPE_CODES.get(dtype, 0),
        selection=selection,
        max_chunk_bytes=getattr(message, "max_chunk_bytes", 0),
        violations=violations,
        shared_session=session,
    )


# A region socket's session token is 16 bytes; anything much longer is not one.
_MAX_SESSION_BYTES = 64


# The longest list a table kind's parameter may hold when no limits say: a list of
# parameters holds one per column or fewer (rotary's factors: rotary_dim / 2).
_MAX_LIST_ITEMS = 1 << 20


def table_from_proto(
    spec: pb.EncodingSpec, violations: list[FieldViolation], max_items: int = _MAX_LIST_ITEMS
) -> TableKind | None:
    """The table kind of ``spec``; None, with ``violations`` added, when it cannot be built.

    A list parameter holds at most ``max_items`` (the server's max_d_model: no kind's list
    holds more than a row's columns); a longer one is refused before it is converted, so
    that a refused request costs no more than it brought. The kind is not validated here
    (``TableKind.validate``).
    """
    which = spec.WhichOneof("table")
    if which is None:
        known = ", ".join(field.name for field in TABLE.fields)
        violations.append(FieldViolation("spec.table", f"set one table kind: {known}"))
        return None
    before = len(violations)
    kind = KINDS[which]
    fields = _fields(getattr(spec, which), kind, f"spec.{which}", violations, max_items)
    return kind(**fields) if len(violations) == before else None


def _fields(
    message: Message,
    kind: type[Documented],
    path: str,
    violations: list[FieldViolation],
    max_items: int,
) -> dict[str, Any]:
    """The set fields of ``message`` as keyword arguments of ``kind``."""
    fields: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.message_type is not None:
            # A case of a oneof of sub-messages (only those carry messages): its class.
            assert field.containing_oneof is not None
            oneof = field.containing_oneof.name
            variant = kind.VARIANTS[oneof][field.name]
            nested = _fields(value, variant, f"{path}.{field.name}", violations, max_items)
            fields[oneof] = variant(**nested)
        elif field.enum_type is not None:
            fields[field.name] = _enum_name(
                field.enum_type, value, f"{path}.{field.name}", violations
            )
        elif field.is_repeated:
            if len(value) > max_items:
                violations.append(
                    FieldViolation(
                        f"{path}.{field.name}",
                        f"must hold at most {max_items} values, got {len(value)}",
                    )
                )
                continue
            fields[field.name] = tuple(value)
        else:
            fields[field.name] = value
    return fields


def _enum_name(
    enum: EnumDescriptor, number: int, path: str, violations: list[FieldViolation]
) -> str:
    names = value_names(enum)
    name = names.get(number)
    if name is None:
        known = ", ".join(f"{value} ({name})" for value, name in names.items())
        violations.append(FieldViolation(path, f"unknown value {number}; known: {known}"))
        return ""
    return name


_DTYPE_CODES: Mapping[str, pb.Dtype.ValueType] = {
    name: pb.Dtype.ValueType(number) for number, name in value_names(pb.Dtype.DESCRIPTOR).items()
}


class SelectionLimits(Limits, Protocol):
    """The limits a selection is checked against (``ServerConfig`` has them)."""

    @property
    def max_positions(self) -> int:
        """Longest accepted position list."""
        ...


def _selection(
    message: pb.GetEncodingRequest | pb.StreamEncodingRequest,
    limits: SelectionLimits,
    violations: list[FieldViolation],
    table: TableKind | None = None,
) -> Selection | None:
    which = message.WhichOneof("selection")
    if which == "range":
        selected = PositionRange(message.range.start, message.range.stop)
        _check_range(selected, limits.max_abs_position, violations)
        return selected
    if which == "positions":
        values = message.positions.positions
        if not 1 <= len(values) <= limits.max_positions:
            # Refused before converting: a refused list costs no more than it brought.
            violations.append(
                FieldViolation(
                    "positions.positions",
                    f"must hold 1 to {limits.max_positions} positions, got {len(values)}",
                )
            )
            return None
        listed = PositionList(np.array(values, dtype=np.int64))
        _check_positions(listed, limits, violations)
        return listed
    if which == "coordinates":
        return _coordinates(message.coordinates, limits, violations, table)
    violations.append(FieldViolation("selection", "set one of range, positions, coordinates"))
    return None


def _coordinates(
    message: pb.CoordinateList,
    limits: SelectionLimits,
    violations: list[FieldViolation],
    table: TableKind | None,
) -> CoordinateList | None:
    """The coordinates of a table with several position axes, as ``[rows, axes]``."""
    axes, values = message.axes, message.coordinates
    if (shape := _coordinates_shape_violation(axes, len(values), table)) is not None:
        violations.append(shape)
        return None
    count, limit = len(values) // axes, limits.max_abs_position
    if not 1 <= count <= limits.max_positions:
        # Refused before converting: a refused list costs no more than it brought.
        violations.append(
            FieldViolation(
                "coordinates.coordinates",
                f"must hold 1 to {limits.max_positions} rows of {axes} coordinates, got {count}",
            )
        )
        return None
    flat = np.array(values, dtype=np.int64)
    if bad := _out_of_range(flat, limit, "coordinates.coordinates", "coordinate", axes):
        violations.append(bad)
    return CoordinateList(flat.reshape(count, axes))


def _coordinates_shape_violation(
    axes: int, values: int, table: TableKind | None
) -> FieldViolation | None:
    """What is wrong with ``values`` coordinates of ``axes`` axes for ``table`` (when
    known), before any is looked at; None when nothing is."""
    if table is not None and table.AXES == 1:
        return FieldViolation(
            "coordinates.axes",
            f"spec.{table.NAME} has one position axis: select positions or a range",
        )
    if table is not None and axes != table.AXES:
        return FieldViolation(
            "coordinates.axes", f"spec.{table.NAME} has {table.AXES} position axes, got {axes}"
        )
    if axes < 2:
        return FieldViolation("coordinates.axes", f"must be at least 2, got {axes}")
    if values % axes:
        return FieldViolation(
            "coordinates.coordinates",
            f"must hold a multiple of axes ({axes}) values, got {values}",
        )
    return None


def _out_of_range(
    values: npt.NDArray[np.int64],
    limit: int,
    path: str,
    noun: str,
    axes: int = 1,
) -> FieldViolation | None:
    """The problem of the first of ``values`` (field ``path``, each a ``noun``; rows of
    ``axes`` values, named when more than one) with |value| > limit, and how many there
    are; None when there is none."""
    # Not np.abs: it overflows (stays negative) for -2**63.
    bad = np.flatnonzero((values > limit) | (values < -limit))
    if not bad.size:
        return None
    index, count = int(bad[0]), int(bad.size)
    where = f" (row {index // axes}, axis {index % axes})" if axes > 1 else ""
    return FieldViolation(
        f"{path}[{index}]",
        f"|{noun}| must be at most {limit}, got {int(values[index])}{where}"
        + (f"; {count} {noun}s out of range" if count > 1 else ""),
    )


def _check_range(selection: PositionRange, limit: int, violations: list[FieldViolation]) -> None:
    start, stop = selection.start, selection.stop
    if start > stop:
        violations.append(
            FieldViolation("range.stop", f"must be >= range.start ({start}), got {stop}")
        )
    if abs(start) > limit:
        violations.append(
            FieldViolation("range.start", f"|position| must be at most {limit}, got {start}")
        )
    # stop is exclusive: the last position of the range is stop - 1.
    if start < stop and abs(stop - 1) > limit:
        violations.append(
            FieldViolation(
                "range.stop",
                f"|position| must be at most {limit}, got {stop} (its last position is {stop - 1})",
            )
        )
    elif start == stop and abs(stop) > limit:
        violations.append(
            FieldViolation("range.stop", f"|position| must be at most {limit}, got {stop}")
        )


def _check_positions(
    selection: PositionList, limits: SelectionLimits, violations: list[FieldViolation]
) -> None:
    count, limit, positions = selection.rows, limits.max_abs_position, selection.positions
    if not 1 <= count <= limits.max_positions:
        violations.append(
            FieldViolation(
                "positions.positions",
                f"must hold 1 to {limits.max_positions} positions, got {count}",
            )
        )
    elif bad := _out_of_range(positions, limit, "positions.positions", "position"):
        violations.append(bad)


# -- GetServerInfo ---------------------------------------------------------------------------


def server_info_response(info: ServerInfo) -> pb.GetServerInfoResponse:
    """The GetServerInfoResponse of ``info``."""
    return pb.GetServerInfoResponse(
        version=info.version,
        server_id=info.server_id,
        limits=pb.Limits(**info.limits),
        dtypes=[number for name, number in _DTYPE_CODES.items() if name in engine.DTYPES],
        cache=pb.CacheStats(**asdict(info.cache)),
        rows_computed=info.rows_computed,
        table_kinds=table_kinds(),
    )


@functools.cache
def table_kinds() -> tuple[pb.TableKind, ...]:
    """Every table kind (and variant, as ``kind.case``) with its parameters, in proto order.

    The response copies them, so sharing them is safe.
    """
    kinds: list[pb.TableKind] = []
    for field in TABLE.fields:
        assert field.message_type is not None
        _describe(field.name, KINDS[field.name], field.message_type, "spec", kinds)
    return tuple(kinds)


def _describe(
    name: str, kind: type[Documented], message: Descriptor, path: str, out: list[pb.TableKind]
) -> None:
    path = f"{path}.{name.rsplit('.', 1)[-1]}"
    parameters = [
        pb.TableParameter(
            field=f"{path}.{field.name}",
            description=kind.PARAMETERS[field.name].description,
            default=kind.PARAMETERS[field.name].default,
        )
        for field in message.fields
        if field.message_type is None
    ]
    out.append(pb.TableKind(name=name, description=kind.DESCRIPTION, parameters=parameters))
    for oneof in message.oneofs:
        for field in oneof.fields:
            if field.message_type is not None:  # a oneof of sub-messages: the kind's variants
                variant = kind.VARIANTS[oneof.name][field.name]
                _describe(f"{name}.{field.name}", variant, field.message_type, path, out)


def shared_response(dtype_code: int, rows: int, columns: int, offset: int, lease: int) -> bytes:
    """A serialized GetEncodingResponse whose rows lie in shared memory (see ``shm``)."""
    shared = pb.SharedTensor(rows=rows, columns=columns, offset=offset, lease=lease)
    shared.dtype = dtype_code  # type: ignore[assignment]
    return pb.GetEncodingResponse(shared=shared).SerializeToString()
