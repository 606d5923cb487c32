"""p. One client, several server processes: cold throughput of one shared posenc.Client."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import posenc
from bench import procs
from bench.common import (
    MIB,
    Section,
    Sizes,
    Table,
    children,
    cpu_seconds,
    median,
    ratio,
    runs_target,
)
from bench.harness import Servers

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
# A second server process speeds one client up only with cores to spare: the client runs on
# this machine too, and one process already computes several calls on several cores (the
# kernels release the GIL). The throughput bar is judged from this many usable cores; below
# that it is reported (with the cores busy with 1 process, which bound what a second adds).
JUDGED_FROM_CORES = 4
THROUGHPUT_BAR = 1.3


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


def _workers(server: procs.ServerProcess) -> list[int]:
    """The worker processes of a server started with ``--processes`` > 1: the children of
    its supervisor (the process the harness started), which serves no calls itself."""
    return sorted(set(children(server.pid)))


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


def run(sizes: Sizes, idle: Servers) -> Section:
    """Section p, on servers of 1 and 2 processes of its own (the ``idle`` ones unused)."""
    window = WINDOW[sizes.quick]
    cores = len(os.sched_getaffinity(0))
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
            f"so one server process). {window:g} s per measurement, the kinds interleaved "
            f"(order rotated), in {sizes.repeats} repetitions: the repetitions are the runs. "
            "The table gives the median (min, max) over the repetitions; the targets the "
            "median repetition (min - max of the repetitions), each repetition's ratio one of "
            "its own measurements. Server CPU = CPU seconds of the server's processes (a "
            "2-process server's supervisor included) per second; client CPU = CPU seconds of "
            "the harness process (all its threads: the client's) per second. The client runs "
            f"in the harness process, on the same machine ({cores} usable cores, shared with "
            "the servers). Cores busy with 1 process = (server CPU + client CPU) of the "
            f"1-process measurement / the {cores} usable cores (`os.sched_getaffinity`): "
            "near 1 (or above), a second server process finds little CPU left to use. A "
            f"second process's throughput against 1 is wanted >= {THROUGHPUT_BAR:g}x from "
            f"{JUDGED_FROM_CORES} usable cores; with fewer, where the client and both "
            "processes share them, it is reported, not judged (1 process over cores busy "
            "of b gains at most 1 / b). The "
            "less busy process's share = the CPU seconds of the 2-process server's less busy "
            "worker process over both workers' (/proc/PID/stat of each; the supervisor not "
            "counted), default connections: 0.5 when one client's calls reach both "
            "processes evenly, 0 when they reach one; wanted >= 0.3 (every process does its "
            "part of one client's work)."
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
    client_cpu: dict[tuple[str, str], list[float]] = {key: [] for key in samples}
    # 2-process kinds: each worker's CPU seconds per second, and the smaller worker's share.
    worker_cpu: dict[tuple[str, str], list[list[float]]] = {
        key: [] for key in samples if kinds[key[1]][0] == 2
    }
    worker_share: dict[tuple[str, str], list[float]] = {key: [] for key in worker_cpu}
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
                        server = servers[kinds[kind][0]]
                        workers = _workers(server) if (workload, kind) in worker_cpu else []
                        before = cpu_seconds(server.pids())
                        workers_before = [cpu_seconds([pid]) for pid in workers]
                        client_before, t0 = time.process_time(), time.monotonic()
                        rate = _throughput(clients[kind], work, starts, window)
                        client_used = time.process_time() - client_before
                        used = cpu_seconds(server.pids()) - before
                        workers_used = [
                            cpu_seconds([pid]) - start
                            for pid, start in zip(workers, workers_before, strict=True)
                        ]
                        elapsed = time.monotonic() - t0
                        samples[workload, kind].append(rate)
                        server_cpu[workload, kind].append(used / elapsed)
                        client_cpu[workload, kind].append(client_used / elapsed)
                        if (workload, kind) in worker_cpu:
                            worker_cpu[workload, kind].append([u / elapsed for u in workers_used])
                            # Two workers, the same before and after: else no share is known.
                            same = len(workers) == 2 and _workers(server) == workers
                            worker_share[workload, kind].append(
                                ratio(min(workers_used), sum(workers_used))
                                if same
                                else float("nan")
                            )
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
            ["calls", "server", "median", "min", "max", "server CPU", "client CPU"],
            [
                [
                    workload,
                    kind,
                    f"{_shown(workload, medians[workload, kind]):.0f}",
                    f"{_shown(workload, min(samples[workload, kind])):.0f}",
                    f"{_shown(workload, max(samples[workload, kind])):.0f}",
                    f"{median(server_cpu[workload, kind]):.2f}",
                    f"{median(client_cpu[workload, kind]):.2f}",
                ]
                for workload in workloads
                for kind in kinds
            ],
        )
    )

    def per_repetition(workload: str, kind: str) -> list[float]:
        """Each repetition's throughput of ``kind`` over that of 1 process."""
        return [
            ratio(rate, one)
            for rate, one in zip(
                samples[workload, kind], samples[workload, "1 process"], strict=True
            )
        ]

    measured_targets: list[tuple[str, list[float], str, float, str]] = []
    for workload in workloads:
        busy = [
            (server_s + client_s) / cores
            for server_s, client_s in zip(
                server_cpu[workload, "1 process"], client_cpu[workload, "1 process"], strict=True
            )
        ]
        judged = cores >= JUDGED_FROM_CORES
        measured_targets += [
            (
                f"one client's cold throughput ({workload}), 2 server processes / 1"
                + ("" if judged else f" (judged from {JUDGED_FROM_CORES} usable cores)"),
                per_repetition(workload, "2 processes"),
                ">=" if judged else "",
                THROUGHPUT_BAR if judged else 0.0,
                "x",
            ),
            (
                f"the same with connections=1 ({workload}), 2 server processes / 1",
                per_repetition(workload, "2 processes, connections=1"),
                "",
                0.0,
                "x",
            ),
            (
                f"cores busy with 1 server process ({workload}): (server + client CPU seconds "
                f"per second) / {cores} usable cores",
                busy,
                "",
                0.0,
                "",
            ),
            (
                f"2 server processes ({workload}): the less busy process's share of their CPU "
                "(0.5 = even; 0.25 = 3 threads' calls of 4 on one process)",
                worker_share[workload, "2 processes"],
                ">=",
                0.3,
                "",
            ),
        ]
    section.targets += [
        runs_target(name, values, op, threshold, unit)
        for name, values, op, threshold, unit in measured_targets
    ]
    section.data = {
        "rows_per_s": {f"{w}, {kind}": v for (w, kind), v in samples.items()},
        "server_cpu_per_s": {f"{w}, {kind}": v for (w, kind), v in server_cpu.items()},
        "client_cpu_per_s": {f"{w}, {kind}": v for (w, kind), v in client_cpu.items()},
        "worker_cpu_per_s": {f"{w}, {kind}": v for (w, kind), v in worker_cpu.items()},
        "smaller_worker_share": {f"{w}, {kind}": v for (w, kind), v in worker_share.items()},
        "usable_cores": cores,
        "runs": {name: values for name, values, *_ in measured_targets},
        "threads": THREADS,
        "window_s": window,
    }
    return section


def _shown(workload: str, rows_per_s: float) -> float:
    """MiB/s for ranges, rows/s for scattered lookups."""
    if workload == "scattered":
        return rows_per_s
    return rows_per_s * (D_MODEL if workload == "ranges" else LARGE_D_MODEL) * 4 / MIB
