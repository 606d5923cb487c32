"""Bad input: the documented status code, a message naming the field, and the server lives on."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import given, settings
from hypothesis import strategies as st

from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc
from posenc_server.app import RunningServer, start_server
from posenc_server.config import ServerConfig

LIMIT = 2**42
GET = "/posenc.v1.PositionalEncodingService/GetEncoding"


def sinusoidal(d_model: int, dtype: int = 0, **table: object) -> pb.EncodingSpec:
    """The classic sinusoidal table's spec."""
    return pb.EncodingSpec(
        dtype=dtype,  # type: ignore[arg-type]
        sinusoidal=pb.SinusoidalTable(d_model=d_model, **table),  # type: ignore[arg-type]
    )


def refused(code: grpc.StatusCode, call: Callable[[], object]) -> grpc.RpcError:
    """The error that ``call()`` raises, which must carry ``code``."""
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == code
    return raised.value


def request(
    d_model: int = 8, start: int = 0, stop: int = 4, **spec: object
) -> pb.GetEncodingRequest:
    return pb.GetEncodingRequest(
        spec=sinusoidal(d_model, **spec), range=pb.PositionRange(start=start, stop=stop)
    )


def stream_request(d_model: int, stop: int, **fields: Any) -> pb.StreamEncodingRequest:
    """A stream of the sinusoidal table's rows ``[0, stop)``."""
    return pb.StreamEncodingRequest(
        spec=sinusoidal(d_model), range=pb.PositionRange(start=0, stop=stop), **fields
    )


