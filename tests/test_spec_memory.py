"""Per-spec structures stay within their budget: distinct large specs cannot grow the server.

The trial's attack (issue 10, item 2): GetEncoding over the empty range [0, 0), each request
with a distinct valid longrope spec of 2 x 32,768 factors (a 512 KiB request). Every spec is
validated and its frequencies and rotation table computed, then remembered in the spec table,
whose --spec-bytes budget (16 MiB) counts the waves, the factors and the key.
"""

from __future__ import annotations

import concurrent.futures
import os

import grpc
import numpy as np
import pytest
from conftest import SERVER_HEADROOM_MIB, Spawn, peak_rss_mib, sizing_rule_mib

from posenc_protocol.v1 import posenc_pb2 as pb
from posenc_protocol.v1 import posenc_pb2_grpc

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
def test_distinct_longrope_specs_keep_rss_within_the_cache_budget_plus_headroom(
    spawn_server: Spawn,
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
    assert peak <= budget / MIB + SERVER_HEADROOM_MIB, f"server peak RSS {peak:.0f} MiB"


def _tree_peak_mib(supervisor_pid: int) -> tuple[float, list[float]]:
    """The summed peak RSS (VmHWM) of the supervisor and its workers, and each worker's."""
    workers = set()
    for task in os.listdir(f"/proc/{supervisor_pid}/task"):
        with open(f"/proc/{supervisor_pid}/task/{task}/children") as listing:
            workers.update(int(pid) for pid in listing.read().split())
    peaks = [peak_rss_mib(pid) for pid in sorted(workers)]
    return peak_rss_mib(supervisor_pid) + sum(peaks), peaks


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_spec_churn_with_2_processes_stays_within_the_sizing_rule(spawn_server: Spawn) -> None:
    keys = 5000 if SOAK else 1200
    budget, processes = 128 * MIB, 2
    process = spawn_server(0, "--processes", str(processes), "--cache-bytes", str(budget))
    rng = np.random.default_rng(11)
    d_models = rng.integers(16, 1024, keys).tolist()

    # Channels until each worker has two: a channel with its own subchannel pool is one
    # connection, so one worker (the kernel spreads connections), and both workers churn.
    channels: dict[str, list[grpc.Channel]] = {}
    spare: list[grpc.Channel] = []
    for _ in range(64):
        channel = grpc.insecure_channel(
            process.target, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        stub = posenc_pb2_grpc.PositionalEncodingServiceStub(channel)
        server_id = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_id
        worker = channels.setdefault(server_id, [])
        (worker if len(worker) < 2 else spare).append(channel)
        if len(channels) == processes and all(len(c) == 2 for c in channels.values()):
            break
    for channel in spare:
        channel.close()
    churning = [channel for group in channels.values() for channel in group]
    assert len(churning) == 2 * processes, f"connections reached {len(channels)} workers"

    def churn(index: int) -> None:
        stub = posenc_pb2_grpc.PositionalEncodingServiceStub(churning[index])
        for key in range(index, keys, len(churning)):
            spec = pb.EncodingSpec(
                sinusoidal=pb.SinusoidalTable(d_model=d_models[key], base=1000.0 + key)
            )
            request = pb.GetEncodingRequest(
                spec=spec, range=pb.PositionRange(start=key, stop=key + 4)
            )
            assert stub.GetEncoding(request, timeout=60).tensor.rows == 4

    with concurrent.futures.ThreadPoolExecutor(len(churning)) as pool:
        list(pool.map(churn, range(len(churning))))
    for channel in churning:
        channel.close()
    total, workers = _tree_peak_mib(process.process.pid)
    rule = sizing_rule_mib(budget / MIB, processes)
    print(
        f"spec churn, {processes} processes, cache {budget // MIB} MiB: peak RSS {total:.0f} "
        f"MiB (workers {', '.join(f'{w:.0f}' for w in workers)}), sizing rule {rule:.0f} MiB"
    )
    assert len(workers) == processes
    assert total <= rule, f"peak RSS {total:.0f} MiB over the sizing rule's {rule:.0f} MiB"
