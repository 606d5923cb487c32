"""The core's whole-result limits on a range fetched in parts, driven by the scripted fake of
``test_core_steps`` over two connections, without a server."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
from test_core_steps import ROW_BYTES, Fake, expected, get_range, run

import posenc
from posenc import _core as core
from posenc._channel import Settings
from posenc._rows import RowCache
from posenc.testing import Status
from posenc_protocol.v1 import posenc_pb2 as pb

ROWS = 2 * core.SPREAD_MIN_ROWS  # fetched in two parts


class TwoProcesses(Fake):
    """A server whose GetServerInfo answers ``limit`` (or
    fails with ``info_error``)."""

    def __init__(self, limit: int | None, info_error: grpc.RpcError | None = None) -> None:
        super().__init__(chunk_rows=4096)
        self.limit, self.info_error = limit, info_error

    def perform(self, operation: core.Operation) -> Any:
        match operation:
            case core.Unary(method="get_server_info"):
                self.log.append(("info", None))
                if self.info_error is not None:
                    raise self.info_error
                return pb.GetServerInfoResponse(limits=pb.Limits(max_stream_bytes=self.limit or 0))
        return super().perform(operation)


def two_connections() -> core.Core:
    settings = Settings.create(
        "127.0.0.1:1",
        timeout=None,
        max_retries=0,
        retry_backoff=0.0,
        chunk_bytes=None,
        unary_max_bytes=64 * ROW_BYTES,
        connections=2,
        options=None,
    )
    return core.Core(settings, RowCache(0, 0), futures.Future)


def parts(fake: Fake) -> list[tuple[int, int]]:
    """The ranges of the streams that asked for rows."""
    return [(rows[0], rows[-1] + 1) for kind, rows in fake.log if kind == "stream" and rows]


def test_a_range_under_the_stream_limit_is_fetched_in_parts() -> None:
    fake = TwoProcesses(limit=ROWS * ROW_BYTES)
    result, _ = run(fake, get_range(two_connections(), 0, ROWS))
    assert parts(fake) == [(0, ROWS // 2), (ROWS // 2, ROWS)]
    np.testing.assert_array_equal(result, expected(list(range(ROWS))))


def test_a_range_over_the_stream_limit_is_refused_though_each_part_is_under_it() -> None:
    fake = TwoProcesses(limit=ROWS * ROW_BYTES - 1)
    c = two_connections()
    with pytest.raises(posenc.ResourceExhaustedError, match="over the stream limit"):
        run(fake, get_range(c, 0, ROWS))
    assert all(stream.cancelled for stream in fake.streams)
    # The width is known now: refused before any stream.
    fake.log.clear()
    with pytest.raises(posenc.ResourceExhaustedError, match="over the stream limit"):
        run(fake, get_range(c, 0, ROWS))
    assert parts(fake) == []


def test_a_server_that_does_not_tell_its_limits_gets_one_stream() -> None:
    unimplemented = Status(grpc.StatusCode.UNIMPLEMENTED, "no GetServerInfo here")
    fake = TwoProcesses(limit=None, info_error=unimplemented)
    c = two_connections()
    for _ in range(2):  # asked once
        result, _ = run(fake, get_range(c, 0, ROWS))
        np.testing.assert_array_equal(result, expected(list(range(ROWS))))
    assert parts(fake) == [(0, ROWS), (0, ROWS)]
    assert [kind for kind, _ in fake.log].count("info") == 1
