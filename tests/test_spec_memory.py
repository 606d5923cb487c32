"""Per-spec structures stay within their budget: distinct large specs cannot grow the server.

The trial's attack (issue 10, item 2): GetEncoding over the empty range [0, 0), each request
with a distinct valid longrope spec of 2 x 32,768 factors (a 512 KiB request). Every spec is
validated and its frequencies and rotation table computed, then remembered in the spec table,
whose --spec-bytes budget (16 MiB) counts the waves, the factors and the key.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import grpc
import pytest
from conftest import ServerProcess, peak_rss_mib

from posenc.v1 import posenc_pb2 as pb
from posenc.v1 import posenc_pb2_grpc

SOAK = os.environ.get("POSENC_SOAK") == "1"
MIB = 1 << 20


def longrope(serial: int) -> pb.EncodingSpec:
    """A valid longrope spec of the widest rotary_dim, distinct for each ``serial``."""
    factors = [1.0 + serial * 1e-9 + i * 1e-6 for i in range(32768)]
    return pb.EncodingSpec(
        rotary=pb.RotaryTable(
            head_dim=65536,
            layout=pb.ROPE_LAYOUT_VLLM,
            longrope=pb.LongRopeScaling(
                original_max_position_embeddings=4096,
                factor=32.0,
                short_factor=factors,
                long_factor=factors[::-1],
            ),
        )
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_distinct_longrope_specs_keep_rss_within_the_cache_budget_plus_128_mib(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    requests = 600 if SOAK else 32
    budget = 16 * MIB
    process = spawn_server(0, "--cache-bytes", str(budget))
    options = [("grpc.max_send_message_length", 16 << 20)]
    with grpc.insecure_channel(process.target, options=options) as channel:
        stub = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
        for serial in range(requests):
            request = pb.GetEncodingRequest(
                spec=longrope(serial), range=pb.PositionRange(start=0, stop=0)
            )
            assert stub.GetEncoding(request, timeout=60).tensor.rows == 0
    peak = peak_rss_mib(process.process.pid)
    print(f"{requests} distinct longrope specs: server peak RSS {peak:.0f} MiB")
    assert peak <= budget / MIB + 128, f"server peak RSS {peak:.0f} MiB"
