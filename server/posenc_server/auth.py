"""Optional bearer-token authentication: the check only (``interceptors`` refuses and counts)."""

from __future__ import annotations

import hmac

import grpc

# Probes (Kubernetes, Docker, load balancers) carry no token: health stays open.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class BearerToken:
    """Accepts calls with ``authorization: Bearer <token>``, and health checks."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token is empty")
        self._expected = f"Bearer {token}".encode()

    def allows(self, details: grpc.HandlerCallDetails) -> bool:
        """Whether the call may go on."""
        method: str = details.method
        if method.startswith(EXEMPT_PREFIXES):
            return True
        supplied = b""
        for key, value in details.invocation_metadata:
            if key == "authorization":
                supplied = value.encode() if isinstance(value, str) else value
        # Constant time: the comparison must not tell how much of a guess was right.
        return hmac.compare_digest(supplied, self._expected)


def read_token(path: str) -> str:
    """The token in ``path``, without surrounding whitespace (files often end in a newline)."""
    with open(path, encoding="utf-8") as file:
        token = file.read().strip()
    if not token:
        raise ValueError(f"{path} holds no token")
    return token
