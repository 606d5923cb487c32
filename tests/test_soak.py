"""Proof under pressure: load, cache churn, faults. Quick in `make test`, full in `make soak`.

POSENC_SOAK=1 (set by `make soak`) selects the full durations and sizes.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import SERVER_HEADROOM_MIB, ServerProcess, peak_rss_mib
from reference import classic

import posenc
from posenc_server import engine

# Every test here starts server processes and waits on them.
pytestmark = pytest.mark.slow

SOAK = os.environ.get("POSENC_SOAK") == "1"
MIB = 1 << 20


@dataclass(frozen=True)
class Call:
    """One kind of request of the load mix, with its expected bytes."""

    name: str
    kwargs: dict[str, object]
    positions: list[int] | None
    expected: bytes


def load_mix() -> list[Call]:
    calls = []
    for name, start, stop, d_model, dtype, layout, schedule in [
        ("unary small", 10**6, 10**6 + 16, 512, "float32", "interleaved", "paper"),
        ("unary bf16", 2**40, 2**40 + 64, 1024, "bfloat16", "split", "paper"),
        ("stream 2 MiB", 0, 2048, 256, "float64", "interleaved", "tensor2tensor"),
        ("stream 8 MiB", 5000, 5000 + 8192, 256, "float32", "split", "tensor2tensor"),
    ]:
        spec = classic(d_model, 10000.0, dtype, layout, schedule)
        kwargs = {"table": d_model, "dtype": dtype, "layout": layout, "schedule": schedule}
        expected = engine.encode_range(spec, start, stop).tobytes()
        calls.append(Call(name, {"start": start, "stop": stop, **kwargs}, None, expected))
    for name, count in [("decode 1", 1), ("decode 64", 64)]:
        positions = [123_456 + 1000 * i for i in range(count)]
        spec = classic(4096)
        expected = engine.encode_positions(spec, positions).tobytes()
        calls.append(Call(name, {"table": 4096}, positions, expected))
    return calls


@pytest.mark.timeout(600)
def test_load_32_clients_mixed_calls_zero_errors_every_result_exact(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    duration = 120.0 if SOAK else 10.0
    process = spawn_server(0, "--processes", "2")
    calls = load_mix()
    latencies: dict[str, list[float]] = {call.name: [] for call in calls}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with posenc.Client(process.target) as client:
            while time.monotonic() < deadline:
                call = rng.choice(calls)
                started = time.perf_counter()
                try:
                    if call.positions is None:
                        table = client.get_range(**call.kwargs)  # type: ignore[arg-type]
                    else:
                        table = client.get_positions(call.positions, **call.kwargs)  # type: ignore[arg-type]
                except posenc.PosencError as error:
                    with lock:
                        errors.append(f"{call.name}: {error}")
                    continue
                elapsed = time.perf_counter() - started
                exact = table.tobytes() == call.expected
                with lock:
                    latencies[call.name].append(elapsed)
                    if not exact:
                        errors.append(f"{call.name}: wrong bytes")

    threads = [threading.Thread(target=client_loop, args=(seed,)) for seed in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:10]
    total = sum(len(values) for values in latencies.values())
    report = [f"load: 32 clients, {duration:.0f} s, {total} calls, 0 errors, all exact"]
    for name, values in latencies.items():
        assert values, f"no {name} call completed"
        p50 = statistics.median(values) * 1e3
        p99 = float(np.percentile(values, 99)) * 1e3
        report.append(f"  {name:<13} n={len(values):<6} p50={p50:8.2f} ms  p99={p99:8.2f} ms")
    print("\n".join(report))


@pytest.mark.timeout(900)
def test_cache_churn_keeps_server_memory_under_the_budget(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    keys = 5000 if SOAK else 1000
    budget = 512 * MIB if SOAK else 128 * MIB
    process = spawn_server(0, "--cache-bytes", str(budget))
    rng = np.random.default_rng(5)
    with posenc.Client(process.target) as client:
        for key in range(keys):
            # A distinct (base, d_model) each time: every call fills a new 1 MiB block.
            base = 1000.0 + key
            d_model = int(rng.integers(16, 1024))
            table = client.get_range(key, key + 4, d_model, base=base)
            assert table.shape == (4, d_model)
        info = client.server_info()
    assert info.cache.misses >= keys
    assert info.cache.evictions > 0
    assert info.cache.bytes <= budget
    peak = peak_rss_mib(process.process.pid)
    assert peak <= budget / MIB + SERVER_HEADROOM_MIB, f"server peak RSS {peak:.0f} MiB"
    print(f"cache churn: {keys} keys, budget {budget // MIB} MiB, server peak RSS {peak:.0f} MiB")


@pytest.mark.timeout(120)
def test_sigterm_during_8_streams_drains_them_and_turns_new_calls_away(
    spawn_server: Callable[..., ServerProcess],
) -> None:
    # Room for the 8 slow streams and a new call's read at once: this test is about the
    # drain, not about admission (which would make a ninth call wait for a stream to end).
    process = spawn_server(0, "--grace-seconds", "30", "--in-flight-bytes", "256MiB")
    spec = classic(1024)
    expected = engine.encode_range(spec, 0, 8192)
    results: list[np.ndarray] = []
    failures: list[str] = []
    streams_started = threading.Barrier(9)

    def slow_stream() -> None:
        with posenc.Client(process.target, max_retries=0) as client:
            parts = []
            for index, (_, rows) in enumerate(client.iter_range(0, 8192, 1024, chunk_bytes=MIB)):
                parts.append(rows)
                if index == 0:
                    streams_started.wait()
                time.sleep(0.1)  # a slow reader: 32 chunks take over 3 s
            results.append(np.concatenate(parts))

    def guarded() -> None:
        try:
            slow_stream()
        except Exception as error:
            failures.append(repr(error))
            streams_started.abort()  # the test fails on failures, rather than wait forever

    threads = [threading.Thread(target=guarded) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        streams_started.wait(60)
    except threading.BrokenBarrierError:
        pytest.fail(f"a stream did not start: {failures}")
    process.terminate()
    with posenc.Client(process.target, max_retries=0, timeout=5) as client:
        deadline = time.monotonic() + 5
        while client.health() == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.health() == "NOT_SERVING"  # health turns first, streams still running
        assert any(thread.is_alive() for thread in threads)
        with pytest.raises(posenc.UnavailableError):
            client.get_range(0, 4, 8)
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    assert len(results) == 8 and all(np.array_equal(r, expected) for r in results)
    assert process.process.wait(30) == 0
