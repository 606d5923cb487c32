"""The region socket's messages: how a server hands its shared memory to a client on the
same machine (``posenc_server.shm``, ``posenc._shm``).

The socket is ``SOCK_SEQPACKET``: one message per send. The server's first and only message
is the hello (a tag, the session token, the pool's size, with the pool's read-only file
descriptor beside it as ``SCM_RIGHTS``); a client sends releases, each ending one or more of
its leases.
"""

from __future__ import annotations

import struct
from typing import Final

_TAG: Final = b"posenc-shm/1"
TOKEN_BYTES: Final = 16
HELLO_BYTES: Final = len(_TAG) + TOKEN_BYTES + 8
_RELEASE: Final = b"R"
#: The most leases one release carries.
MAX_RELEASED: Final = 512
#: The longest message a client sends.
MAX_RELEASE_BYTES: Final = 1 + 8 * MAX_RELEASED


def hello(token: bytes, pool_bytes: int) -> bytes:
    """The server's hello of session ``token`` over a pool of ``pool_bytes``."""
    return _TAG + token + struct.pack("<Q", pool_bytes)


def parse_hello(message: bytes) -> tuple[bytes, int] | None:
    """``(token, pool_bytes)`` of a hello; None for anything else (a refusal is no message)."""
    if len(message) != HELLO_BYTES or not message.startswith(_TAG):
        return None
    token = message[len(_TAG) : len(_TAG) + TOKEN_BYTES]
    return token, struct.unpack("<Q", message[-8:])[0]


def release(leases: list[int]) -> bytes:
    """A release of ``leases`` (at most ``MAX_RELEASED``)."""
    return _RELEASE + struct.pack(f"<{len(leases)}Q", *leases)


def parse_release(message: bytes) -> tuple[int, ...] | None:
    """The leases a release ends; None for anything else."""
    count, rest = divmod(len(message) - 1, 8)
    if message[:1] != _RELEASE or rest or not 0 < count <= MAX_RELEASED:
        return None
    return struct.unpack(f"<{count}Q", message[1:])
