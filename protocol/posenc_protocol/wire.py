"""The wire codec of the two table responses, shared by the server and the SDK by design.

``GetEncodingResponse`` and ``StreamEncodingResponse`` both hold one ``Tensor`` in field 1
(a ``GetEncodingResponse`` may hold a ``SharedTensor`` in field 2 instead: rows placed in
the server's shared memory).
The generated classes copy a ``bytes`` field on every step: into the message, out of it when
serializing, and again when a parsed field is read. A megabyte chunk costs more in those
copies than in everything else, so both ends use this codec instead. It writes exactly what
protobuf writes (fields in number order, proto3 zero values omitted), so stock parsers read
the messages, and it reads what any protobuf library writes: fields in any order, unknown
fields skipped.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

_VARINT = 0
_I64 = 1
_LEN = 2
_I32 = 5
_TENSOR_FIELD = 1
_SHARED_FIELD = 2
# Tensor fields: dtype = 1, row_offset = 2, rows = 3, columns = 4, data = 5.
_DATA_FIELD = 5
_MAX_VARINT_BYTES = 10
_NO_DATA = memoryview(b"")


@dataclass(frozen=True, slots=True)
class RowsView:
    """What both responses say of the rows they carry: their ``posenc.v1.DType`` and shape."""

    dtype: int = 0
    rows: int = 0
    columns: int = 0


@dataclass(frozen=True, slots=True)
class TensorView(RowsView):
    """A parsed ``Tensor`` whose ``data`` is a zero-copy view of the received message."""

    row_offset: int = 0
    data: memoryview = _NO_DATA


@dataclass(frozen=True, slots=True)
class SharedView(RowsView):
    """A parsed ``SharedTensor``: where rows lie in the server's shared memory."""

    offset: int = 0
    lease: int = 0


# Every response has a few small varints (field keys, dtype, columns): built once.
_SMALL_VARINTS = [bytes((value,)) for value in range(0x80)]


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_tensor_response(
    dtype: int, row_offset: int, rows: int, columns: int, data: bytes | memoryview
) -> bytes:
    """Serialize a ``GetEncodingResponse``/``StreamEncodingResponse`` holding one Tensor.

    ``data`` is the payload as bytes or a byte view (``array.reshape(-1).view(np.uint8).data``
    for a C-contiguous numpy array): it is copied once, into the returned message.
    """
    payload = memoryview(data)
    header = tensor_response_header(dtype, row_offset, rows, columns, payload.nbytes)
    return b"".join((header, payload))


def tensor_response_header(
    dtype: int, row_offset: int, rows: int, columns: int, nbytes: int
) -> bytes:
    """The bytes of a response (as ``encode_tensor_response``) that precede a payload of
    ``nbytes`` bytes: the message is this header, then the payload."""
    header = bytearray()
    for field, value in ((1, dtype), (2, row_offset), (3, rows), (4, columns)):
        if value:  # proto3 omits zero scalars
            header += _varint(field << 3 | _VARINT) + _varint(value)
    if nbytes:
        header += _varint(_DATA_FIELD << 3 | _LEN) + _varint(nbytes)
    prefix = _varint(_TENSOR_FIELD << 3 | _LEN) + _varint(len(header) + nbytes)
    return prefix + header


# CPython's C API makes a bytes object with uninitialised contents, to be filled by its maker
# before anyone else sees it, and hands out the address of those contents.
_NEW_BYTES = _BYTES_CONTENTS = None
if platform.python_implementation() == "CPython":
    _NEW_BYTES = ctypes.pythonapi.PyBytes_FromStringAndSize
    _NEW_BYTES.restype = ctypes.py_object
    _NEW_BYTES.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _BYTES_CONTENTS = ctypes.pythonapi.PyBytes_AsString
    _BYTES_CONTENTS.restype = ctypes.c_void_p
    _BYTES_CONTENTS.argtypes = (ctypes.py_object,)


