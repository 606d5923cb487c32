"""The counters a server reports of its row cache (``GetServerInfoResponse.cache``): one
type for the server's snapshot of them and for what the SDK's ``server_info()`` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheStats:
    """A server's cache counters since it started, taken together as one consistent
    snapshot."""

    hits: int
    misses: int
    evictions: int
    bytes: int
    entries: int
    budget_bytes: int
