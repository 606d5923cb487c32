"""Section c's decode steps against memory: a cached step and a numpy gather of its rows.

A decode loop's step whose rows are in the row cache needs no I/O: its floor is a numpy
gather of the same rows from a table in memory. Measured here side by side, in one run:

- cached steps (sync and async clients; 1 and 64 sequences; d_model 128 and 4096), back to
  back and after 5 ms of model time, each step beside a gather of as many rows of as wide a
  table, made after the same pause: the ratio step / gather;
- 64 sequences advancing back to back with nothing waited for: each step against the gather
  plus the wire time of its bytes at the floor's own stream bandwidth, measured in the same
  run (1.5x at p50, 3x at p99: read-ahead keeps up).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

import posenc
from bench.common import MIB, Section, Sizes, Table, median, percentile, ratio, runs_target
from bench.floor import FloorClient

MODEL_SECONDS = 0.005
WIDTHS = (128, 4096)
SEQUENCES = (1, 64)
# Far from the other phases' positions: the server computes these blocks for this phase.
FIRST_POSITION = 40_000_000
STRIDE = 9_973
# Bytes the floor streams to measure its bandwidth, and how many times.
_WIRE_BYTES = 64 * MIB
_WIRE_RUNS = 3


def _cached(client: Any, positions: npt.NDArray[np.int64], width: int) -> bool:
    """Whether the client's row cache holds the rows of ``positions`` (untimed)."""
    form = client._core._forms.get((width, None))
    if form is None:
        return False
    rows = client._core.rows
    with rows._lock:
        index = rows._index.get(form.key)
        return index is not None and all(int(p) in index for p in positions)


def _until_cached(client: Any, positions: npt.NDArray[np.int64], width: int) -> None:
    """Untimed: until the row cache holds ``positions`` (read-ahead landed)."""
    deadline = time.monotonic() + 10.0
    while not _cached(client, positions, width) and time.monotonic() < deadline:
        time.sleep(0.0005)


class _Gather:
    """The floor of a cached step: ``n`` rows of a ``width``-wide float32 table in memory,
    gathered (fancy indexing, a new array) by a new index array each step."""

    def __init__(self, n: int, width: int, steps: int) -> None:
        self.table = np.random.default_rng(1).random((n * 64 + steps, width), dtype=np.float32)
        self.base = np.arange(n, dtype=np.int64) * 64

    def __call__(self, step: int) -> float:
        index = self.base + step % 64
        t0 = time.perf_counter()
        self.table[index]
        return time.perf_counter() - t0


class _Phase:
    """One phase's steps of ``n`` sequences, each beside a gather of as many rows; the
    first ``warmup`` steps are made but not kept."""

    def __init__(self, n: int, width: int, warmup: int, measured: int, offset: int) -> None:
        self.gather = _Gather(n, width, warmup + measured)
        self.starts = FIRST_POSITION + offset + STRIDE * np.arange(n, dtype=np.int64)
        self.warmup = warmup
        self.rounds = warmup + measured
        self.steps: list[float] = []
        self.gathers: list[float] = []

    def record(self, t: int, elapsed: float) -> None:
        """Step ``t`` took ``elapsed`` seconds: its gather is made now, after it."""
        floor = self.gather(t)
        if t >= self.warmup:
            self.steps.append(elapsed)
            self.gathers.append(floor)

    def result(self) -> tuple[list[float], list[float]]:
        return self.steps, self.gathers


def _phase_sync(
    target: str, n: int, width: int, pause: float, warmup: int, measured: int, offset: int
) -> tuple[list[float], list[float]]:
    """Cached steps of a blocking client, each beside a gather: (steps, gathers) seconds."""
    phase = _Phase(n, width, warmup, measured, offset)
    with posenc.Client(target, timeout=30.0) as client:
        for t in range(phase.rounds):
            positions = phase.starts + t
            if t >= 2:  # the first steps teach the client the width and the sequences
                _until_cached(client, positions, width)
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            client.get_positions(positions, width)
            elapsed = time.perf_counter() - t0
            if pause:
                time.sleep(pause)
            phase.record(t, elapsed)
    return phase.result()


def _phase_async(
    target: str, n: int, width: int, pause: float, warmup: int, measured: int, offset: int
) -> tuple[list[float], list[float]]:
    """The same with an asyncio client (its own event loop)."""
    phase = _Phase(n, width, warmup, measured, offset)

    async def main() -> None:
        async with posenc.AsyncClient(target, timeout=30.0) as client:
            for t in range(phase.rounds):
                positions = phase.starts + t
                if t >= 2:
                    deadline = time.monotonic() + 10.0
                    while not _cached(client, positions, width) and time.monotonic() < deadline:
                        await asyncio.sleep(0.0005)
                if pause:
                    time.sleep(pause)  # the model: it holds the thread, as a forward pass
                t0 = time.perf_counter()
                await client.get_positions(positions, width)
                elapsed = time.perf_counter() - t0
                if pause:
                    time.sleep(pause)
                phase.record(t, elapsed)
                await asyncio.sleep(0)  # read-ahead claims and tasks run between steps

    asyncio.run(main())
    return phase.result()


