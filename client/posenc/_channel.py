"""Where calls go and how: targets (round robin over replicas), channel options, the
client's validated settings, and the RPC methods on a channel, sync or asyncio alike."""

from __future__ import annotations

import ipaddress
import itertools
import math
import operator
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from posenc._query import check_chunk_bytes
from posenc._retry import resolve_timeout
from posenc._shm import region_socket
from posenc._version import __version__
from posenc_protocol import wire
from posenc_protocol.v1 import posenc_pb2 as pb

DEFAULT_TARGET: Final = "127.0.0.1:50051"
#: Results up to this size use the unary GetEncoding (one round trip, the decode-loop
#: case); larger ones stream. Well under the server's 4 MiB unary limit, so a unary
#: response never makes the caller wait for megabytes before seeing the first row.
DEFAULT_UNARY_MAX_BYTES: Final = 1 << 20

# The largest unary response the server may be configured for, with headroom; chunks are
# at most 4 MiB. gRPC's own 4 MiB default would reject a server with a raised limit.
_MAX_RECEIVE_BYTES: Final = 64 << 20
# 1,048,576 positions at up to 10 varint bytes each (negative int64) is ~10.5 MB.
_MAX_SEND_BYTES: Final = 32 << 20
# gRPC reconnects to a failed server with 1 s initial, 120 s max backoff by default, and
# while it waits, calls fail at once without trying: a restarted replica could stay
# unreachable for the channel well past the retry budget. Reconnecting at least every
# 0.5 s lets the channel see a restarted server within a second, so the retries ride out
# a restart that ends before their sleeps do.
_RECONNECT_OPTIONS: Final = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)
#: HTTP/2 keepalive pings while calls are in flight: a server (or balancer) that vanishes
#: without a reset (its host or container network gone) is seen within about 30 s, and the
#: call fails UNAVAILABLE (a stream resumes elsewhere) instead of waiting on a connection
#: nothing answers. Pings go on while no data comes (a stream waiting on a slow replica):
#: the server accepts them every 10 s.
KEEPALIVE_OPTIONS: Final = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # gRPC waits this long for any ping's answer (a minute by default, whatever the above).
    ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
)
#: Connections a client opens to each server address. A server's worker processes share its
#: port (SO_REUSEPORT), and the kernel hands each *connection* to one of them at random, so
#: a client reaches only the processes its connections landed on. Eight make it unlikely
#: that a client's calls crowd onto few of a server's processes (all onto one of two:
#: 2 ** -7) while keeping the connections per client few.
DEFAULT_CONNECTIONS: Final = 8
#: The most a connection holds to read into (the server caps its own the same way).
READ_BUFFER_BYTES: Final = 64 << 10
_MAX_CONNECTIONS: Final = 64


def user_agent() -> str:
    """The SDK's gRPC user agent, so server logs can tell SDK versions apart."""
    return f"posenc-python/{__version__}"


DEFAULT_PORT: Final = 50051
# Schemes of gRPC's name resolvers; anything else with "://" is a URL, not a target.
_GRPC_SCHEMES: Final = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")


def with_port(target: str) -> str:
    """``target`` as ``host:port``: port 50051 when it names none, IPv6 in brackets.

    The one rule for every target the SDK and the CLI take, alone or in a list.
    """
    if "://" in target:
        raise ValueError(
            f"target {target!r} is a URL: give host:port (or a gRPC URI, dns:///host:port)"
        )
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        port = rest.removeprefix(":") if rest else str(DEFAULT_PORT)
    elif target.count(":") > 1:  # a bare IPv6 address has no room for a port
        host, port = target, str(DEFAULT_PORT)
    else:
        host, colon, port = target.partition(":")
        port = port if colon else str(DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {target!r} is not host:port")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host_port(target: str) -> tuple[str, int]:
    if target.startswith("["):
        host, sep, port = target[1:].partition("]:")
    else:
        host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"target {target!r} is not host:port")
    return host, int(port)