def build_tensor_response(
    dtype: int,
    row_offset: int,
    rows: int,
    columns: int,
    nbytes: int,
    fill: Callable[[memoryview], None],
) -> bytes:
    """A serialized response whose ``nbytes``-byte payload ``fill`` writes, in place.

    The rows are written once, straight into the message, instead of into an array first
    and copied into the message after. ``fill`` gets a writable view of the payload and
    must not keep it. On CPython the message is a new ``bytes`` object that nothing else has
    seen yet, filled through the C API as C code fills one; elsewhere a ``bytearray`` is
    filled, then copied. (What that costs is not the copy but the page faults of a fresh
    buffer, paid again for every message.)
    """
    header = tensor_response_header(dtype, row_offset, rows, columns, nbytes)
    size = len(header) + nbytes
    if _NEW_BYTES is None or _BYTES_CONTENTS is None:
        scratch = bytearray(size)
        scratch[: len(header)] = header
        fill(memoryview(scratch)[len(header) :])
        return bytes(scratch)
    message: bytes = _NEW_BYTES(None, size)
    contents = (ctypes.c_char * size).from_address(_BYTES_CONTENTS(message))
    with memoryview(contents).cast("B") as view:
        view[: len(header)] = header
        with view[len(header) :] as payload:
            fill(payload)
    return message


def _read_varint(buffer: memoryview, position: int, end: int) -> tuple[int, int]:
    result = shift = 0
    for index in range(position, min(position + _MAX_VARINT_BYTES, end)):
        byte = buffer[index]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, index + 1
        shift += 7
    raise DecodeError("truncated or overlong varint")


def _skip(buffer: memoryview, wire_type: int, position: int, end: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(buffer, position, end)[1]
    if wire_type == _LEN:
        length, position = _read_varint(buffer, position, end)
        return position + length
    if wire_type == _I64:
        return position + 8
    if wire_type == _I32:
        return position + 4
    raise DecodeError(f"unsupported wire type {wire_type}")


def _parse_tensor(buffer: memoryview, position: int, end: int) -> TensorView:
    scalars = [0, 0, 0, 0, 0]
    data = buffer[0:0]
    while position < end:
        key, position = _read_varint(buffer, position, end)
        field, wire_type = key >> 3, key & 7
        if 1 <= field <= 4 and wire_type == _VARINT:
            scalars[field], position = _read_varint(buffer, position, end)
        elif field == _DATA_FIELD and wire_type == _LEN:
            length, position = _read_varint(buffer, position, end)
            data = buffer[position : position + length]
            position += length
        else:
            position = _skip(buffer, wire_type, position, end)
        if position > end:
            raise DecodeError("field runs past the end of the Tensor")
    dtype, row_offset, rows, columns = scalars[1:]
    return TensorView(dtype=dtype, rows=rows, columns=columns, row_offset=row_offset, data=data)


def _parse_shared(buffer: memoryview, position: int, end: int) -> SharedView:
    scalars = [0, 0, 0, 0, 0, 0]
    while position < end:
        key, position = _read_varint(buffer, position, end)
        field, wire_type = key >> 3, key & 7
        if 1 <= field <= 5 and wire_type == _VARINT:
            scalars[field], position = _read_varint(buffer, position, end)
        else:
            position = _skip(buffer, wire_type, position, end)
        if position > end:
            raise DecodeError("field runs past the end of the SharedTensor")
    return SharedView(*scalars[1:])


def decode_tensor_response(message: bytes) -> TensorView:
    """Parse a ``StreamEncodingResponse`` (or a ``GetEncodingResponse`` without shared
    memory) into its Tensor."""
    response = decode_unary_response(message)
    if isinstance(response, SharedView):
        raise DecodeError("a SharedTensor where a Tensor was expected")
    return response


def decode_unary_response(message: bytes) -> TensorView | SharedView:
    """Parse a ``GetEncodingResponse`` into its Tensor, or its SharedTensor when it has one."""
    buffer = memoryview(message)
    end = len(buffer)
    position = 0
    response: TensorView | SharedView = TensorView()
    while position < end:
        key, position = _read_varint(buffer, position, end)
        field, wire_type = key >> 3, key & 7
        if field in (_TENSOR_FIELD, _SHARED_FIELD) and wire_type == _LEN:
            length, position = _read_varint(buffer, position, end)
            if position + length > end:
                raise DecodeError("Tensor runs past the end of the message")
            parse = _parse_tensor if field == _TENSOR_FIELD else _parse_shared
            response = parse(buffer, position, position + length)
            position += length
        else:
            position = _skip(buffer, wire_type, position, end)
            if position > end:
                raise DecodeError("field runs past the end of the message")
    return response
