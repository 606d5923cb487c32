"""The figures of issue 10's network attacks, measured on a real server process.

    .venv/bin/python bench/attacks.py [connections|stalled|unread|million|labels ...]

Each attack runs against a fresh ``python -m posenc_server`` (one process, 64 MiB cache) and
prints one line: what the attack did and what the server showed (health latency, peak RSS,
refusals, /metrics size). To measure another version of the server, put its source first
on PYTHONPATH (``PYTHONPATH=/path/to/old/server:/path/to/old/client``); flags it does not
know are left out. The pass/fail versions of these attacks are tests/test_attacks.py.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from rawh2 import RawConnection

import posenc
from posenc_protocol.v1 import posenc_pb2 as pb

GET_ENCODING = "/posenc.v1.PositionalEncodingService/GetEncoding"
CACHE = "64MiB"


class Server:
    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "posenc_server", "--processes", "1", "--port", "0",
             "--metrics-port", "0", "--cache-bytes", CACHE, *args],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if '"listening"' in line:
                startup = json.loads(line)
                break
        else:
            raise RuntimeError("the server did not start")
        threading.Thread(target=self.process.stderr.read, daemon=True).start()
        self.port, self.metrics_port = int(startup["port"]), int(startup["metrics_port"])
        self.target = f"127.0.0.1:{self.port}"

    def status(self, key: str) -> float:
        """VmHWM (peak) or VmRSS (now), in MiB."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
        raise KeyError(key)

    def metrics_page(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as page:
            return str(page.read().decode())

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def health_latency(target: str, checks: int = 20) -> str:
    """The slowest of ``checks`` health checks on a connected channel (or why none came)."""
    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=5)
            slowest = 0.0
            for _ in range(checks):
                started = time.perf_counter()
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                slowest = max(slowest, time.perf_counter() - started)
        except grpc.RpcError as error:
            return f"failed: {error.code().name}"
    return f"{slowest * 1000:.1f} ms"


def stalled() -> None:
    server = Server()
    connections = [RawConnection("127.0.0.1", server.port) for _ in range(8)]
    for connection in connections:
        for _ in range(64):
            connection.call(GET_ENCODING, None, end=False)
        connection.pump(0.2)
    try:
        with posenc.Client(server.target, timeout=5, max_retries=0) as client:
            client.get_range(0, 4, 8)
        real = "ok"
    except posenc.PosencError as error:
        real = f"failed: {error.code.name} {error.details}"
    print(
        f"stalled: 512 headers-only calls on 8 connections: health slowest of 20 "
        f"{health_latency(server.target)}, get_range {real}, "
        f"peak RSS {server.status('VmHWM'):.0f} MiB"
    )
    server.close()


def connections() -> None:
    """900 idle HTTP/2 connections (preface and settings, no call), without a connection
    limit and with one of 64: how much each holds, and how many the server keeps open."""
    count = 900
    for limit in ("0", "64"):
        server = Server("--max-connections", limit)
        time.sleep(0.5)
        before = server.status("VmRSS")
        flood = [RawConnection("127.0.0.1", server.port) for _ in range(count)]
        time.sleep(1.0)
        for connection in flood:
            connection.pump(0.002)
        grown = server.status("VmRSS") - before
        still_open = sum(not connection.closed for connection in flood)
        print(
            f"connections: {count} idle, --max-connections {limit}: {still_open} left open, "
            f"RSS +{grown:.1f} MiB ({grown * 1024 / max(still_open, 1):.0f} KiB each open)"
        )
        for connection in flood:
            connection.close()
        server.close()