def _resolve(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    # One family per host: IPv4 when it has any (what servers listen on by default).
    v4 = [a for a in addresses if a.version == 4]
    return list(dict.fromkeys(v4 or addresses))


def is_uri(target: str) -> bool:
    """Whether ``target`` is a gRPC URI (``dns:///h:p``, ``ipv4:a:p,b:q``, ...), not host:port."""
    return target.startswith(_GRPC_SCHEMES)


def channel_target(target: str | Sequence[str]) -> str:
    """The gRPC target for one or several server addresses.

    One target is used as given (``host:port``, port 50051 when it has none, or any gRPC
    URI such as ``dns:///host:port``), and gRPC resolves it. Several ``host:port`` targets
    become one static address list, ``ipv4:a:p,b:q`` (or ``ipv6:``), which the channel's
    round_robin policy spreads calls over; hostnames are resolved here, once, because those
    URIs take IP literals only.
    """
    if isinstance(target, int) and not isinstance(target, bool):  # Client(50051): a port
        raise TypeError(
            f"target must be 'host:port' (or a list of them), got the number {target!r}: "
            f"for a port on this machine, Client('127.0.0.1:{target}')"
        )
    if not isinstance(target, str | Sequence):
        raise TypeError(f"target must be 'host:port' (or a list of them), got {target!r}")
    targets = [target] if isinstance(target, str) else list(target)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"target must be a non-empty string or sequence of them, got {target!r}")
    if len(targets) == 1:
        return targets[0] if is_uri(targets[0]) else with_port(targets[0])
    addresses: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] = []
    for t in targets:
        if is_uri(t):
            raise ValueError(f"several targets must each be host:port, got {t!r}")
        host, port = _split_host_port(with_port(t))
        addresses.extend((address, port) for address in _resolve(host, port))
    if all(a.version == 4 for a, _ in addresses):
        return "ipv4:" + ",".join(f"{a}:{p}" for a, p in addresses)
    # Mixed families: IPv4 addresses become v4-mapped IPv6 ones (dual-stack sockets).
    mapped = [a if a.version == 6 else ipaddress.IPv6Address(f"::ffff:{a}") for a, _ in addresses]
    return "ipv6:" + ",".join(f"[{a}]:{p}" for a, (_, p) in zip(mapped, addresses, strict=True))


def channel_options(
    user_options: Iterable[tuple[str, Any]] | None, user_agent: str
) -> list[tuple[str, Any]]:
    """Channel options: the SDK's, overridden by any the caller passes."""
    options: dict[str, Any] = {
        "grpc.lb_policy_name": "round_robin",
        "grpc.max_receive_message_length": _MAX_RECEIVE_BYTES,
        "grpc.max_send_message_length": _MAX_SEND_BYTES,
        "grpc.primary_user_agent": user_agent,
        # Channels share one connection per address by default (gRPC's global subchannel
        # pool); each of a client's channels has its own, so that each is a connection.
        "grpc.use_local_subchannel_pool": 1,
        # gRPC grows a connection's read buffer with its largest reads (megabytes while a
        # stream arrives) and keeps it: capped, a client holds no megabytes per idle
        # connection, and large streams arrive no slower for it.
        "grpc.experimental.tcp_max_read_buffer_size": READ_BUFFER_BYTES,
        **dict(_RECONNECT_OPTIONS),
        **dict(KEEPALIVE_OPTIONS),
    }
    options.update(dict(user_options or ()))
    return list(options.items())


@dataclass(frozen=True)
class Settings:
    """A client's validated constructor arguments, shared by Client and AsyncClient."""

    target: str
    timeout: float | None
    max_retries: int
    retry_backoff: float
    chunk_bytes: int | None
    unary_max_bytes: int
    connections: int
    options: list[tuple[str, Any]]
    #: The server's region socket (see :mod:`posenc._shm`), when results may travel
    #: through its shared memory.
    shared_memory: str | None = None

    @classmethod
    def create(
        cls,
        target: str | Sequence[str],
        *,
        timeout: float | None,
        max_retries: int,
        retry_backoff: float,
        chunk_bytes: int | None,
        unary_max_bytes: int,
        connections: int,
        options: Iterable[tuple[str, Any]] | None,
        shared_memory: bool | None = None,
    ) -> Settings:
        retries = _at_least_zero("max_retries", max_retries)
        if not (math.isfinite(retry_backoff) and retry_backoff >= 0):
            raise ValueError(f"retry_backoff must be >= 0, got {retry_backoff}")
        unary_max = _at_least_zero("unary_max_bytes", unary_max_bytes)
        pool = operator.index(connections)
        if not 1 <= pool <= _MAX_CONNECTIONS:
            raise ValueError(f"connections must be in 1..{_MAX_CONNECTIONS}, got {connections}")
        channel = channel_target(target)
        regions = region_socket(channel)
        if shared_memory and regions is None:
            raise ValueError(
                "shared_memory=True needs a unix: target (a server on this machine), "
                f"got {channel!r}"
            )
        return cls(
            target=channel,
            timeout=resolve_timeout(timeout, None),
            max_retries=retries,
            retry_backoff=float(retry_backoff),
            chunk_bytes=check_chunk_bytes(chunk_bytes),
            unary_max_bytes=unary_max,
            connections=pool,
            options=channel_options(options, user_agent()),
            shared_memory=regions if shared_memory is not False else None,
        )


