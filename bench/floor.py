"""The raw gRPC floor: what Python gRPC moves with no encoding work and no protobuf at all.

Server (``python -m bench.floor --port P``): a generic handler with identity (de)serializers
that answers from pre-built ``bytes``:

- ``/bench.Floor/Stream``, request ``b"<n>"``: ``n`` bytes as 1 MiB messages (last partial);
- ``/bench.Floor/Unary``, request ``b""`` -> ``b""`` (the empty call), ``b"<n>"`` -> ``n`` bytes.

It binds with ``grpc.so_reuseport`` so several processes can share one port, as posenc's
worker processes would. The client uses the SDK's own channel options and copies what it
receives into numpy arrays the way the SDK does, so the two differ only by posenc's work.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from bench.common import MIB

SERVICE = "bench.Floor"
STREAM = f"/{SERVICE}/Stream"
UNARY = f"/{SERVICE}/Unary"
MESSAGE_BYTES = MIB
_MAX_MESSAGE = 64 * MIB


class _Payloads:
    """Pre-built payloads by size, so serving never builds bytes on the hot path."""

    def __init__(self) -> None:
        self._by_size: dict[int, bytes] = {}
        self._lock = threading.Lock()
        full = np.random.default_rng(0).integers(0, 256, MESSAGE_BYTES, dtype=np.uint8)
        self._full = full.tobytes()
        for size in (0, 16 * 1024, MESSAGE_BYTES):
            self.get(size)

    def get(self, size: int) -> bytes:
        payload = self._by_size.get(size)
        if payload is None:
            with self._lock:
                reps = -(-size // MESSAGE_BYTES) if size else 0
                payload = (self._full * max(reps, 1))[:size]
                self._by_size[size] = payload
        return payload


_payloads: _Payloads | None = None


def _size(request: bytes) -> int:
    if not request:
        return 0
    size = int(request)
    if not 0 <= size <= 1 << 40:
        raise ValueError(f"bad size {size}")
    return size


def _stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    assert _payloads is not None
    remaining = _size(request)
    full = _payloads.get(MESSAGE_BYTES)
    while remaining >= MESSAGE_BYTES:
        yield full
        remaining -= MESSAGE_BYTES
    if remaining:
        yield _payloads.get(remaining)


def _unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    if not request:
        return b""
    assert _payloads is not None
    return _payloads.get(min(_size(request), _MAX_MESSAGE))


def serve(port: int, workers: int) -> int:
    """Serves until SIGTERM/SIGINT; logs ``{"message": "listening", "port": N}`` to stderr."""
    global _payloads
    _payloads = _Payloads()
    handlers = {
        "Stream": grpc.unary_stream_rpc_method_handler(
            _stream, request_deserializer=None, response_serializer=None
        ),
        "Unary": grpc.unary_unary_rpc_method_handler(
            _unary, request_deserializer=None, response_serializer=None
        ),
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if not bound:
        print(json.dumps({"message": "cannot listen", "port": port}), file=sys.stderr)
        return 1
    server.start()
    print(json.dumps({"message": "listening", "port": bound}), file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    server.stop(0.5).wait()
    return 0


# -- client ----------------------------------------------------------------------------------


def sdk_channel_options() -> list[tuple[str, Any]]:
    """The channel options of a default ``posenc.Client``."""
    try:
        from posenc import _channel

        return list(_channel.channel_options(None, _channel.user_agent()))
    except (ImportError, AttributeError, TypeError):  # the SDK moved them: ask a client
        import posenc

        client = posenc.Client("127.0.0.1:1")
        try:
            return list(client._core.settings.options)
        finally:
            client.close()


class FloorClient:
    """Calls the floor server like the SDK calls posenc: same channel options, numpy copies."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, options=sdk_channel_options())
        self._targets: dict[int, npt.NDArray[np.uint8]] = {}
        self._stream = self.channel.unary_stream(
            STREAM, request_serializer=None, response_deserializer=None
        )
        self._unary = self.channel.unary_unary(
            UNARY, request_serializer=None, response_deserializer=None
        )

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)
        self.empty(timeout=timeout)

    def get(self, nbytes: int, timeout: float = 600.0) -> npt.NDArray[np.uint8]:
        """``nbytes`` streamed into one array, every byte copied once: the least any client
        must do. The array is allocated and touched once per size and reused, so the
        floor pays no page faults (a fresh array would add them to the floor's time)."""
        out = self._targets.get(nbytes)
        if out is None:
            out = self._targets[nbytes] = np.ones(nbytes, dtype=np.uint8)
        offset = 0
        for message in self._stream(str(nbytes).encode(), timeout=timeout):
            size = len(message)
            out[offset : offset + size] = np.frombuffer(message, dtype=np.uint8)
            offset += size
        if offset != nbytes:
            raise RuntimeError(f"floor stream sent {offset} of {nbytes} bytes")
        return out

    def touch(self, nbytes: int) -> None:
        """Allocate and touch ``get``'s target array of ``nbytes`` without a call: a new
        client's first stream then pays what a new connection does, and no page faults."""
        self._targets.setdefault(nbytes, np.ones(nbytes, dtype=np.uint8))

    def stream_until(self, nbytes: int, start: float, end: float) -> int:
        """Streams ``nbytes`` again and again until monotonic ``end``, each message copied
        into a new array (like iter_range); returns the bytes that arrived after ``start``."""
        counted = 0
        while time.monotonic() < end:
            call = self._stream(str(nbytes).encode(), timeout=max(1.0, end - time.monotonic()) + 60)
            try:
                for message in call:
                    np.frombuffer(message, dtype=np.uint8).copy()
                    now = time.monotonic()
                    if now >= end:
                        break
                    if now >= start:
                        counted += len(message)
            finally:
                call.cancel()  # type: ignore[no-untyped-call]
        return counted

    def empty(self, timeout: float = 30.0) -> None:
        """The empty unary call: ``b""`` -> ``b""``."""
        self._unary(b"", timeout=timeout)

    def unary(self, nbytes: int, timeout: float = 30.0) -> npt.NDArray[np.uint8]:
        """A unary call answered with ``nbytes`` pre-built bytes, copied into a new array."""
        message = self._unary(str(nbytes).encode(), timeout=timeout)
        return np.frombuffer(message, dtype=np.uint8).copy()


def main() -> int:
    parser = argparse.ArgumentParser(description="the raw gRPC floor server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    return serve(args.port, args.workers)


if __name__ == "__main__":
    sys.exit(main())