def unread() -> None:
    server = Server()
    request = pb.GetEncodingRequest(
        spec=pb.EncodingSpec(sinusoidal=pb.SinusoidalTable(d_model=1020)),
        range=pb.PositionRange(start=0, stop=1024),
    ).SerializeToString()
    before = server.status("VmRSS")
    connection = RawConnection("127.0.0.1", server.port, window=0)
    streams = [connection.call(GET_ENCODING, request) for _ in range(250)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        connection.pump(0.2)
        if sum(connection.replies[s].status is not None for s in streams) >= 200:
            break
    time.sleep(3)
    codes = [connection.replies[s].status for s in streams]
    peak = server.status("VmHWM")
    connection.close()
    time.sleep(3)
    print(
        f"unread: 250 GetEncoding of 4,177,920 bytes, window 0: {codes.count(8)} "
        f"RESOURCE_EXHAUSTED, {codes.count(None)} held; RSS {before:.0f} MiB before, "
        f"peak {peak:.0f} MiB, {server.status('VmRSS'):.0f} MiB 3 s after the client left"
    )
    server.close()


def _at_once(call: Callable[[], None], clients: int) -> None:
    """``clients`` threads each making ``call`` at the same time; returns when all are done."""
    threads = [threading.Thread(target=call) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def million() -> None:
    server = Server()
    positions = -np.arange(1, (1 << 20) + 1, dtype=np.int64)
    outcomes: list[str] = []

    def fetch() -> None:
        try:
            with posenc.Client(server.target) as client:
                client.get_positions(positions, 1, dtype="float16")
            outcomes.append("ok")
        except posenc.PosencError as error:
            outcomes.append(error.code.name)

    started = time.monotonic()
    _at_once(fetch, 64)
    print(
        f"million: 64 clients x 1,048,576 positions (10.5 MB requests): "
        f"{outcomes.count('ok')} ok, others {sorted(set(outcomes) - {'ok'})}, "
        f"{time.monotonic() - started:.1f} s, peak RSS {server.status('VmHWM'):.0f} MiB"
    )
    server.close()


def raw_million() -> None:
    """The same lists from raw clients, one 10.5 MB request each (the SDK splits them)."""
    server = Server()
    request = pb.GetEncodingRequest(
        spec=pb.EncodingSpec(dtype=pb.DTYPE_FLOAT16, sinusoidal=pb.SinusoidalTable(d_model=1)),
        positions=pb.PositionList(positions=(-np.arange(1, (1 << 20) + 1)).tolist()),
    ).SerializeToString()
    codes: list[str] = []

    def fetch() -> None:
        options = [("grpc.max_send_message_length", 16 << 20)]
        with grpc.insecure_channel(server.target, options=options) as channel:
            try:
                channel.unary_unary(
                    GET_ENCODING, request_serializer=None, response_deserializer=None
                )(request, timeout=60)
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(error.code().name)

    _at_once(fetch, 64)
    print(
        f"raw_million: 64 raw calls of 1,048,576 positions at once: "
        f"{ {code: codes.count(code) for code in set(codes)} }, "
        f"peak RSS {server.status('VmHWM'):.0f} MiB"
    )
    server.close()


def labels() -> None:
    token = Path("/tmp/posenc-bench-token")
    token.write_text("s3cret")
    server = Server("--auth-token-file", str(token))
    before = len(server.metrics_page())
    with grpc.insecure_channel(server.target) as channel:
        for index in range(2000):
            with contextlib.suppress(grpc.RpcError):
                channel.unary_unary(
                    f"/evil.v1.Made{index}/Up{index}",
                    request_serializer=None,
                    response_deserializer=None,
                )(b"", timeout=5)
    print(
        f"labels: 2,000 unauthenticated calls to made-up methods: /metrics {before} -> "
        f"{len(server.metrics_page())} bytes"
    )
    server.close()


def decode() -> None:
    """Not an attack: the latency of a decode step, to weigh what the defences cost."""
    server = Server()
    with posenc.Client(server.target, row_cache_bytes=0) as client:
        positions = np.arange(64) * 1000
        for step in range(200):
            client.get_positions(positions + step, 128)
        times = []
        for step in range(2000):
            started = time.perf_counter()
            client.get_positions(positions + step, 128)
            times.append(time.perf_counter() - started)
    print(f"decode: 2,000 steps of 64 positions x 128, median {np.median(times) * 1e6:.0f} us")
    server.close()


ATTACKS = {
    "connections": connections,
    "stalled": stalled,
    "unread": unread,
    "million": million,
    "raw_million": raw_million,
    "labels": labels,
    "decode": decode,
}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(ATTACKS):
        ATTACKS[name]()
