"""The gRPC servicer: protobuf <-> domain types, and the one place errors become status codes."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from posenc.wire import encode_tensor_response
from posenc.v1 import posenc_pb2
from posenc_server import engine, metrics, presets
from posenc_server.config import ServerConfig
from posenc_server.engine import EncodingSpec, Layout, Schedule
from posenc_server.errors import (
    FieldViolation,
    InvalidRequestError,
    LimitExceededError,
    OverloadedError,
    ShuttingDownError,
)
from posenc_server.service import (
    Chunk,
    EncodingService,
    PositionList,
    PositionRange,
    Selection,
    validate_spec,
)

log = logging.getLogger("posenc_server")

# How long a client turned away at the stream cap is told to wait before trying again.
_STREAM_RETRY_AFTER = 0.2
# Valid specs remembered by their serialized message; beyond, the memory starts over.
_REMEMBERED_SPECS = 1024

RequestT = TypeVar("RequestT", bound=Message)


@dataclass(frozen=True)
class MalformedRequest:
    """Request bytes that do not parse as the method's message.

    gRPC's own deserialization failure is answered with INTERNAL; parsing through this
    placeholder lets the servicer answer INVALID_ARGUMENT instead, as for any bad input.
    """

    message_type: str
    error: str


def _tolerant_parser(
    message_type: type[RequestT],
) -> Callable[[bytes], RequestT | MalformedRequest]:
    def parse(data: bytes) -> RequestT | MalformedRequest:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            return MalformedRequest(message_type.DESCRIPTOR.full_name, str(error))

    return parse


def _parsed(request: RequestT | MalformedRequest) -> RequestT:
    if isinstance(request, MalformedRequest):
        raise InvalidRequestError(
            [
                FieldViolation(
                    "request", f"not a valid {request.message_type} message: {request.error}"
                )
            ]
        )
    return request


DTYPE_NAMES: dict[int, str] = {
    posenc_pb2.DTYPE_UNSPECIFIED: "float32",
    posenc_pb2.DTYPE_FLOAT32: "float32",
    posenc_pb2.DTYPE_FLOAT16: "float16",
    posenc_pb2.DTYPE_BFLOAT16: "bfloat16",
    posenc_pb2.DTYPE_FLOAT64: "float64",
}
DTYPE_ENUMS: dict[str, posenc_pb2.Dtype.ValueType] = {
    "float32": posenc_pb2.DTYPE_FLOAT32,
    "float16": posenc_pb2.DTYPE_FLOAT16,
    "bfloat16": posenc_pb2.DTYPE_BFLOAT16,
    "float64": posenc_pb2.DTYPE_FLOAT64,
}
LAYOUTS: dict[int, Layout] = {
    posenc_pb2.LAYOUT_UNSPECIFIED: Layout.INTERLEAVED,
    posenc_pb2.LAYOUT_INTERLEAVED: Layout.INTERLEAVED,
    posenc_pb2.LAYOUT_SPLIT: Layout.SPLIT,
}
SCHEDULES: dict[int, Schedule] = {
    posenc_pb2.SCHEDULE_UNSPECIFIED: Schedule.PAPER,
    posenc_pb2.SCHEDULE_PAPER: Schedule.PAPER,
    posenc_pb2.SCHEDULE_TENSOR2TENSOR: Schedule.TENSOR2TENSOR,
}


class PositionalEncodingServicer:
    """Implements posenc.v1.PositionalEncodingService over an EncodingService."""

    def __init__(self, service: EncodingService, version: str) -> None:
        self.service = service
        self.version = version
        self._draining = False
        self._in_flight = 0
        self._streams = 0
        self._idle = threading.Condition()
        self._metrics = {
            method: metrics.MethodMetrics(method)
            for method in ("GetEncoding", "StreamEncoding", "GetServerInfo")
        }
        self._publisher = metrics.ServicePublisher()
        self.publish_metrics()
        self._specs: dict[bytes, EncodingSpec] = {}

    def publish_metrics(self) -> None:
        """Bring the cache and computation metrics up to date (called now and then: on
        every call, it would cost the decode steps more than their rows)."""
        self._publisher.publish(self.service.cache_stats(), self.service.rows_computed)

    # Draining -------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new encoding calls with UNAVAILABLE; calls in flight go on."""
        with self._idle:
            self._draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no encoding call is in flight; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def _admit(self, *, stream: bool = False) -> None:
        """Count a call in flight (for the drain), refusing it while draining or at the cap.

        Every admitted call is ended by ``_release``.
        """
        limit = self.service.config.max_concurrent_streams
        with self._idle:
            if self._draining:
                raise ShuttingDownError("the server is shutting down: retry on another replica")
            if stream and self._streams >= limit:
                raise OverloadedError(
                    f"this server process already serves {limit} streams, its limit: "
                    "retry later or on another replica",
                    retry_after_seconds=_STREAM_RETRY_AFTER,
                )
            self._in_flight += 1
            self._streams += stream
        if stream:
            metrics.STREAMS_IN_FLIGHT.inc()

    def _release(self, *, stream: bool = False) -> None:
        if stream:
            metrics.STREAMS_IN_FLIGHT.dec()
        with self._idle:
            self._in_flight -= 1
            self._streams -= stream
            if self._draining:  # only wait_idle waits, and only once draining
                self._idle.notify_all()

    # RPCs -----------------------------------------------------------------------------------

    def GetEncoding(
        self,
        request: posenc_pb2.GetEncodingRequest | MalformedRequest,
        context: grpc.ServicerContext,
    ) -> bytes:
        """Answer a small table in one (serialized GetEncodingResponse) message."""
        response = b""
        method_metrics = self._metrics["GetEncoding"]
        with _Serving(context, method_metrics):
            self._admit()
            try:
                spec, selection = self._parse(_parsed(request))
                self.service.check_unary_size(spec, selection)
                response = _tensor_response(spec, Chunk(0, self.service.table(spec, selection)))
                method_metrics.payload_bytes.inc(len(response))
            finally:
                self._release()
        return response

    def StreamEncoding(
        self,
        request: posenc_pb2.StreamEncodingRequest | MalformedRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[bytes]:
        """Stream a table of any size as row-aligned chunks (serialized responses)."""
        method_metrics = self._metrics["StreamEncoding"]
        with _Serving(context, method_metrics):
            self._admit(stream=True)
            try:
                request = _parsed(request)
                spec, selection = self._parse(request)
                self.service.check_stream_size(spec, selection)
                chunk_rows = self.service.chunk_rows(spec, request.max_chunk_bytes)
                for chunk in self.service.chunks(spec, selection, chunk_rows):
                    message = _tensor_response(spec, chunk)
                    method_metrics.payload_bytes.inc(len(message))
                    yield message
            finally:
                self._release(stream=True)

    def GetServerInfo(
        self,
        request: posenc_pb2.GetServerInfoRequest | MalformedRequest,
        context: grpc.ServicerContext,
    ) -> posenc_pb2.GetServerInfoResponse:
        """Describe this server."""
        with _Serving(context, self._metrics["GetServerInfo"]):
            _parsed(request)
            config = self.service.config
            stats = self.service.cache_stats()
            return posenc_pb2.GetServerInfoResponse(
                version=self.version,
                server_id=self.service.server_id,
                limits=posenc_pb2.Limits(
                    **config.public_limits(),
                    max_receive_message_bytes=config.max_receive_message_bytes,
                ),
                dtypes=list(DTYPE_ENUMS.values()),
                layouts=[posenc_pb2.LAYOUT_INTERLEAVED, posenc_pb2.LAYOUT_SPLIT],
                schedules=[posenc_pb2.SCHEDULE_PAPER, posenc_pb2.SCHEDULE_TENSOR2TENSOR],
                cache=posenc_pb2.CacheStats(
                    hits=stats.hits,
                    misses=stats.misses,
                    evictions=stats.evictions,
                    bytes=stats.bytes,
                    entries=stats.entries,
                    budget_bytes=stats.budget_bytes,
                ),
                rows_computed=self.service.rows_computed,
                presets=_preset_infos(),
            )
        return posenc_pb2.GetServerInfoResponse()  # the client went away mid-call

    # Protobuf -> domain -----------------------------------------------------------------------

    def _parse(
        self, request: posenc_pb2.GetEncodingRequest | posenc_pb2.StreamEncodingRequest
    ) -> tuple[EncodingSpec, Selection]:
        violations: list[FieldViolation] = []
        spec = self._spec(request.spec, violations)
        selection: Selection | None = None
        which = request.WhichOneof("selection")
        if which == "range":
            selection = PositionRange(request.range.start, request.range.stop)
        elif which == "positions":
            selection = PositionList(np.array(request.positions.positions, dtype=np.int64))
        else:
            violations.append(FieldViolation("selection", "set either range or positions"))
        if selection is not None:
            self.service.validate_selection(selection, violations)
        self.service.raise_if_invalid(violations)
        assert spec is not None and selection is not None
        return spec, selection

    def _spec(
        self, proto_spec: posenc_pb2.EncodingSpec, violations: list[FieldViolation]
    ) -> EncodingSpec | None:
        """The spec of a request; None, with ``violations`` added, when it is invalid.

        Decode loops send the same spec over and over: valid specs are remembered by their
        serialized message, which also makes the service's spec id lookup an identity.
        """
        key = proto_spec.SerializeToString(deterministic=True)
        if (known_spec := self._specs.get(key)) is not None:
            return known_spec
        first_violation = len(violations)
        dtype = DTYPE_NAMES.get(proto_spec.dtype)
        if dtype is None:
            violations.append(_unknown("dtype", proto_spec.dtype, DTYPE_NAMES))
        spec: EncodingSpec | None
        if proto_spec.WhichOneof("preset") is not None:
            config = self.service.config
            spec = preset_spec_from_proto(proto_spec, dtype or "float32", config, violations)
        else:
            base = proto_spec.base if proto_spec.HasField("base") else engine.DEFAULT_BASE
            validate_spec(proto_spec.d_model, base, self.service.config.max_d_model, violations)
            layout = LAYOUTS.get(proto_spec.layout)
            schedule = SCHEDULES.get(proto_spec.schedule)
            if layout is None:
                violations.append(_unknown("layout", proto_spec.layout, LAYOUTS))
            if schedule is None:
                violations.append(_unknown("schedule", proto_spec.schedule, SCHEDULES))
            spec = None
            if dtype is not None and layout is not None and schedule is not None:
                d_model = proto_spec.d_model
                spec = EncodingSpec(d_model, base, dtype, layout=layout, schedule=schedule)
        if spec is None or len(violations) > first_violation:
            return None
        if len(self._specs) >= _REMEMBERED_SPECS:
            self._specs.clear()
        self._specs[key] = spec
        return spec


@functools.cache
def _preset_infos() -> tuple[posenc_pb2.PresetInfo, ...]:
    """GetServerInfo's presets (the message copies them, so sharing them is safe)."""
    return tuple(
        posenc_pb2.PresetInfo(
            name=info.name,
            description=info.description,
            parameters=[
                posenc_pb2.PresetParameter(
                    field=parameter.field,
                    description=parameter.description,
                    default=parameter.default,
                )
                for parameter in info.parameters
            ],
        )
        for info in presets.catalog()
    )


def _unknown(name: str, value: int, known: Mapping[int, object]) -> FieldViolation:
    return FieldViolation(f"spec.{name}", f"unknown value {value}; known: {sorted(known)}")


SINUSOIDAL_NAMES: dict[int, str] = {
    posenc_pb2.SINUSOIDAL_PRESET_NAME_VASWANI: "vaswani",
    posenc_pb2.SINUSOIDAL_PRESET_NAME_VASWANI_SPLIT: "vaswani_split",
    posenc_pb2.SINUSOIDAL_PRESET_NAME_TENSOR2TENSOR: "tensor2tensor",
    posenc_pb2.SINUSOIDAL_PRESET_NAME_WHISPER: "whisper",
    posenc_pb2.SINUSOIDAL_PRESET_NAME_FAIRSEQ: "fairseq",
    posenc_pb2.SINUSOIDAL_PRESET_NAME_TRANSFORMER_XL: "transformer_xl",
}
ROPE_TYPES: dict[int, str] = {
    posenc_pb2.ROPE_TYPE_UNSPECIFIED: "default",
    posenc_pb2.ROPE_TYPE_DEFAULT: "default",
    posenc_pb2.ROPE_TYPE_LINEAR: "linear",
    posenc_pb2.ROPE_TYPE_DYNAMIC: "dynamic",
    posenc_pb2.ROPE_TYPE_YARN: "yarn",
    posenc_pb2.ROPE_TYPE_LONGROPE: "longrope",
    posenc_pb2.ROPE_TYPE_LLAMA3: "llama3",
}
ROPE_LAYOUTS: dict[int, str] = {
    posenc_pb2.ROPE_LAYOUT_UNSPECIFIED: "transformers",
    posenc_pb2.ROPE_LAYOUT_TRANSFORMERS: "transformers",
    posenc_pb2.ROPE_LAYOUT_VLLM: "vllm",
    posenc_pb2.ROPE_LAYOUT_GPTJ: "gptj",
}


def preset_spec_from_proto(
    spec: posenc_pb2.EncodingSpec,
    dtype: str,
    limits: ServerConfig,
    violations: list[FieldViolation],
) -> EncodingSpec | None:
    """The EncodingSpec of a request with a preset; None after appending its problems."""
    for field, unspecified in (
        ("layout", posenc_pb2.LAYOUT_UNSPECIFIED),
        ("schedule", posenc_pb2.SCHEDULE_UNSPECIFIED),
    ):
        if getattr(spec, field) != unspecified:
            violations.append(
                FieldViolation(f"spec.{field}", "must be unset with a preset (the preset sets it)")
            )
    before = len(violations)
    parsed: EncodingSpec | None = None
    if spec.WhichOneof("preset") == "sinusoidal":
        sinusoidal = _sinusoidal_request(spec.sinusoidal, violations)
        base = spec.base if spec.HasField("base") else engine.DEFAULT_BASE
        if sinusoidal is not None:
            parsed = presets.sinusoidal_spec(
                sinusoidal, spec.d_model, base, dtype, limits, violations
            )
    else:
        rotary = _rotary_request(spec.rotary, violations)
        if rotary is not None:
            has_base = spec.HasField("base")
            parsed = presets.rotary_spec(rotary, spec.d_model, has_base, dtype, limits, violations)
    return parsed if len(violations) == before else None


def _optional(message: Message, field: str) -> Any:
    """A proto3 optional field's value, None when unset."""
    return getattr(message, field) if message.HasField(field) else None


def _sinusoidal_request(
    message: posenc_pb2.SinusoidalPreset, violations: list[FieldViolation]
) -> presets.SinusoidalRequest | None:
    name = SINUSOIDAL_NAMES.get(message.name)
    if name is None:
        known = ", ".join(f"{value} ({n})" for value, n in SINUSOIDAL_NAMES.items())
        violations.append(
            FieldViolation(
                "spec.sinusoidal.name", f"unknown or unset preset {message.name}; known: {known}"
            )
        )
        return None
    fields = ("min_timescale", "start_index", "padding_idx", "clamp_len", "key_length")
    return presets.SinusoidalRequest(name, **{field: _optional(message, field) for field in fields})


def _rotary_request(
    message: posenc_pb2.RotaryPreset, violations: list[FieldViolation]
) -> presets.RotaryRequest | None:
    rope_type = ROPE_TYPES.get(message.rope_type)
    layout = ROPE_LAYOUTS.get(message.layout)
    for field, value, parsed, known in (
        ("rope_type", message.rope_type, rope_type, ROPE_TYPES),
        ("layout", message.layout, layout, ROPE_LAYOUTS),
    ):
        if parsed is None:
            violations.append(
                FieldViolation(
                    f"spec.rotary.{field}", f"unknown value {value}; known: {sorted(known)}"
                )
            )
    if rope_type is None or layout is None:
        return None
    # The proto fields carry the parameters' names; only those set are passed.
    parameters: dict[str, Any] = {
        field: getattr(message, field)
        for field in presets.ROTARY_PARAMETERS
        if message.HasField(field)
    }
    for field in ("short_factor", "long_factor"):
        if factors := tuple(getattr(message, field)):
            parameters[field] = factors
    return presets.RotaryRequest(rope_type, layout, message.head_dim, parameters)


def add_to_server(servicer: PositionalEncodingServicer, server: grpc.Server) -> None:
    """Register ``servicer`` like the generated function does, with two differences.

    Requests are parsed by tolerant parsers (malformed bytes become INVALID_ARGUMENT), and
    table responses arrive already serialized (see ``posenc._wire``).
    """
    handlers = {
        "GetEncoding": grpc.unary_unary_rpc_method_handler(
            servicer.GetEncoding,
            request_deserializer=_tolerant_parser(posenc_pb2.GetEncodingRequest),
            response_serializer=None,  # the servicer returns serialized responses
        ),
        "StreamEncoding": grpc.unary_stream_rpc_method_handler(
            servicer.StreamEncoding,
            request_deserializer=_tolerant_parser(posenc_pb2.StreamEncodingRequest),
            response_serializer=None,
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo,
            request_deserializer=_tolerant_parser(posenc_pb2.GetServerInfoRequest),
            response_serializer=posenc_pb2.GetServerInfoResponse.SerializeToString,
        ),
    }
    service = posenc_pb2.DESCRIPTOR.services_by_name["PositionalEncodingService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


def _tensor_response(spec: EncodingSpec, chunk: Chunk) -> bytes:
    """A serialized Get/StreamEncodingResponse, encoded by hand to copy the rows only once."""
    rows = np.ascontiguousarray(chunk.rows)
    return encode_tensor_response(
        DTYPE_ENUMS[spec.dtype],
        chunk.row_offset,
        rows.shape[0],
        spec.d_model,
        # Bytes, whatever the dtype: memoryview cannot export bfloat16.
        rows.reshape(-1).view(np.uint8).data,
    )


class _Serving:
    """Records a call in the metrics and turns domain errors into their status codes.

    The one place where errors become codes: anything that is not a domain error is a bug
    and becomes INTERNAL, logged with its traceback. (A class rather than a generator
    context manager: it runs on every call.)
    """

    __slots__ = ("_context", "_metrics", "_started")

    def __init__(
        self, context: grpc.ServicerContext, method_metrics: metrics.MethodMetrics
    ) -> None:
        self._context = context
        self._metrics = method_metrics
        self._started = time.perf_counter()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        error_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        status: grpc.Status | None = None
        if error is None:
            code = "OK"
        elif isinstance(error, InvalidRequestError):
            code, status = "INVALID_ARGUMENT", _bad_request_status(error)
        elif isinstance(error, OverloadedError):
            code, status = "RESOURCE_EXHAUSTED", _overloaded_status(error)
        elif isinstance(error, LimitExceededError):
            code, status = "RESOURCE_EXHAUSTED", _status(code_pb2.RESOURCE_EXHAUSTED, error)
        elif isinstance(error, ShuttingDownError):
            code, status = "UNAVAILABLE", _status(code_pb2.UNAVAILABLE, error)
        elif isinstance(error, GeneratorExit):
            # gRPC closes a stream's generator when the client cancels or its deadline passes.
            code = "CANCELLED"
        elif not isinstance(error, Exception):
            code = "INTERNAL"  # KeyboardInterrupt and the like: let them through
        elif not self._context.is_active():
            code = "CANCELLED"  # the client went away: nothing to answer
        else:
            code = "INTERNAL"
            log.error("unexpected error while serving a request", exc_info=error)
            status = _status(code_pb2.INTERNAL, "internal error; see the server log")
        self._metrics.record(code, time.perf_counter() - self._started)
        if status is not None:
            self._context.abort_with_status(status)  # raises
        # Swallow the error of a client gone mid-call: it has nowhere to go.
        return code == "CANCELLED" and isinstance(error, Exception)


def _status(code: int, message: object) -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(code=code, message=str(message)))


def _overloaded_status(error: OverloadedError) -> grpc.Status:
    # google.rpc.RetryInfo tells clients this RESOURCE_EXHAUSTED is worth retrying (unlike
    # a request over a size limit) and when.
    details = any_pb2.Any()
    details.Pack(
        error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(
                nanos=int(error.retry_after_seconds % 1 * 1e9),
                seconds=int(error.retry_after_seconds),
            )
        )
    )
    return rpc_status.to_status(
        status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(error), details=[details])
    )


def _bad_request_status(error: InvalidRequestError) -> grpc.Status:
    details = any_pb2.Any()
    details.Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=violation.field, description=violation.description
                )
                for violation in error.violations
            ]
        )
    )
    return rpc_status.to_status(
        status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(error), details=[details])
    )
