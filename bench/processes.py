"""p. One client, several server processes: cold throughput of one shared posenc.Client."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import posenc
from bench import procs
from bench.common import MIB, Section, Sizes, Table, Target, cpu_seconds, median, ratio

D_MODEL = 1024
# 256 rows of 1024 float32 columns: 1 MiB, one unary call, one block computed per call.
ROWS = 256
THREADS = 4
# Far from the ranges other sections fetch, and apart per call: every call is computed.
FIRST_START = 50_000_000
WINDOW = {True: 1.5, False: 3.0}
# Scattered lookups: each call 64 random positions of a 256-wide table (64 KiB), every row
# computed on its own (no block holds two of them): the server's work, not the bytes.
SCATTERED_ROWS = 64
SCATTERED_D_MODEL = 256
# Large ranges: one thread's cold 64 MiB get_range calls, each fetched in parts, one per
# server process the client's connections reach.
LARGE_ROWS = 65536
LARGE_D_MODEL = 256


#: A workload: its call (a client and a call index; the rows fetched) and its threads.
Workload = tuple[Callable[[posenc.Client, int], int], int]


def _range_call(client: posenc.Client, index: int) -> int:
    """A cold 1 MiB ``get_range``; the rows it fetched."""
    start = index * ROWS
    client.get_range(start, start + ROWS, D_MODEL)
    return ROWS


def _large_call(client: posenc.Client, index: int) -> int:
    """A cold 64 MiB ``get_range`` (apart from every 1 MiB range); the rows it fetched."""
    start = (1 << 40) + index * LARGE_ROWS
    client.get_range(start, start + LARGE_ROWS, LARGE_D_MODEL)
    return LARGE_ROWS


def _scattered_call(client: posenc.Client, index: int) -> int:
    """``get_positions`` of scattered cold positions; the rows it fetched."""
    rng = np.random.default_rng(index)
    client.get_positions(rng.integers(0, 1 << 40, SCATTERED_ROWS), SCATTERED_D_MODEL)
    return SCATTERED_ROWS


def _throughput(
    client: posenc.Client,
    workload: Workload,
    starts: itertools.count[int],
    seconds: float,
) -> float:
    """Rows per second of the cold calls that the workload's threads sharing ``client``
    make for ``seconds``."""
    call, threads_count = workload
    done = [0] * threads_count
    end = time.monotonic() + seconds

    def work(index: int) -> None:
        while time.monotonic() < end:
            done[index] += call(client, next(starts))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
    t0 = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.monotonic() - t0)


def run(sizes: Sizes) -> Section:
    window = WINDOW[sizes.quick]
    section = Section(
        "p",
        "One client, several server processes",
        method=(
            f"One `posenc.Client` shared by {THREADS} threads, each making cold calls (the "
            "server computes every row) for a window: ranges, `get_range(s, s + "
            f"{ROWS}, {D_MODEL})` at a new `s` each call (1 MiB float32, one unary call, "
            f"one block); scattered, `get_positions` of {SCATTERED_ROWS} random positions "
            f"below 2**40 of a {SCATTERED_D_MODEL}-wide table (64 KiB; each row computed on "
            "its own: the server's work rather than the bytes); large ranges, one thread's "
            f"`get_range(s, s + {LARGE_ROWS}, {LARGE_D_MODEL})` (64 MiB, fetched in parts, "
            "one per server process the client's connections reach). Against a server of 1 "
            "process and one of 2 (`--processes`), each started for this section: the client "
            "with its default connections, and with `connections=1` (one HTTP/2 connection, "
            f"so one server process). {window:g} s per measurement, the kinds interleaved, "
            f"{sizes.repeats} repetitions; medians. Server CPU = CPU seconds of the "
            "server's processes per second. The client runs in the harness process, on "
            "the same machine (2 cores here, shared with the servers)."
        ),
    )
    servers = {n: procs.start_posenc(["--processes", str(n)]) for n in (1, 2)}
    kinds: dict[str, tuple[int, dict[str, Any]]] = {
        "1 process": (1, {}),
        "2 processes": (2, {}),
        "2 processes, connections=1": (2, {"connections": 1}),
    }
    workloads: dict[str, Workload] = {
        "ranges": (_range_call, THREADS),
        "scattered": (_scattered_call, THREADS),
        "large ranges": (_large_call, 1),
    }
    samples: dict[tuple[str, str], list[float]] = {(w, k): [] for w in workloads for k in kinds}
    server_cpu: dict[tuple[str, str], list[float]] = {key: [] for key in samples}
    starts = itertools.count(FIRST_START // ROWS)
    try:
        for server in servers.values():
            server.wait_ready()
            procs.wait_serving(server.target)
        clients: dict[str, Any] = {
            kind: posenc.Client(servers[n].target, timeout=60.0, **options)
            for kind, (n, options) in kinds.items()
        }
        try:
            for client in clients.values():  # warm-up: connections, specs, threads
                for work in workloads.values():
                    _throughput(client, work, starts, 0.5)
            for repeat in range(sizes.repeats):
                order = list(kinds)
                order = order[repeat % len(order) :] + order[: repeat % len(order)]
                for workload, work in workloads.items():
                    for kind in order:
                        pids = servers[kinds[kind][0]].pids
                        before, t0 = cpu_seconds(pids()), time.monotonic()
                        rate = _throughput(clients[kind], work, starts, window)
                        used = cpu_seconds(pids()) - before
                        samples[workload, kind].append(rate)
                        server_cpu[workload, kind].append(used / (time.monotonic() - t0))
        finally:
            for client in clients.values():
                client.close()
    finally:
        for server in servers.values():
            server.stop()
    medians = {key: median(v) for key, v in samples.items()}
    section.tables.append(
        Table(
            f"cold calls, one client ({THREADS} threads; large ranges: 1), ranges: MiB/s, "
            "scattered: rows/s",
            ["calls", "server", "median", "min", "max", "server CPU"],
            [
                [
                    workload,
                    kind,
                    f"{_shown(workload, medians[workload, kind]):.0f}",
                    f"{_shown(workload, min(samples[workload, kind])):.0f}",
                    f"{_shown(workload, max(samples[workload, kind])):.0f}",
                    f"{median(server_cpu[workload, kind]):.2f}",
                ]
                for workload in workloads
                for kind in kinds
            ],
        )
    )
    for workload in workloads:
        section.targets += [
            Target(
                f"one client's cold throughput ({workload}), 2 server processes / 1",
                ratio(medians[workload, "2 processes"], medians[workload, "1 process"]),
                ">=",
                1.3,
            ),
            Target(
                f"the same with connections=1 ({workload}), 2 server processes / 1",
                ratio(
                    medians[workload, "2 processes, connections=1"],
                    medians[workload, "1 process"],
                ),
                "",
                0.0,
            ),
        ]
    section.data = {
        "rows_per_s": {f"{w}, {kind}": v for (w, kind), v in samples.items()},
        "server_cpu_per_s": {f"{w}, {kind}": v for (w, kind), v in server_cpu.items()},
        "threads": THREADS,
        "window_s": window,
    }
    return section


def _shown(workload: str, rows_per_s: float) -> float:
    """MiB/s for ranges, rows/s for scattered lookups."""
    if workload == "scattered":
        return rows_per_s
    return rows_per_s * (D_MODEL if workload == "ranges" else LARGE_D_MODEL) * 4 / MIB
