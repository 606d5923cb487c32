"""e (server RSS while streaming) and f (client peak RSS), measured in fresh processes."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import posenc
from bench.common import GIB, MIB, Section, Sizes, Table, Target, median, ratio
from bench.harness import run_python
from bench.procs import ServerProcess

STREAM_D_MODEL = 1024


def _client(
    target: str, mode: str, start: int, rows: int, d_model: int, timeout: float
) -> dict[str, Any]:
    arguments = ["-m", "bench.memory_client", target, mode, str(start), str(rows), str(d_model)]
    out = run_python(arguments, timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory client {mode} failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def stream_with_server_rss(sizes: Sizes, server: ServerProcess) -> dict[str, Any]:
    """One fresh client process streams ``sizes.stream_bytes`` with iter_range from a fresh
    ``server`` while this process samples the server's RSS (summed over its processes)."""
    with posenc.Client(server.target, timeout=30.0) as client:
        info = client.server_info()
    budget = info.cache.budget_bytes
    try:  # what the operator configures: the default, as the harness passes no --cache-bytes
        from posenc_server.config import ServerConfig

        configured = int(ServerConfig().cache_bytes)
    except (ImportError, AttributeError, TypeError, ValueError):
        configured = budget
    rows = sizes.stream_bytes // (STREAM_D_MODEL * 4)
    baseline_kib = server.rss_kib()
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.is_set() and len(samples) < 100_000:
            samples.append((time.monotonic() - t0, server.rss_kib()))
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # Timeout: 8 GiB at a pessimistic 20 MiB/s.
        client_result = _client(
            server.target, "iter_range", 0, rows, STREAM_D_MODEL, sizes.stream_bytes / (20 * MIB)
        )
    finally:
        stop.set()
        sampler.join(5)
    hwm_kib = server.hwm_kib()
    peak_sampled = max((kib for _, kib in samples), default=0)
    # Downsampled timeline for the plot.
    step = max(1, len(samples) // 400)
    timeline = [(round(t, 3), kib) for t, kib in samples[::step]]
    return {
        "bytes": sizes.stream_bytes,
        "d_model": STREAM_D_MODEL,
        "rows": rows,
        "cache_budget_bytes": configured,
        "server_info_budget_bytes": budget,
        "server_processes": len(server.pids()),
        "server_baseline_kib": baseline_kib,
        "server_peak_sampled_kib": peak_sampled,
        "server_hwm_kib": hwm_kib,
        "timeline_s_kib": timeline,
        "client": client_result,
    }


def sizing_rule_bytes(stream: dict[str, Any]) -> int:
    """The memory sizing rule (docs/operations.md, "Scaling") for the streaming server: its
    cache budget, 310 MiB per server process (Python, gRPC, numpy, numba's compiler, the spec
    table, calls in flight) and 64 MiB for the supervisor of worker processes."""
    processes = stream["server_processes"]
    workers, supervisor = (processes - 1, 64 * MIB) if processes > 1 else (1, 0)
    return int(stream["cache_budget_bytes"]) + workers * 310 * MIB + supervisor


def add_server_rss(section: Section, stream: dict[str, Any]) -> None:
    budget = stream["cache_budget_bytes"]
    peak_bytes = max(stream["server_hwm_kib"], stream["server_peak_sampled_kib"]) * 1024
    limit = sizing_rule_bytes(stream)
    client = stream["client"]
    section.tables.append(
        Table(
            f"server RSS while one client streams {stream['bytes'] / GIB:g} GiB (iter_range, "
            f"d_model {stream['d_model']} float32, fresh server)",
            ["", "MiB"],
            [
                ["cache budget (configured: --cache-bytes default)", f"{budget / MIB:.0f}"],
                [
                    "cache budget of the process that answered server_info",
                    f"{stream['server_info_budget_bytes'] / MIB:.0f}",
                ],
                [
                    "RSS after start (before the stream)",
                    f"{stream['server_baseline_kib'] / 1024:.0f}",
                ],
                [
                    "peak RSS, sampled every 50 ms",
                    f"{stream['server_peak_sampled_kib'] / 1024:.0f}",
                ],
                ["peak RSS, VmHWM", f"{stream['server_hwm_kib'] / 1024:.0f}"],
                [
                    "target: the sizing rule (budget + 310 MiB per server process + "
                    "64 MiB for a supervisor)",
                    f"{limit / MIB:.0f}",
                ],
                [
                    "stream throughput (MiB/s, cold: computed as it streams)",
                    f"{client['bytes'] / MIB / client['seconds']:.0f}",
                ],
            ],
        )
    )
    section.targets.append(
        Target("server peak RSS / the sizing rule", ratio(peak_bytes, limit), "<=", 1.0)
    )
    section.notes.append(
        f"Server RSS is summed over {stream['server_processes']} server process(es) "
        "(a server with worker processes splits its configured cache budget among them) "
        "(/proc/PID/status, children from /proc/PID/task/*/children); VmHWM summed over "
        "processes is an upper bound of their joint peak."
    )
    section.data["server_rss"] = stream


def client_memory(sizes: Sizes, target: str, stream: dict[str, Any]) -> Section:
    get_rows = sizes.client_get_bytes // (STREAM_D_MODEL * 4)
    section = Section(
        "f",
        "Client memory",
        method=(
            "Each measurement is a fresh client process (`python -m bench.memory_client`): "
            "imports, connects, makes one small call, resets its peak RSS (writing 5 to "
            "/proc/self/clear_refs) and takes VmRSS as its baseline; then runs the call and "
            "reads VmHWM. Peak above baseline = VmHWM - baseline. get_range: "
            f"{get_rows} x {STREAM_D_MODEL} float32 ({sizes.client_get_bytes / GIB:g} GiB), "
            f"{sizes.client_get_repeats} runs: the median (and the largest). iter_range: the "
            f"{stream['bytes'] / GIB:g} GiB stream of section e."
        ),
    )
    get_results = []
    for repeat in range(sizes.client_get_repeats):
        start = 13 * 10**9 + repeat * 2**22
        get_results.append(
            _client(target, "get_range", start, get_rows, STREAM_D_MODEL, timeout=600)
        )
    get_peaks = [(r["peak_kib"] - r["baseline_kib"]) * 1024 for r in get_results]
    get_peak = median(get_peaks)
    get_result = sizes.client_get_bytes
    it = stream["client"]
    iter_peak = (it["peak_kib"] - it["baseline_kib"]) * 1024
    section.tables.append(
        Table(
            "peak RSS above the baseline",
            [
                "call",
                "result MiB",
                "baseline MiB",
                "peak above baseline MiB",
                "x result",
                "seconds",
            ],
            [
                [
                    "get_range",
                    f"{get_result / MIB:.0f}",
                    f"{get_results[0]['baseline_kib'] / 1024:.0f}",
                    f"{get_peak / MIB:.1f} (max {max(get_peaks) / MIB:.1f})",
                    f"{ratio(get_peak, get_result):.3f} "
                    f"(max {ratio(max(get_peaks), get_result):.3f})",
                    f"{median([r['seconds'] for r in get_results]):.1f}",
                ],
                [
                    "iter_range",
                    f"{it['bytes'] / MIB:.0f}",
                    f"{it['baseline_kib'] / 1024:.0f}",
                    f"{iter_peak / MIB:.1f}",
                    f"{ratio(iter_peak, it['bytes']):.4f}",
                    f"{it['seconds']:.1f}",
                ],
            ],
        )
    )
    section.targets += [
        Target(
            f"get_range {get_result / GIB:g} GiB: median peak above baseline / result",
            ratio(get_peak, get_result),
            "<=",
            1.15,
        ),
        Target(
            f"iter_range {it['bytes'] / GIB:g} GiB: peak above baseline (MiB)",
            iter_peak / MIB,
            "<",
            64.0,
            unit=" MiB",
        ),
    ]
    if not all(r["peak_reset"] for r in [*get_results, it]):
        section.notes.append(
            "The kernel refused to reset VmHWM: peaks include the import-time peak."
        )
    section.data = {"get_range": get_results, "iter_range": it}
    return section
