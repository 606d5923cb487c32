"""Which failures the SDK retries (and resumes streams after)."""

from __future__ import annotations

import grpc
import pytest

from posenc import _protocol as proto
from posenc.errors import PosencError

RESET = "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))"


@pytest.mark.parametrize(
    ("code", "details", "transient"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
        (grpc.StatusCode.UNAVAILABLE, "the server is shutting down", True),
        (grpc.StatusCode.INTERNAL, RESET, True),  # a proxy reset the stream
        (grpc.StatusCode.INTERNAL, "internal error; see the server log", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "spec.d_model: must be between 1 and 65536", False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "over the stream limit", False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", False),
    ],
)
def test_only_transient_failures_are_retried(
    code: grpc.StatusCode, details: str, transient: bool
) -> None:
    assert proto.is_transient(PosencError(details, code=code)) is transient
