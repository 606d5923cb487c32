"""d. Concurrency: aggregate throughput of 1..16 client processes against the raw floor."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from typing import Any

from bench.common import MIB, Section, Sizes, Table, Target, cpu_seconds, median, ratio
from bench.harness import Servers

D_MODEL = 1024
_REPLY_GRACE = 120.0


def _posenc_until(client: Any, rows: int, start: float, end: float) -> int:
    counted = 0
    while time.monotonic() < end:
        slices = client.iter_range(0, rows, D_MODEL, timeout=max(1.0, end - time.monotonic()) + 60)
        try:
            for _, chunk in slices:
                now = time.monotonic()
                if now >= end:
                    break
                if now >= start:
                    counted += chunk.nbytes
        finally:
            slices.close()  # cancels the stream when we stop in the middle of it
    return counted


def _worker(conn: Connection, posenc_target: str, floor_target: str, stream_bytes: int) -> None:
    """One client process: its own posenc.Client and floor channel; runs what it is sent."""
    import posenc
    from bench.floor import FloorClient

    rows = stream_bytes // (D_MODEL * 4)
    client = posenc.Client(posenc_target, timeout=60.0)
    floor = FloorClient(floor_target)
    try:
        client.server_info()
        floor.wait_ready()
        conn.send(("ready", os.getpid()))
        while conn.poll(600):  # bounded: a parent that vanished ends us within 10 minutes
            message = conn.recv()
            if message[0] != "run":
                break
            _, kind, start, end = message
            if kind == "floor":
                got = floor.stream_until(stream_bytes, start, end)
            else:
                got = _posenc_until(client, rows, start, end)
            conn.send(("done", got))
    finally:
        client.close()
        floor.close()


class ClientPool:
    """``size`` spawned client processes (spawn: no fork of a process that runs gRPC)."""

    def __init__(self, size: int, posenc_target: str, floor_target: str, stream_bytes: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.workers: list[tuple[Any, Connection]] = []
        try:
            for _ in range(size):
                parent, child = context.Pipe()
                process = context.Process(
                    target=_worker,
                    args=(child, posenc_target, floor_target, stream_bytes),
                    daemon=True,
                )
                process.start()
                self.workers.append((process, parent))
            for process, conn in self.workers:
                if not conn.poll(120):
                    raise RuntimeError(f"client process {process.pid} did not start")
                conn.recv()
        except BaseException:
            self.close()
            raise

    def run(self, clients: int, kind: str, window: float) -> tuple[int, float]:
        """``clients`` processes stream ``kind`` for ``window`` s from a common start; returns
        the bytes received in the window."""
        start = time.monotonic() + 0.25 + 0.02 * clients
        end = start + window
        chosen = self.workers[:clients]
        for _, conn in chosen:
            conn.send(("run", kind, start, end))
        total = 0
        for process, conn in chosen:
            if not conn.poll(window + _REPLY_GRACE):
                raise RuntimeError(f"client process {process.pid} did not answer")
            total += int(conn.recv()[1])
        return total, window

    def close(self) -> None:
        for _, conn in self.workers:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(("stop",))
        for process, _ in self.workers:
            process.join(5)
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)


def run(sizes: Sizes, servers: Servers) -> Section:
    levels = sizes.concurrency_levels
    window = sizes.concurrency_window
    stream_mib = sizes.concurrency_stream_bytes // MIB
    section = Section(
        "d",
        "Concurrency",
        method=(
            f"N client processes (spawned; each its own posenc.Client / floor channel) stream "
            f"concurrently for a {window:g} s window from a common start: posenc = "
            f"`iter_range` over the same {stream_mib} MiB range (d_model {D_MODEL} float32, "
            f"warm: served from the cache) again and again; floor = {stream_mib} MiB of 1 MiB "
            "messages again and again, each message copied into a new numpy array as "
            "iter_range does. Aggregate = bytes received in the window / window. Server "
            f"processes: posenc {servers.processes}, floor {servers.processes} (SO_REUSEPORT). "
            f"Levels and servers interleaved, {sizes.concurrency_repeats} repetitions; medians. "
            "Server CPU = CPU seconds of the server's processes per second of window "
            f"({os.cpu_count()} CPUs on this machine, shared with the clients)."
        ),
    )
    samples: dict[str, dict[int, list[float]]] = {"posenc": {}, "floor": {}}
    server_cpu: dict[str, dict[int, list[float]]] = {"posenc": {}, "floor": {}}
    pids = {"posenc": servers.posenc_pids, "floor": servers.floor_pids}
    pool = ClientPool(
        max(levels), servers.posenc_target, servers.floor_target, sizes.concurrency_stream_bytes
    )
    try:
        for kind in ("posenc", "floor"):  # warm-up: connections, caches of every server process
            pool.run(max(levels), kind, 0.5)
        for repeat in range(sizes.concurrency_repeats):
            for index, clients in enumerate(levels):
                kinds = ("posenc", "floor") if (repeat + index) % 2 == 0 else ("floor", "posenc")
                for kind in kinds:
                    before = cpu_seconds(pids[kind]())
                    got, seconds = pool.run(clients, kind, window)
                    used = cpu_seconds(pids[kind]()) - before
                    samples[kind].setdefault(clients, []).append(got / MIB / seconds)
                    server_cpu[kind].setdefault(clients, []).append(used / seconds)
    finally:
        pool.close()

    rows: list[list[Any]] = []
    medians = {kind: {n: median(v) for n, v in by_n.items()} for kind, by_n in samples.items()}
    for clients in levels:
        p, f = medians["posenc"][clients], medians["floor"][clients]
        rows.append(
            [
                clients,
                f"{p:.0f}",
                f"{f:.0f}",
                f"{ratio(p, f):.2f}",
                f"{median(server_cpu['posenc'][clients]):.2f}",
                f"{median(server_cpu['floor'][clients]):.2f}",
            ]
        )
        if clients in (4, 16):
            section.targets.append(
                Target(f"aggregate at {clients} clients / floor", ratio(p, f), ">=", 0.7)
            )
    section.tables.append(
        Table(
            "aggregate throughput",
            [
                "clients",
                "posenc MiB/s",
                "floor MiB/s",
                "posenc x floor",
                "posenc server CPU",
                "floor server CPU",
            ],
            rows,
        )
    )
    section.data = {
        "mib_per_s": {kind: {str(n): v for n, v in by_n.items()} for kind, by_n in samples.items()},
        "median_mib_per_s": {
            kind: {str(n): v for n, v in by_n.items()} for kind, by_n in medians.items()
        },
        "server_cpu_per_s": {
            kind: {str(n): v for n, v in by_n.items()} for kind, by_n in server_cpu.items()
        },
        "window_s": window,
        "server_processes": servers.processes,
    }
    return section
