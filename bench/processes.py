"""p. One client, several server processes: cold throughput of one shared posenc.Client."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

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


def _throughput(client: posenc.Client, starts: itertools.count[int], seconds: float) -> float:
    """MiB/s of cold ``get_range`` calls that ``THREADS`` threads sharing ``client`` make
    for ``seconds``."""
    done = [0] * THREADS
    end = time.monotonic() + seconds

    def work(index: int) -> None:
        while time.monotonic() < end:
            start = next(starts) * ROWS
            client.get_range(start, start + ROWS, D_MODEL)
            done[index] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    t0 = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) * ROWS * D_MODEL * 4 / MIB / (time.monotonic() - t0)


def run(sizes: Sizes) -> Section:
    window = WINDOW[sizes.quick]
    section = Section(
        "p",
        "One client, several server processes",
        method=(
            f"One `posenc.Client` shared by {THREADS} threads, each calling `get_range(s, s + "
            f"{ROWS}, {D_MODEL})` (1 MiB float32, one unary call) at a new position each "
            "call, so the server computes every row (cold). Against a server of 1 process "
            "and one of 2 (`--processes`), each started for this section: the client with "
            "its default connections, and with `connections=1` (one HTTP/2 connection, so "
            f"one server process). {window:g} s per measurement, the three interleaved, "
            f"{sizes.repeats} repetitions; medians. Server CPU = CPU seconds of the "
            "server's processes per second. The client runs in the harness process, on "
            "the same machine."
        ),
    )
    servers = {n: procs.start_posenc(["--processes", str(n)]) for n in (1, 2)}
    kinds = {
        "1 process": (1, {}),
        "2 processes": (2, {}),
        "2 processes, connections=1": (2, {"connections": 1}),
    }
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    server_cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
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
                _throughput(client, starts, 0.5)
            for repeat in range(sizes.repeats):
                order = list(kinds)
                order = order[repeat % len(order) :] + order[: repeat % len(order)]
                for kind in order:
                    pids = servers[kinds[kind][0]].pids
                    before, t0 = cpu_seconds(pids()), time.monotonic()
                    samples[kind].append(_throughput(clients[kind], starts, window))
                    used = cpu_seconds(pids()) - before
                    server_cpu[kind].append(used / (time.monotonic() - t0))
        finally:
            for client in clients.values():
                client.close()
    finally:
        for server in servers.values():
            server.stop()
    medians = {kind: median(v) for kind, v in samples.items()}
    section.tables.append(
        Table(
            f"cold get_range, {THREADS} threads, one client",
            ["server", "MiB/s (median)", "min", "max", "server CPU"],
            [
                [
                    kind,
                    f"{medians[kind]:.0f}",
                    f"{min(samples[kind]):.0f}",
                    f"{max(samples[kind]):.0f}",
                    f"{median(server_cpu[kind]):.2f}",
                ]
                for kind in kinds
            ],
        )
    )
    section.targets += [
        Target(
            "one client's cold throughput, 2 server processes / 1",
            ratio(medians["2 processes"], medians["1 process"]),
            ">=",
            1.3,
        ),
        Target(
            "the same with connections=1, 2 server processes / 1",
            ratio(medians["2 processes, connections=1"], medians["1 process"]),
            "",
            0.0,
        ),
    ]
    section.data = {
        "mib_per_s": samples,
        "median_mib_per_s": medians,
        "server_cpu_per_s": server_cpu,
        "threads": THREADS,
        "window_s": window,
    }
    return section
