"""e. Growth: time against rows and against d_model, each next to the floor for the same bytes."""

from __future__ import annotations

import time
from typing import Any

import posenc
from bench.common import MIB, Section, Sizes, Table, median, mib_per_s, ratio, rotated
from bench.floor import FloorClient
from bench.harness import Servers

TIMEOUT = 600.0


def _unary_max_bytes() -> int:
    try:
        from posenc import _channel

        return int(_channel.DEFAULT_UNARY_MAX_BYTES)
    except (ImportError, AttributeError):
        return MIB


def _measure(
    client: posenc.Client,
    floor: FloorClient,
    points: list[tuple[int, int]],
    repeats: int,
    first_start: int,
) -> dict[tuple[int, int], dict[str, list[float]]]:
    """For each (rows, d_model): get_range cold, then warm, and the floor for the same bytes
    (unary up to the SDK's unary limit, streamed above it, as the SDK chooses)."""
    unary_max = _unary_max_bytes()
    samples: dict[tuple[int, int], dict[str, list[float]]] = {
        point: {"cold": [], "warm": [], "floor": []} for point in points
    }

    # Small calls are cheap and noisier: they get 5x the repetitions.
    def reps(nbytes: int) -> int:
        return repeats * (5 if nbytes < 4 * MIB else 1)

    for repeat in range(max(reps(r * d * 4) for r, d in points)):
        for index, (rows, d_model) in enumerate(points):
            nbytes = rows * d_model * 4
            if repeat >= reps(nbytes):
                continue
            start = first_start + (repeat * len(points) + index) * 2**21

            def posenc_unit(rows: int = rows, d_model: int = d_model, start: int = start) -> None:
                for state in ("cold", "warm"):
                    t0 = time.perf_counter()
                    client.get_range(start, start + rows, d_model, timeout=TIMEOUT)
                    samples[(rows, d_model)][state].append(time.perf_counter() - t0)

            def floor_unit(nbytes: int = nbytes, point: tuple[int, int] = (rows, d_model)) -> None:
                t0 = time.perf_counter()
                if nbytes <= unary_max:
                    floor.unary(nbytes)
                else:
                    floor.get(nbytes, TIMEOUT)
                samples[point]["floor"].append(time.perf_counter() - t0)

            for unit in rotated([posenc_unit, floor_unit], repeat + index):
                unit()
    return samples


def run(sizes: Sizes, servers: Servers) -> Section:
    d_model = sizes.growth_d_model
    width_bytes = sizes.growth_width_bytes
    section = Section(
        "e",
        "Growth",
        method=(
            f"`get_range` through the SDK (client in the harness process). Against rows: "
            f"d_model {d_model} float32, {sizes.growth_rows[0]} to {sizes.growth_rows[-1]:,} "
            f"rows. Against d_model: fixed bytes ({width_bytes // MIB} MiB float32 per call, so "
            "rows = bytes / (4 d_model)). cold = a range not fetched before (new start per "
            "repetition), warm = the same call again; floor = the trivial server sending "
            f"the same bytes (a unary call up to the SDK's unary limit of {_unary_max_bytes()} "
            "bytes, a stream of 1 MiB messages above it, as the SDK decides). "
            f"{sizes.repeats} repetitions interleaved ({5 * sizes.repeats} for calls under "
            "4 MiB); medians."
        ),
    )
    with posenc.Client(servers.posenc_target, timeout=TIMEOUT) as client:
        floor = FloorClient(servers.floor_target)
        try:
            floor.wait_ready()
            client.get_range(0, 1, d_model)
            budget = client.server_info().cache.budget_bytes
            row_points = [(rows, d_model) for rows in sizes.growth_rows]
            width_points = [(max(1, width_bytes // (4 * d)), d) for d in sizes.growth_widths]
            by_rows = _measure(client, floor, row_points, sizes.repeats, 7 * 10**9)
            by_width = _measure(client, floor, width_points, sizes.repeats, 11 * 10**9)
        finally:
            floor.close()

    def table(points: dict[tuple[int, int], dict[str, list[float]]], key: str) -> list[list[Any]]:
        rows_out: list[list[Any]] = []
        for (rows, d), s in points.items():
            nbytes = rows * d * 4
            cold, warm, fl = median(s["cold"]), median(s["warm"]), median(s["floor"])
            rows_out.append(
                [
                    f"{rows:,}" if key == "rows" else d,
                    f"{nbytes / MIB:.4g}",
                    f"{cold * 1e3:.2f}",
                    f"{warm * 1e3:.2f}" + (" *" if nbytes > budget else ""),
                    f"{fl * 1e3:.2f}",
                    f"{mib_per_s(nbytes, warm):.0f}",
                    f"{ratio(cold, fl):.2f}",
                    f"{ratio(warm, fl):.2f}",
                ]
            )
        return rows_out

    columns = [
        "MiB",
        "cold ms",
        "warm ms",
        "floor ms",
        "warm MiB/s",
        "cold time x floor",
        "warm time x floor",
    ]
    section.tables.append(
        Table(f"against rows (d_model {d_model})", ["rows", *columns], table(by_rows, "rows"))
    )
    section.tables.append(
        Table(
            f"against d_model ({width_bytes // MIB} MiB per call)",
            ["d_model", *columns],
            table(by_width, "d_model"),
        )
    )

    def as_json(points: dict[tuple[int, int], dict[str, list[float]]]) -> list[dict[str, Any]]:
        return [
            {
                "rows": rows,
                "d_model": d,
                "bytes": rows * d * 4,
                "seconds": s,
                "median_s": {k: median(v) for k, v in s.items()},
            }
            for (rows, d), s in points.items()
        ]

    section.data = {
        "by_rows": as_json(by_rows),
        "by_d_model": as_json(by_width),
        "cache_budget_per_process_bytes": budget,
    }
    if any(r * d * 4 > budget for r, d in [*by_rows, *by_width]):
        section.notes.append(
            f"\\* larger than the cache budget of a server process ({budget // MIB} MiB, from "
            "server_info): not cached, so the 'warm' call computes it again."
        )
    return section