def _at_least_zero(name: str, value: int) -> int:
    """``value`` as an int, refused when negative."""
    number = operator.index(value)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return number


def channel_credentials(
    credentials: grpc.ChannelCredentials | None, token: str | None
) -> grpc.ChannelCredentials | None:
    """The channel's credentials: ``credentials``, carrying ``token`` as call credentials.

    gRPC attaches call credentials only to channels that protect them: TLS, or local
    credentials (``grpc.local_channel_credentials()``), whose connections gRPC checks are
    to this machine. A token is never sent in the clear over a network.
    """
    if not token:
        return credentials
    if credentials is None:
        raise ValueError(
            "token= is sent only over TLS: pass credentials=grpc.ssl_channel_credentials(...), "
            "or credentials=grpc.local_channel_credentials() for a server on this machine "
            "(plaintext over loopback)"
        )
    return grpc.composite_channel_credentials(
        credentials, grpc.access_token_call_credentials(token)
    )


class Calls:
    """The RPC methods the SDK calls, on a channel: sync or asyncio alike.

    The table methods parse their responses with :mod:`posenc_protocol.wire` (zero-copy views of the
    payload); the others with the generated classes.
    """

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        service = "/posenc.v1.PositionalEncodingService/"
        request = pb.GetEncodingRequest.SerializeToString
        self.get_encoding: Any = _rpc(
            channel.unary_unary, service + "GetEncoding", request, wire.decode_tensor_response
        )
        # The same, for requests that may have their rows placed in shared memory.
        self.get_encoding_shared: Any = _rpc(
            channel.unary_unary, service + "GetEncoding", request, wire.decode_unary_response
        )
        self.stream_encoding: Any = _rpc(
            channel.unary_stream,
            service + "StreamEncoding",
            pb.StreamEncodingRequest.SerializeToString,
            wire.decode_tensor_response,
        )
        self.get_server_info: Any = _rpc(
            channel.unary_unary,
            service + "GetServerInfo",
            pb.GetServerInfoRequest.SerializeToString,
            pb.GetServerInfoResponse.FromString,
        )
        self.health_check: Any = _rpc(
            channel.unary_unary,
            "/grpc.health.v1.Health/Check",
            health_pb2.HealthCheckRequest.SerializeToString,
            health_pb2.HealthCheckResponse.FromString,
        )


def _rpc(
    kind: Callable[..., Any],
    method: str,
    serialize: Callable[[Any], bytes],
    deserialize: Callable[[bytes], Any],
) -> Any:
    """The channel's callable of ``method`` (``kind``: its ``unary_unary`` or
    ``unary_stream``), requests serialised and responses parsed as given."""
    return kind(method, request_serializer=serialize, response_deserializer=deserialize)


class Pool:
    """A client's channels (one connection each to every server address) and how calls
    pick one: round robin, or, for calls with an ``affinity``, always the same channel.

    Round robin spreads a client's calls over the server processes its connections reached.
    Affinity keeps a decode loop on one connection, so on one process, whose cache holds
    the blocks its next steps need (spread over processes, each would compute those
    blocks), and sends a range asked for again where its blocks are cached. The clients
    make it the table's and the caller's (a thread, a task), so that loops of several
    threads still spread.
    """

    def __init__(self, calls: Sequence[Calls]) -> None:
        self._calls = tuple(calls)
        # itertools.count is one C call: threads sharing the client each get their own turn.
        self._turns = itertools.count()

    def pick(self, affinity: int | None = None) -> Calls:
        """The calls of the next channel, or of the one that ``affinity`` keeps."""
        if affinity is None:
            return self._calls[next(self._turns) % len(self._calls)]
        return self._calls[affinity % len(self._calls)]
