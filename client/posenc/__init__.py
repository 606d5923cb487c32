"""posenc: exact positional-encoding tables from a gRPC service.

Sinusoidal tables, rotary cos/sin tables with their scalings, M-RoPE, sin-cos grids and
N-axis rotary tables, in the conventions model families use.

The SDK of the posenc service::

    import posenc

    with posenc.Client("127.0.0.1:50051") as client:
        table = client.get_range(0, 8192, 512)                   # numpy (8192, 512) float32
        rows = client.get_positions([3, 1_000_000], 512, dtype="bfloat16")
        for first, block in client.iter_range(0, 10_000_000, 512, timeout=None):
            ...                                                  # O(chunk) memory
        whisper = client.get_range(0, 1500, posenc.Spec("whisper", d_model=384))

An int ``table`` is the classic sinusoidal table's ``d_model``; any other table is a
:class:`Spec`. ``AsyncClient`` has the same methods for asyncio. Failures raise
:class:`PosencError` subclasses (see :mod:`posenc.errors`).
"""

from posenc import _quiet  # noqa: F401  (first: before anything imports grpc)
from posenc._async_client import AsyncClient
from posenc._channel import DEFAULT_TARGET
from posenc._client import Client
from posenc._query import DTYPE_NAMES
from posenc._version import __version__
from posenc.errors import (
    CancelledError,
    ClientClosedError,
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    PosencError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from posenc.spec import Spec
from posenc.table import AsyncGrowingTable, GrowingTable
from posenc.types import (
    DEFAULT,
    CacheStats,
    ClassicOptions,
    Limits,
    ServerInfo,
    TableKind,
    TableParameter,
)

__all__ = [
    "DEFAULT",
    "DEFAULT_TARGET",
    "DTYPE_NAMES",
    "AsyncClient",
    "AsyncGrowingTable",
    "CacheStats",
    "CancelledError",
    "ClassicOptions",
    "Client",
    "ClientClosedError",
    "DeadlineExceededError",
    "GrowingTable",
    "InternalError",
    "InvalidArgumentError",
    "Limits",
    "NotFoundError",
    "PermissionDeniedError",
    "PosencError",
    "ResourceExhaustedError",
    "ServerInfo",
    "Spec",
    "TableKind",
    "TableParameter",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "__version__",
]
