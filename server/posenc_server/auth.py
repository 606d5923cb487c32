"""Optional bearer-token authentication, as a gRPC server interceptor."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from posenc_server import metrics

# Probes (Kubernetes, Docker, load balancers) carry no token: health stays open.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


if TYPE_CHECKING:  # grpc-stubs makes the interceptor generic; the real class is not
    _Interceptor = grpc.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.ServerInterceptor


class BearerTokenInterceptor(_Interceptor):
    """Refuses calls without ``authorization: Bearer <token>`` with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the bearer token is empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        """Let the call through when its token matches, else answer UNAUTHENTICATED."""
        method: str = details.method
        if method.startswith(EXEMPT_PREFIXES):
            return continuation(details)
        supplied = b""
        for key, value in details.invocation_metadata:
            if key == "authorization":
                supplied = value.encode() if isinstance(value, str) else value
        # Constant time: the comparison must not tell how much of a guess was right.
        if hmac.compare_digest(supplied, self._expected):
            return continuation(details)
        return _deny(method.rsplit("/", 1)[-1])


def _deny(method: str) -> grpc.RpcMethodHandler[Any, Any]:
    def refuse(request: Any, context: grpc.ServicerContext) -> None:
        metrics.REQUESTS.labels(method, "UNAUTHENTICATED").inc()
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    # Aborting before any response works for every kind of call, streams included.
    return grpc.unary_unary_rpc_method_handler(refuse)


def read_token(path: str) -> str:
    """The token in ``path``, without surrounding whitespace (files often end in a newline)."""
    with open(path, encoding="utf-8") as file:
        token = file.read().strip()
    if not token:
        raise ValueError(f"{path} holds no token")
    return token
