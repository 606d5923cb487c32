"""Which failures the SDK retries (and resumes streams after)."""

from __future__ import annotations

import grpc
import pytest

from posenc._retry import is_transient
from posenc.errors import PosencError

RESET = "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))"
ENDED = "Stream removed (Data frame with END_STREAM flag received)"


def test_resource_exhausted_is_retried_only_when_the_server_says_when() -> None:
    busy = PosencError(
        "at the stream cap", code=grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after=0.2
    )
    too_big = PosencError("over the stream limit", code=grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert is_transient(busy)
    assert not is_transient(too_big)


@pytest.mark.parametrize(
    ("code", "details", "transient"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
        (grpc.StatusCode.UNAVAILABLE, "the server is shutting down", True),
        (grpc.StatusCode.INTERNAL, RESET, True),  # a proxy reset the stream
        (grpc.StatusCode.INTERNAL, "internal error; see the server log", False),
        # nginx ended the stream without a status when its upstream replica was killed
        (grpc.StatusCode.UNKNOWN, ENDED, True),
        (grpc.StatusCode.UNKNOWN, "Exception calling application: boom", False),
        (grpc.StatusCode.CANCELLED, "CANCELLED", True),  # a server stopping as it arrived
        (grpc.StatusCode.CANCELLED, "Locally cancelled by application!", False),
        (grpc.StatusCode.CANCELLED, "Channel closed!", False),  # the client's close()
        (grpc.StatusCode.INVALID_ARGUMENT, "spec.d_model: must be between 1 and 65536", False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "over the stream limit", False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", False),
    ],
)
def test_only_transient_failures_are_retried(
    code: grpc.StatusCode, details: str, transient: bool
) -> None:
    assert is_transient(PosencError(details, code=code)) is transient
