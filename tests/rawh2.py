"""A raw HTTP/2 gRPC client, as an attacker writes one: headers and frames by hand (``h2``),
no gRPC library to keep it polite. For the attack tests (tests/test_attacks.py)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.settings


@dataclass
class Reply:
    """What came back on one stream so far."""

    headers: dict[str, str] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    trailers: dict[str, str] = field(default_factory=dict)
    ended: bool = False

    @property
    def status(self) -> int | None:
        """The grpc-status (in a trailers-only response or the trailers), if it came."""
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if value is None else int(value)


class RawConnection:
    """One HTTP/2 connection to a gRPC server.

    ``window``: the initial stream flow-control window the client announces (0: the server
    may send no response bytes at all until the client says so, which it never does).
    """

    def __init__(self, host: str, port: int, *, window: int | None = None) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.authority = f"{host}:{port}"
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.conn.local_settings = h2.settings.Settings(client=True)
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.replies: dict[int, Reply] = {}
        self.closed = False
        self._flush()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def call(
        self,
        path: str,
        message: bytes | None = None,
        *,
        metadata: Iterable[tuple[str, str]] = (),
        end: bool = True,
    ) -> int:
        """Open a call on ``path``: its headers, then ``message`` (None: no body at all) and
        the end of the stream unless ``end`` is False. Returns the stream id."""
        stream = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        self.conn.send_headers(stream, headers, end_stream=message is None and end)
        self.replies[stream] = Reply()
        if message is not None:
            frame = struct.pack(">BI", 0, len(message)) + message
            # Within the server's flow-control window: DATA frames of at most 16 KiB.
            for first in range(0, len(frame), 16384):
                last = first + 16384 >= len(frame)
                self._send_data(stream, frame[first : first + 16384], end and last)
        self._flush()
        return stream

    def _send_data(self, stream: int, data: bytes, end: bool) -> None:
        while self.conn.local_flow_control_window(stream) < len(data):
            self._flush()
            self.pump(0.05)
        self.conn.send_data(stream, data, end_stream=end)

    def pump(self, seconds: float = 0.1) -> None:
        """Read what the server sent for ``seconds`` (never acknowledging response data:
        with a zero window the server stays blocked)."""
        deadline = time.monotonic() + seconds
        while not self.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                return
            if not data:
                self.closed = True
                return
            for event in self.conn.receive_data(data):
                self._event(event)
            self._flush()

    def _event(self, event: h2.events.Event) -> None:
        stream = getattr(event, "stream_id", 0)
        reply = self.replies.get(stream)
        if reply is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            reply.headers.update(dict(event.headers))  # type: ignore[arg-type]
        elif isinstance(event, h2.events.TrailersReceived):
            reply.trailers.update(dict(event.headers))  # type: ignore[arg-type]
        elif isinstance(event, h2.events.DataReceived):
            reply.data += event.data
        elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
            reply.ended = True

    def close(self) -> None:
        """Drop the connection without a goodbye."""
        self.sock.close()
        self.closed = True
