"""The hand-written response codec agrees with stock protobuf, both ways."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc_protocol import wire
from posenc_protocol.v1 import posenc_pb2 as pb

UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)


def varint(value: int) -> bytes:
    """protobuf's base-128 varint, written out independently of the codec."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


@settings(max_examples=300, deadline=None)
@given(dtype=st.integers(0, 4), row_offset=UINT64, rows=UINT32, columns=UINT32, data=st.binary())
def test_stock_protobuf_reads_what_the_server_writes(
    dtype: int, row_offset: int, rows: int, columns: int, data: bytes
) -> None:
    message = wire.encode_tensor_response(dtype, row_offset, rows, columns, data)
    expected = pb.Tensor(dtype=dtype, row_offset=row_offset, rows=rows, columns=columns, data=data)  # type: ignore[arg-type]
    for message_type in (pb.StreamEncodingResponse, pb.GetEncodingResponse):
        parsed = message_type.FromString(message)
        tensor = parsed.chunk if message_type is pb.StreamEncodingResponse else parsed.tensor  # type: ignore[union-attr]
        assert tensor == expected
    # Byte for byte what protobuf itself writes.
    assert message == pb.StreamEncodingResponse(chunk=expected).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.integers(0, 4),
    row_offset=UINT64,
    rows=UINT32,
    columns=UINT32,
    data=st.binary(),
    unknown=st.binary(max_size=20),
)
def test_the_sdk_reads_what_stock_protobuf_writes_unknown_fields_included(
    dtype: int, row_offset: int, rows: int, columns: int, data: bytes, unknown: bytes
) -> None:
    tensor = pb.Tensor(dtype=dtype, row_offset=row_offset, rows=rows, columns=columns, data=data)  # type: ignore[arg-type]
    # Unknown fields (a newer server) around and inside the Tensor: field 15 as bytes, 14 as
    # a varint, 13 as fixed64, 12 as fixed32.
    extra = b"\x7a" + bytes([len(unknown)]) + unknown + b"\x70\x96\x01" + b"\x69" + b"\x00" * 8
    extra += b"\x65" + b"\x01" * 4
    inner = extra + tensor.SerializeToString() + extra
    message = extra + b"\x0a" + varint(len(inner)) + inner
    view = wire.decode_tensor_response(message)
    assert (view.dtype, view.row_offset, view.rows, view.columns) == (
        dtype,
        row_offset,
        rows,
        columns,
    )
    assert bytes(view.data) == data


def test_payload_is_a_view_not_a_copy() -> None:
    payload = np.arange(1024, dtype=np.float32)
    message = wire.encode_tensor_response(1, 0, 1, 1024, payload.view(np.uint8).data)
    view = wire.decode_tensor_response(message)
    assert view.data.obj is message
    np.testing.assert_array_equal(np.frombuffer(view.data, "<f4"), payload)


@pytest.mark.parametrize(
    "garbage",
    [b"\x0a", b"\x0a\x05\x08", b"\x0a\x02\x2a\x10", b"\xff" * 11, b"\x0f"],
)
def test_truncated_or_malformed_messages_raise_decode_error(garbage: bytes) -> None:
    with pytest.raises(DecodeError):
        wire.decode_tensor_response(garbage)
