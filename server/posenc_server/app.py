"""Process wiring: gRPC server, health, reflection, logging, signals and graceful drain."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from importlib import metadata
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from posenc.v1 import posenc_pb2
from posenc_server.config import ServerConfig
from posenc_server.service import EncodingService
from posenc_server.servicer import PositionalEncodingServicer, add_to_server

log = logging.getLogger("posenc_server")

SERVICE_NAME = posenc_pb2.DESCRIPTOR.services_by_name["PositionalEncodingService"].full_name


def version() -> str:
    """The installed posenc version."""
    try:
        return metadata.version("posenc")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with any ``extra={"fields": {...}}`` merged in."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str) -> None:
    """Send structured logs to stderr at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


@dataclass
class RunningServer:
    """A started server and what is needed to drain and stop it."""

    config: ServerConfig
    port: int
    server: grpc.Server
    servicer: PositionalEncodingServicer
    health: health.HealthServicer

    @property
    def target(self) -> str:
        """Where clients on this machine reach the server."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    def shutdown(self, grace: float | None = None) -> bool:
        """Drain, then stop. Returns True when every in-flight call finished within the grace.

        Health turns NOT_SERVING first, so balancers and probes move traffic away; new encoding
        calls get UNAVAILABLE; calls in flight (streams included) get ``grace`` seconds to end.
        """
        grace = self.config.grace_seconds if grace is None else grace
        deadline = time.monotonic() + grace
        self.health.enter_graceful_shutdown()
        self.servicer.begin_drain()
        drained = self.servicer.wait_idle(grace)
        self.server.stop(max(0.0, deadline - time.monotonic())).wait()
        return drained


def start_server(config: ServerConfig) -> RunningServer:
    """Start serving ``config`` in background threads and return the running server."""
    service = EncodingService(config)
    servicer = PositionalEncodingServicer(service, version())
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="posenc"),
        options=[
            ("grpc.max_receive_message_length", config.max_receive_message_bytes),
            ("grpc.max_send_message_length", config.max_send_message_bytes),
            # A second server on a busy port must fail rather than share it silently.
            ("grpc.so_reuseport", 0),
        ],
    )
    add_to_server(servicer, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(config.address)
    if port == 0:
        raise OSError(f"cannot listen on {config.address}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(config, port, server, servicer, health_servicer)


def run(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then drain; the exit code of ``posenc serve``."""
    try:
        config = ServerConfig.from_args(argv)
    except ValueError as error:
        print(f"posenc serve: {error}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    try:
        running = start_server(config)
    except (OSError, RuntimeError) as error:
        log.error("cannot start", extra={"fields": {"address": config.address}})
        print(f"posenc serve: cannot listen on {config.address}: {error}", file=sys.stderr)
        return 1
    log.info(
        "listening",
        extra={
            "fields": {
                "address": f"{config.host}:{running.port}",
                "port": running.port,
                "version": version(),
                "limits": config.public_limits(),
                "cache_bytes": config.cache_bytes,
                "workers": config.workers,
                "grace_seconds": config.grace_seconds,
            }
        },
    )
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Any thread may receive the signal, and then a blocked main thread is not woken: poll, so
    # that the Python handler (which only runs on the main thread) runs within a moment.
    while not stop.wait(0.2):
        pass
    log.info("draining", extra={"fields": {"signal": received[0], "grace": config.grace_seconds}})
    drained = running.shutdown()
    log.info("stopped", extra={"fields": {"drained": drained}})
    return 0
