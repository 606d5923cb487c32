"""posenc: exact sinusoidal positional-encoding tables from a gRPC service.

The SDK of the posenc service::

    import posenc

    with posenc.Client("127.0.0.1:50051") as client:
        table = client.get_range(0, 8192, 512)                   # numpy (8192, 512) float32
        rows = client.get_positions([3, 1_000_000], 512, dtype="bfloat16")
        for first, block in client.iter_range(0, 10_000_000, 512, timeout=None):
            ...                                                  # O(chunk) memory

``AsyncClient`` has the same methods for asyncio. Failures raise :class:`PosencError`
subclasses (see :mod:`posenc.errors`).
"""

from posenc._async_client import AsyncClient
from posenc._client import Client
from posenc._protocol import (
    DEFAULT_TARGET,
    DTYPE_NAMES,
    LAYOUT_NAMES,
    SCHEDULE_NAMES,
    CacheStats,
    Limits,
    PresetInfo,
    ServerInfo,
)
from posenc.errors import (
    CancelledError,
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
from posenc.presets import RotaryPreset, SinusoidalPreset

__version__ = "1.0.0"

__all__ = [
    "DEFAULT_TARGET",
    "DTYPE_NAMES",
    "LAYOUT_NAMES",
    "SCHEDULE_NAMES",
    "AsyncClient",
    "CacheStats",
    "CancelledError",
    "Client",
    "DeadlineExceededError",
    "InternalError",
    "InvalidArgumentError",
    "Limits",
    "NotFoundError",
    "PermissionDeniedError",
    "PosencError",
    "PresetInfo",
    "ResourceExhaustedError",
    "RotaryPreset",
    "ServerInfo",
    "SinusoidalPreset",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "__version__",
]
