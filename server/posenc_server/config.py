"""Server configuration: one frozen dataclass, from command-line flags and POSENC_* variables.

Precedence: a flag beats its environment variable, which beats the embedded default, so
``posenc serve`` alone runs. Every field is a flag ``--field-name`` and a variable
``POSENC_FIELD_NAME``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Final, TypeVar

from posenc_protocol import limits
from posenc_protocol.limits import CLIENT_RECEIVE_LIMIT, GIB, MESSAGE_OVERHEAD, MIB
from posenc_protocol.numbers import integer

T = TypeVar("T")

#: The command's name in its usage and at the start of its one-line errors (``posenc serve``
#: hands the process over to it).
PROGRAM: Final = "posenc-server"
DEFAULT_METRICS_PORT: Final = 9464
"""Prometheus' customary exporter port; on a shared host another server may hold it."""
# A packed int64 takes at most 10 bytes on the wire.
MAX_VARINT_BYTES = 10
# The largest connection age gRPC can take: 2**31 - 1 milliseconds, about 24 days.
_MAX_CONNECTION_AGE_SECONDS = 2_000_000
# gRPC takes its settings (message sizes, the connection limit) as C ints.
_MAX_GRPC_INT = (1 << 31) - 1
# The longest path a unix socket takes (sun_path, less its terminating zero).
_MAX_UNIX_PATH = 107
# The shortest read timeout: a request needs some time to arrive, even on loopback.
_MIN_READ_TIMEOUT_SECONDS = 0.1


