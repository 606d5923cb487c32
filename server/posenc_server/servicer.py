"""The gRPC servicer: each handler converts its request, resolves the spec, calls the service.

Status codes, metrics and authentication are ``interceptors``'; admission, limits and the
wire format are the service's.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from posenc.v1 import posenc_pb2 as pb
from posenc_server import convert
from posenc_server.config import ServerConfig
from posenc_server.convert import MalformedRequest
from posenc_server.service import EncodingService
from posenc_server.specs import SpecTable

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PositionalEncodingService"].full_name


class PositionalEncodingServicer:
    """Implements posenc.v1.PositionalEncodingService over an EncodingService."""

    def __init__(
        self, config: ServerConfig, specs: SpecTable, service: EncodingService, version: str
    ) -> None:
        self._config = config
        self._specs = specs
        self._service = service
        self._version = version

    def GetEncoding(
        self, request: pb.GetEncodingRequest | MalformedRequest, context: grpc.ServicerContext
    ) -> bytes:
        """A small table in one (serialized GetEncodingResponse) message."""
        query = convert.encoding_query(request, self._config)
        return self._service.unary(self._specs.resolve(query))

    def StreamEncoding(
        self, request: pb.StreamEncodingRequest | MalformedRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """A table of any size as row-aligned chunks (serialized responses)."""
        query = convert.encoding_query(request, self._config)
        return self._service.stream(self._specs.resolve(query))

    def GetServerInfo(
        self, request: pb.GetServerInfoRequest | MalformedRequest, context: grpc.ServicerContext
    ) -> pb.GetServerInfoResponse:
        """Describe this server."""
        convert.parsed(request)
        return convert.server_info_response(self._service.info(self._version))


def add_to_server(servicer: PositionalEncodingServicer, server: grpc.Server) -> None:
    """Register ``servicer`` like the generated function does, with two differences.

    Requests are parsed by tolerant parsers (malformed bytes become INVALID_ARGUMENT), and
    table responses leave already serialized (``posenc.wire``).
    """
    handlers = {
        "GetEncoding": grpc.unary_unary_rpc_method_handler(
            servicer.GetEncoding,
            request_deserializer=convert.tolerant_parser(pb.GetEncodingRequest),
            response_serializer=None,  # the servicer returns serialized responses
        ),
        "StreamEncoding": grpc.unary_stream_rpc_method_handler(
            servicer.StreamEncoding,
            request_deserializer=convert.tolerant_parser(pb.StreamEncodingRequest),
            response_serializer=None,
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo,
            request_deserializer=convert.tolerant_parser(pb.GetServerInfoRequest),
            response_serializer=pb.GetServerInfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