def _free_running(
    target: str, n: int, width: int, warmup: int, measured: int, offset: int
) -> tuple[list[float], list[float]]:
    """Steps advancing back to back with nothing waited for (read-ahead must keep up),
    each beside a gather: (steps, gathers)."""
    phase = _Phase(n, width, warmup, measured, offset)
    with posenc.Client(target, timeout=30.0) as client:
        for t in range(phase.rounds):
            t0 = time.perf_counter()
            client.get_positions(phase.starts + t, width)
            phase.record(t, time.perf_counter() - t0)
    return phase.result()


def _wire_seconds_per_byte(floor_target: str) -> list[float]:
    """The floor's stream bandwidth (seconds a byte), measured ``_WIRE_RUNS`` times."""
    floor = FloorClient(floor_target)
    try:
        floor.wait_ready()
        floor.get(_WIRE_BYTES)  # the connection's window grown, the payload built
        values = []
        for _ in range(_WIRE_RUNS):
            t0 = time.perf_counter()
            floor.get(_WIRE_BYTES)
            values.append((time.perf_counter() - t0) / _WIRE_BYTES)
        return values
    finally:
        floor.close()


def add_to(section: Section, sizes: Sizes, posenc_target: str, floor_target: str) -> None:
    """Measures the cached steps and the free-running loop; adds their tables and targets
    to ``section``."""
    runs = sizes.latency_runs
    warmup = 20 if sizes.quick else 50
    per_run = 100 if sizes.quick else 300
    rows: list[list[str]] = []
    data: dict[str, Any] = {}
    offset = 0
    phases: list[tuple[str, Callable[..., tuple[list[float], list[float]]]]] = [
        ("sync", _phase_sync),
        ("async", _phase_async),
    ]
    for n in SEQUENCES:
        for width in WIDTHS:
            for mode, phase in phases:
                for pause, label in ((0.0, "back to back"), (MODEL_SECONDS, "after 5 ms")):
                    ratios: list[float] = []
                    steps_all: list[float] = []
                    gathers_all: list[float] = []
                    for _ in range(runs):
                        offset += 1_000_000
                        steps, gathers = phase(
                            posenc_target, n, width, pause, warmup, per_run, offset
                        )
                        ratios.append(ratio(median(steps), median(gathers)))
                        steps_all += steps
                        gathers_all += gathers
                    name = f"{n} x {width}, {mode}, {label}"
                    data[name] = {"ratios": ratios, "step_s": steps_all, "gather_s": gathers_all}
                    rows.append(
                        [
                            name,
                            f"{median(steps_all) * 1e6:.1f}",
                            f"{percentile(steps_all, 99) * 1e6:.1f}",
                            f"{median(gathers_all) * 1e6:.1f}",
                            f"{median(ratios):.2f} ({min(ratios):.2f} - {max(ratios):.2f})",
                        ]
                    )
                    section.targets.append(
                        runs_target(
                            f"cached step / numpy gather, {name} (p50)",
                            ratios,
                            "<=",
                            10.0 if n == 1 else 3.0,
                        )
                    )
    section.tables.append(
        Table(
            f"cached decode steps against a numpy gather of their rows ({runs} runs of "
            f"{per_run} steps)",
            ["sequences x d_model, client, loop", "p50 us", "p99 us", "gather p50 us", "x gather"],
            rows,
        )
    )

    # 64 sequences back to back, nothing waited for: read-ahead must keep up.
    wire = _wire_seconds_per_byte(floor_target)
    per_byte = median(wire)
    n, width = SEQUENCES[-1], WIDTHS[-1]
    step_bytes = n * width * 4
    p50s: list[float] = []
    p99s: list[float] = []
    free_rows = []
    for index in range(runs):
        offset += 1_000_000
        steps, gathers = _free_running(posenc_target, n, width, warmup, per_run, offset)
        floor = median(gathers) + step_bytes * per_byte
        p50s.append(ratio(median(steps), floor))
        p99s.append(ratio(percentile(steps, 99), floor))
        free_rows.append(
            [
                f"run {index + 1}",
                f"{median(steps) * 1e6:.0f}",
                f"{percentile(steps, 99) * 1e6:.0f}",
                f"{median(gathers) * 1e6:.0f}",
                f"{step_bytes * per_byte * 1e6:.0f}",
                f"{p50s[-1]:.2f}",
                f"{p99s[-1]:.2f}",
            ]
        )
    section.tables.append(
        Table(
            f"{n} sequences x {width} back to back, nothing waited for: against the gather plus "
            f"the step's {step_bytes // 1024} KiB at the floor's stream bandwidth "
            f"({1 / per_byte / MIB:.0f} MiB/s, median of {_WIRE_RUNS} streams of "
            f"{_WIRE_BYTES // MIB} MiB)",
            ["run", "p50 us", "p99 us", "gather p50 us", "wire us", "p50 x floor", "p99 x floor"],
            free_rows,
        )
    )
    section.targets.append(
        runs_target(f"p50 {n} x {width} back to back / (gather + wire)", p50s, "<=", 1.5)
    )
    section.targets.append(
        runs_target(f"p99 {n} x {width} back to back / (gather + wire)", p99s, "<=", 3.0)
    )
    data["free_running"] = {"p50_ratios": p50s, "p99_ratios": p99s, "wire_s_per_byte": wire}
    section.data["decode"] = data
