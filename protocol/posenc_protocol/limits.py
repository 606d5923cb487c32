"""The server's default limits, which the SDK's test transport answers with too.

A server may be configured with others; a client learns a server's own from
``GetServerInfo``.
"""

from __future__ import annotations

from typing import Final

MIB: Final = 1 << 20
GIB: Final = 1 << 30

CLIENT_RECEIVE_LIMIT: Final = 4 * MIB
"""What a default gRPC client accepts in one message."""
MESSAGE_OVERHEAD: Final = 16 * 1024
"""Room for the protobuf framing around a payload (a few dozen bytes in practice)."""

MAX_D_MODEL: Final = 65536
"""Widest table."""
MAX_ABS_POSITION: Final = 1 << 42
"""Largest ``|position|``: millisecond timestamps fit."""
MAX_POSITIONS: Final = 1 << 20
"""Longest explicit position list."""
MAX_UNARY_BYTES: Final = CLIENT_RECEIVE_LIMIT - MESSAGE_OVERHEAD
"""Largest ``GetEncoding`` result: it fits a default client's receive limit."""
MAX_STREAM_BYTES: Final = 16 * GIB
"""Largest ``StreamEncoding`` result."""
MAX_CHUNK_BYTES: Final = MIB
"""Largest stream chunk."""