def option(default: T, help_text: str) -> T:
    """A setting with its default and its ``--help`` text (a flag and a variable each)."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server can be configured with; the defaults are production defaults."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50051, "gRPC port (0 picks a free one)")
    max_d_model: int = option(limits.MAX_D_MODEL, "largest d_model accepted")
    max_abs_position: int = option(limits.MAX_ABS_POSITION, "largest |position|")
    max_positions: int = option(limits.MAX_POSITIONS, "largest explicit position list")
    max_unary_bytes: int = option(
        limits.MAX_UNARY_BYTES, "largest GetEncoding result in bytes (fits a default client)"
    )
    max_stream_bytes: int = option(
        limits.MAX_STREAM_BYTES, "largest StreamEncoding result in bytes"
    )
    max_chunk_bytes: int = option(
        limits.MAX_CHUNK_BYTES,
        "largest stream chunk in bytes (at most 4 MiB); a client may ask for "
        "smaller ones, down to one row, and pays for each chunk's message and trip: "
        "chunks of a few rows cost hundreds of times the server CPU per row of this "
        "size's",
    )
    cache_bytes: int = option(512 * MIB, "cache budget in bytes")
    spec_bytes: int = option(
        16 * MIB,
        "budget in bytes of the spec table (the frequencies and rotation tables "
        "of recently used specs, up to 4 MiB each)",
    )
    processes: int = option(0, "server processes sharing the port (0: one per available core)")
    workers: int = option(
        64,
        "threads computing tables, per process (calls waiting for their request "
        "or for the client to read hold none)",
    )
    in_flight_bytes: int = option(
        64 * MIB,
        "memory for encoding calls in flight, per process: requests, their "
        "working memory, and responses not yet handed to the client's connection; calls "
        "beyond it wait, then get RESOURCE_EXHAUSTED with RetryInfo",
    )
    admission_wait_seconds: float = option(
        1.0, "how long a call waits for room in in_flight_bytes before it is refused"
    )
    read_timeout_seconds: float = option(
        30.0,
        "a call whose request message has not arrived this long after its "
        "headers is ended with DEADLINE_EXCEEDED",
    )
    max_concurrent_streams: int = option(
        48,
        "streams one process serves at once; more get RESOURCE_EXHAUSTED "
        "(below workers, so unary calls always find a thread to compute on; health "
        "checks need none)",
    )
    max_connections: int = option(
        4096,
        "client connections one process holds at once; more are closed as they "
        "come (each holds memory outside the in-flight budget; 0: no limit)",
    )
    grace_seconds: float = option(30.0, "on SIGTERM, time in-flight calls get to finish")
    max_connection_age_seconds: float = option(
        300.0,
        "close client connections after this long (+30 s for calls in flight), "
        "so clients re-resolve DNS and find new replicas",
    )
    log_level: str = option("INFO", "DEBUG, INFO, WARNING or ERROR")
    metrics_port: int = option(
        DEFAULT_METRICS_PORT,
        "Prometheus metrics HTTP port (0: a free one; -1: off; "
        f"{DEFAULT_METRICS_PORT}, when busy: a free one, logged)",
    )
    metrics_host: str = option(
        "127.0.0.1",
        "address the metrics port listens on (the container image sets 0.0.0.0; "
        "/metrics has no authentication: expose it to Prometheus only)",
    )
    tls_cert_file: str = option("", "PEM certificate chain: serve TLS (with tls_key_file)")
    tls_key_file: str = option("", "PEM private key of tls_cert_file")
    tls_client_ca_file: str = option("", "PEM CA bundle: require client certificates (mutual TLS)")
    auth_token_file: str = option(
        "", "file holding the bearer token clients must send (health is exempt)"
    )
    unix_socket: str = option(
        "",
        "also serve on this unix-domain socket (clients on this machine: target "
        "unix:PATH), as the TCP port is served (TLS and token included); with shm_bytes, "
        "large results travel through shared memory, handed out on PATH.shm. With "
        "several processes, the first serves it",
    )
    shm_bytes: int = option(
        GIB,
        "shared memory for results over the unix socket, in bytes (memory the "
        "server holds: count it in its limit; 0: none)",
    )
    shm_peers: str = option(
        "",
        "who may map the shared memory: comma-separated uid:N and gid:N, checked "
        "against each peer's kernel credentials (none: the server's own uid)",
    )

    def __post_init__(self) -> None:
        problems = [
            *self._size_problems(),
            *self._concurrency_problems(),
            *self._seconds_problems(),
            *self._listener_problems(),
        ]
        if problems:
            raise ValueError("invalid configuration: " + "; ".join(problems))

    def _problem(self, name: str, valid: bool, rule: str) -> list[str]:
        """The problem with setting ``name`` (its flag, variable, rule and value), or none."""
        if valid:
            return []
        return [f"{_flag(name)} ({_env_name(name)}) {rule}, got {getattr(self, name)!r}"]

    def _size_problems(self) -> list[str]:
        """The table sizes, positions and byte budgets out of their ranges."""
        check = self._problem
        # A unary result is one gRPC message, whose size gRPC takes as a C int.
        largest_unary = _MAX_GRPC_INT - MESSAGE_OVERHEAD
        return [
            *check("max_d_model", 1 <= self.max_d_model <= 1 << 20, "must be in 1..1048576"),
            *check(
                "max_abs_position",
                0 <= self.max_abs_position <= 1 << 52,
                "must be in 0..2**52 (exact in float64)",
            ),
            *check("max_positions", 1 <= self.max_positions <= 1 << 26, "must be in 1..2**26"),
            *check(
                "max_chunk_bytes",
                self.max_d_model * 8 <= self.max_chunk_bytes <= CLIENT_RECEIVE_LIMIT,
                f"must hold one float64 row of max_d_model ({self.max_d_model * 8} bytes) "
                "and be at most 4 MiB",
            ),
            *check(
                "in_flight_bytes",
                self.max_receive_message_bytes <= self.in_flight_bytes <= 1 << 50,
                f"must hold the largest request ({self.max_receive_message_bytes} bytes, "
                "from max_positions) and be at most 2**50",
            ),
            *check(
                "max_unary_bytes",
                0 <= self.max_unary_bytes <= largest_unary,
                f"must be in 0..{largest_unary} (one gRPC message)",
            ),
            *(
                problem
                for name in ("max_stream_bytes", "cache_bytes", "spec_bytes", "shm_bytes")
                for problem in check(
                    name, 0 <= getattr(self, name) <= 1 << 50, "must be in 0..2**50"
                )
            ),
        ]

    def _concurrency_problems(self) -> list[str]:
        """The process, thread, stream and connection counts out of their ranges."""
        check = self._problem
        return [
            *check("processes", 0 <= self.processes <= 256, "must be in 0..256"),
            *check("workers", 1 <= self.workers <= 4096, "must be in 1..4096"),
            *check(
                "max_concurrent_streams",
                1 <= self.max_concurrent_streams < self.workers,
                f"must be between 1 and workers - 1 ({self.workers - 1})",
            ),
            *check(
                "max_connections",
                0 <= self.max_connections <= _MAX_GRPC_INT,
                f"must be 0 (no limit) or at most {_MAX_GRPC_INT}",
            ),
        ]

    def _seconds_problems(self) -> list[str]:
        """The durations that are not finite or out of their ranges."""

        def seconds(name: str, low: float, high: float, *, above_low: bool) -> list[str]:
            """``name`` in (low, high] when ``above_low``, else in [low, high]."""
            value = getattr(self, name)
            valid = math.isfinite(value) and (value > low if above_low else value >= low)
            bounds = f"{'(' if above_low else '['}{low:g}, {high}]"
            return self._problem(
                name, valid and value <= high, f"must be a number of seconds in {bounds}"
            )

        return [
            *seconds("admission_wait_seconds", 0, 3600, above_low=True),
            *seconds("read_timeout_seconds", _MIN_READ_TIMEOUT_SECONDS, 3600, above_low=False),
            # gRPC takes the age in milliseconds as a C int.
            *seconds("max_connection_age_seconds", 0, _MAX_CONNECTION_AGE_SECONDS, above_low=True),
            *seconds("grace_seconds", 0, 86400, above_low=False),
        ]

    def _listener_problems(self) -> list[str]:
        """The ports, addresses, TLS files, shared-memory peers and log level that are
        wrong, alone or together."""
        check = self._problem
        problems = [
            *check("port", 0 <= self.port <= 65535, "must be in 0..65535"),
            *check("metrics_port", -1 <= self.metrics_port <= 65535, "must be in -1..65535"),
            # An empty host binds every interface: the unauthenticated metrics must not end
            # up there by a variable set to nothing.
            *check(
                "metrics_host",
                bool(self.metrics_host.strip()),
                "must name an address (0.0.0.0 or :: for every interface)",
            ),
            # The region socket's path is the unix socket's plus ".shm"; a socket path is
            # at most 107 bytes.
            *check(
                "unix_socket",
                len(os.fsencode(self.unix_socket)) <= _MAX_UNIX_PATH - len(".shm")
                and "\0" not in self.unix_socket,
                f"must be a path of at most {_MAX_UNIX_PATH - len('.shm')} bytes",
            ),
            *check(
                "log_level",
                self.log_level.upper() in {"DEBUG", "INFO", "WARNING", "ERROR"},
                "must be DEBUG, INFO, WARNING or ERROR",
            ),
        ]
        try:
            shm_peers(self.shm_peers)
        except ValueError as error:
            problems.append(f"{_flag('shm_peers')} ({_env_name('shm_peers')}): {error}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            problems.append("--tls-cert-file and --tls-key-file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            problems.append("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        return problems

    @property
    def process_count(self) -> int:
        """Server processes to run: ``processes``, or one per core this process may use."""
        return self.processes or len(os.sched_getaffinity(0))

    @property
    def address(self) -> str:
        """The host:port the server binds (IPv6 hosts bracketed)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def max_receive_message_bytes(self) -> int:
        """Large enough for the largest accepted request: a full position list."""
        return self.max_positions * MAX_VARINT_BYTES + MESSAGE_OVERHEAD

    @property
    def max_send_message_bytes(self) -> int:
        """Large enough for the largest unary result or stream chunk."""
        return max(self.max_unary_bytes, self.max_chunk_bytes) + MESSAGE_OVERHEAD

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Build from flags (``argv``, default none) over ``POSENC_*`` variables over defaults.

        Raises ValueError naming the flag or variable when a value is malformed or invalid.
        """
        environ = os.environ if environ is None else environ
        parser = argparse.ArgumentParser(
            prog=PROGRAM,
            description="Serve positional-encoding tables over gRPC.",
            epilog="Every flag can also be set as POSENC_<FLAG> (e.g. POSENC_PORT=50052).",
        )
        for spec in dataclasses.fields(cls):
            default = "none" if spec.default == "" else spec.default
            parser.add_argument(
                _flag(spec.name),
                dest=spec.name,
                type=str,
                default=None,
                metavar=spec.name.upper(),
                help=f"{spec.metadata['help']} (default {default}; env {_env_name(spec.name)})",
            )
        parsed = parser.parse_args(list(argv or []))
        values: dict[str, Any] = {}
        for spec in dataclasses.fields(cls):
            raw = getattr(parsed, spec.name)
            source = _flag(spec.name)
            if raw is None and _env_name(spec.name) in environ:
                raw, source = environ[_env_name(spec.name)], _env_name(spec.name)
            if raw is None:
                continue
            try:
                values[spec.name] = _convert(spec.type, raw)
            except ValueError as error:
                raise ValueError(f"{source}: {error}") from None
        return cls(**values)

    def public_limits(self) -> dict[str, int]:
        """The limits clients should know, by name."""
        return {
            "max_d_model": self.max_d_model,
            "max_abs_position": self.max_abs_position,
            "max_positions": self.max_positions,
            "max_unary_bytes": self.max_unary_bytes,
            "max_stream_bytes": self.max_stream_bytes,
            "max_chunk_bytes": self.max_chunk_bytes,
        }


def shm_peers(text: str) -> tuple[frozenset[int], frozenset[int]]:
    """The uids and gids of ``--shm-peers``: comma-separated ``uid:N`` and ``gid:N``
    (empty: the server's own uid). ValueError names a malformed entry."""
    uids: set[int] = set()
    gids: set[int] = set()
    for entry in filter(None, (part.strip() for part in text.split(","))):
        kind, _, number = entry.partition(":")
        if kind not in ("uid", "gid") or not number.isdigit():
            raise ValueError(f"expected uid:N or gid:N entries, got {entry!r}")
        (uids if kind == "uid" else gids).add(int(number))
    if not uids and not gids:
        uids.add(os.getuid())
    return frozenset(uids), frozenset(gids)


def _env_name(name: str) -> str:
    return "POSENC_" + name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(type_name: object, raw: object) -> object:
    text = str(raw)
    if type_name == "int":
        try:
            return integer(text)
        except ValueError:
            raise ValueError(
                f"expected an integer (e.g. 536870912, 2**29, 512MiB, 1GiB), got {text!r}"
            ) from None
    if type_name == "float":
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(f"expected a finite number, got {text!r}")
        return number
    return text


def version() -> str:
    """The installed posenc version."""
    try:
        return metadata.version("posenc")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


def startup_fields(config: ServerConfig, port: int, metrics_port: int | None) -> dict[str, object]:
    """What the startup log line says: address, version, limits, and the metrics port
    (None: a worker's, whose supervisor serves the metrics and names the port)."""
    fields: dict[str, object] = {"address": f"{config.host}:{port}", "port": port}
    if metrics_port is not None:
        fields.update(metrics_port=metrics_port, metrics_host=config.metrics_host)
    return fields | {
        "version": version(),
        "limits": config.public_limits(),
        "cache_bytes": config.cache_bytes,
        "workers": config.workers,
        "grace_seconds": config.grace_seconds,
    }