def field_violations(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "INVALID_ARGUMENT without google.rpc.Status details"
    fields = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        assert detail.Unpack(bad_request)
        fields += [violation.field for violation in bad_request.field_violations]
    return fields


def assert_still_serves(stub: posenc_pb2_grpc.PositionalEncodingServiceStub) -> None:
    response = stub.GetEncoding(request(d_model=4, start=0, stop=2))
    table = np.frombuffer(response.tensor.data, "<f4").reshape(2, 4)
    np.testing.assert_allclose(table[1], [np.sin(1), np.cos(1), np.sin(0.01), np.cos(0.01)], 1e-6)


INVALID_UNARY = {
    "d_model 0": (request(d_model=0), "spec.sinusoidal.d_model"),
    "d_model 10**9": (request(d_model=10**9), "spec.sinusoidal.d_model"),
    "base 1": (request(base=1.0), "spec.sinusoidal.base"),
    "base 0.5": (request(base=0.5), "spec.sinusoidal.base"),
    "base NaN": (request(base=float("nan")), "spec.sinusoidal.base"),
    "base inf": (request(base=float("inf")), "spec.sinusoidal.base"),
    "base -inf": (request(base=float("-inf")), "spec.sinusoidal.base"),
    "base 0 explicitly": (request(base=0.0), "spec.sinusoidal.base"),
    "start > stop": (request(start=10, stop=5), "range.stop"),
    "start over the limit": (request(start=LIMIT + 1, stop=LIMIT + 2), "range.start"),
    "stop past the limit": (request(start=LIMIT, stop=LIMIT + 2), "range.stop"),
    "start under -limit": (request(start=-LIMIT - 1, stop=0), "range.start"),
    "unknown dtype": (request(dtype=7), "spec.dtype"),
    "unknown layout": (request(layout=9), "spec.sinusoidal.layout"),
    "unknown schedule": (request(schedule=5), "spec.sinusoidal.schedule"),
    "position over the limit": (
        pb.GetEncodingRequest(
            spec=sinusoidal(8), positions=pb.PositionList(positions=[1, -(2**43)])
        ),
        "positions.positions[1]",
    ),
    "empty position list": (
        pb.GetEncodingRequest(spec=sinusoidal(8), positions=pb.PositionList()),
        "positions.positions",
    ),
    "no selection": (pb.GetEncodingRequest(spec=sinusoidal(8)), "selection"),
}


@pytest.mark.parametrize("case", list(INVALID_UNARY))
def test_invalid_argument_names_the_field(
    case: str, stub: posenc_pb2_grpc.PositionalEncodingServiceStub
) -> None:
    message, field = INVALID_UNARY[case]
    error = refused(grpc.StatusCode.INVALID_ARGUMENT, lambda: stub.GetEncoding(message))
    assert field in error.details()
    assert field in field_violations(error)
    assert_still_serves(stub)


def test_invalid_stream_requests_fail_the_same_way(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    for message, field in INVALID_UNARY.values():
        streamed = pb.StreamEncodingRequest()
        streamed.spec.CopyFrom(message.spec)
        which = message.WhichOneof("selection")
        if which == "range":
            streamed.range.CopyFrom(message.range)
        elif which == "positions":
            streamed.positions.CopyFrom(message.positions)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.StreamEncoding(streamed))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in field_violations(raised.value)
    assert_still_serves(stub)


def test_negative_d_model_on_the_wire_is_refused(server: RunningServer) -> None:
    # uint32 cannot hold -1, but a client can still send its 10-byte varint.
    table = b"\x08" + b"\xff" * 9 + b"\x01"
    spec = b"\x12" + bytes([len(table)]) + table
    selection = pb.PositionRange(start=0, stop=1).SerializeToString()
    raw = b"\x0a" + bytes([len(spec)]) + spec + b"\x12" + bytes([len(selection)]) + selection
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary(GET)
        with pytest.raises(grpc.RpcError) as raised:
            call(raw)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "spec.sinusoidal.d_model" in raised.value.details()
        assert_still_serves(posenc_pb2_grpc.PositionalEncodingServiceStub(channel))


def test_oversized_position_list_is_refused(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    positions = pb.PositionList(positions=range(1_048_577))
    error = refused(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.GetEncoding(pb.GetEncodingRequest(spec=sinusoidal(1), positions=positions)),
    )
    assert "positions.positions" in field_violations(error)
    assert "1048576" in error.details()
    assert_still_serves(stub)


def test_largest_position_list_is_received(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    # 2**20 negative positions take 10 bytes each on the wire: the receive limit must fit them.
    positions = pb.PositionList(positions=range(-(2**20), 0))
    chunks = stub.StreamEncoding(pb.StreamEncodingRequest(spec=sinusoidal(1), positions=positions))
    assert sum(chunk.chunk.rows for chunk in chunks) == 2**20


def test_unary_result_over_its_limit_says_to_stream(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    error = refused(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        lambda: stub.GetEncoding(request(d_model=1024, start=0, stop=1025)),
    )
    assert "StreamEncoding" in error.details()
    assert "unary limit" in error.details()
    assert_still_serves(stub)


def test_stream_over_its_limit_is_refused_before_computing(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    huge = stream_request(4096, 2**20 + 1)
    error = refused(
        grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: next(iter(stub.StreamEncoding(huge)))
    )
    assert "stream limit" in error.details()
    assert_still_serves(stub)


def test_chunk_smaller_than_a_row_is_refused(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    message = stream_request(1024, 10, max_chunk_bytes=4095)
    error = refused(grpc.StatusCode.INVALID_ARGUMENT, lambda: list(stub.StreamEncoding(message)))
    assert "max_chunk_bytes" in field_violations(error)


@pytest.mark.parametrize(
    ("method", "streaming"),
    [("GetEncoding", False), ("StreamEncoding", True), ("GetServerInfo", False)],
)
def test_malformed_bytes_are_invalid_argument_not_internal(
    server: RunningServer, method: str, streaming: bool
) -> None:
    with grpc.insecure_channel(server.target) as channel:
        path = f"/posenc.v1.PositionalEncodingService/{method}"
        call = channel.unary_stream(path) if streaming else channel.unary_unary(path)
        with pytest.raises(grpc.RpcError) as raised:
            result = call(b"\x0a\x05\x08")
            if streaming:
                list(result)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request" in field_violations(raised.value)
        assert_still_serves(posenc_pb2_grpc.PositionalEncodingServiceStub(channel))


@settings(max_examples=3000 if os.environ.get("POSENC_SOAK") == "1" else 150, deadline=None)
@given(payload=st.binary(max_size=64), method=st.sampled_from(["GetEncoding", "StreamEncoding"]))
def test_random_request_bytes_get_only_documented_codes(
    fuzz_target: str, payload: bytes, method: str
) -> None:
    documented = {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
    with grpc.insecure_channel(fuzz_target) as channel:
        path = f"/posenc.v1.PositionalEncodingService/{method}"
        try:
            if method == "StreamEncoding":
                # Only the first chunk: a valid random request may select a huge range.
                next(iter(channel.unary_stream(path)(payload, timeout=30)), None)
            else:
                channel.unary_unary(path)(payload, timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
        assert code in documented, (payload, code)


@pytest.fixture(scope="module")
def fuzz_target() -> Iterator[str]:
    running = start_server(ServerConfig(port=0))
    yield running.target
    with grpc.insecure_channel(running.target) as channel:
        assert_still_serves(posenc_pb2_grpc.PositionalEncodingServiceStub(channel))
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    running.stop(0)


def test_every_position_rule_speaks_of_the_position_limit(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub,
) -> None:
    # One message shape per rule: the user's value and the documented limit, not an
    # internal bound such as the exclusive stop's limit + 1.
    for message, field in [
        (request(start=LIMIT, stop=LIMIT + 2), "range.stop"),
        (request(start=-LIMIT - 1, stop=0), "range.start"),
        (
            pb.GetEncodingRequest(
                spec=sinusoidal(8), positions=pb.PositionList(positions=[LIMIT + 1])
            ),
            "positions.positions[0]",
        ),
    ]:
        with pytest.raises(grpc.RpcError) as raised:
            stub.GetEncoding(message)
        assert f"{field}: |position| must be at most {LIMIT}, got " in raised.value.details()


def _mrope(section: list[int]) -> pb.EncodingSpec:
    return pb.EncodingSpec(mrope=pb.MRopeTable(head_dim=64, mrope_section=section))


def _longrope(factors: list[float]) -> pb.EncodingSpec:
    scaling = pb.LongRopeScaling(
        original_max_position_embeddings=4096, short_factor=factors, long_factor=factors
    )
    return pb.EncodingSpec(rotary=pb.RotaryTable(head_dim=64, longrope=scaling))


HOSTILE = {
    # 10 MB of ones: the message listed them all (26 MB), and the caller's gRPC refused
    # the oversized trailer with RESOURCE_EXHAUSTED instead of the error.
    "mrope_section of 10**7": pb.GetEncodingRequest(
        spec=_mrope([1] * 10**7), range=pb.PositionRange(start=0, stop=4)
    ),
    "longrope factors of 600,000": pb.GetEncodingRequest(
        spec=_longrope([1.0] * 600_000), range=pb.PositionRange(start=0, stop=4)
    ),
    "positions over the limit": pb.GetEncodingRequest(
        spec=sinusoidal(8), positions=pb.PositionList(positions=[5] * ((1 << 20) + 1))
    ),
    "coordinates over the limit": pb.GetEncodingRequest(
        spec=_mrope([16, 8, 8]),
        coordinates=pb.CoordinateList(axes=3, coordinates=[1] * (3 * (1 << 20) + 3)),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HOSTILE))
def test_errors_stay_small_whatever_the_request(
    stub: posenc_pb2_grpc.PositionalEncodingServiceStub, name: str
) -> None:
    """An error's message and details are bounded: nothing a request holds comes back
    whole, however large the request."""
    error = refused(
        grpc.StatusCode.INVALID_ARGUMENT, lambda: stub.GetEncoding(HOSTILE[name], timeout=60)
    )
    assert len(error.details()) <= 4096
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None and status.ByteSize() <= 16384
    assert field_violations(error)
    assert_still_serves(stub)


def test_every_violation_is_bounded() -> None:
    """Whatever a check says, a violation keeps at most 512 characters of it, and an
    error lists at most 16 violations."""
    from posenc_server.errors import FieldViolation, InvalidRequestError

    violation = FieldViolation("spec." + "x" * 10**6, "got " + "1, " * 10**6)
    assert len(violation.field) <= 128 and len(violation.description) <= 512
    error = InvalidRequestError([FieldViolation(f"f{i}", "bad") for i in range(1000)])
    assert len(error.violations) == 16 and "985 more" in error.violations[-1].description
    assert len(str(error)) <= 16 * (128 + 512 + 4)
