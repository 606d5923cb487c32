"""b. End to end through the SDK: get_range of 256 MiB, cold and warm, against the raw floor."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import posenc
from bench.common import (
    GIB,
    MIB,
    Section,
    Sizes,
    Table,
    Target,
    cpu_seconds,
    median,
    mib_per_s,
    ratio,
    rotated,
)
from bench.floor import FloorClient

TIMEOUT = 600.0


def run(
    sizes: Sizes,
    posenc_target: str,
    floor_target: str,
    posenc_pids: Callable[[], list[int]],
    floor_pids: Callable[[], list[int]],
) -> Section:
    rows, d_model = sizes.e2e_rows, sizes.e2e_d_model
    f32_bytes = rows * d_model * 4
    section = Section(
        "b",
        "End to end through the SDK",
        method=(
            f"`Client.get_range` of {rows} x {d_model} ({f32_bytes // MIB} MiB float32, "
            f"{f32_bytes // 2 // MIB} MiB bfloat16) from a posenc server process, in the harness "
            "process. cold = a range no earlier call asked for (a new start each repetition, "
            "so the server computes it); warm = the same range again right after (served from "
            "the server's cache). floor = the trivial server of this harness streaming "
            f"{f32_bytes // MIB} pre-built 1 MiB `bytes` messages (identity serializers), "
            "received with the SDK's channel options and copied into one numpy array "
            "allocated per call, as get_range does. Units run interleaved (order rotated), "
            f"{sizes.e2e_repeats} repetitions; medians (best: the fastest repetition). CPU: "
            "user + system seconds of the server's processes (/proc/PID/stat) and of the "
            "harness process (all its threads) during each call, per GiB of output."
        ),
    )
    samples: dict[str, list[float]] = {
        "floor": [],
        "float32 cold": [],
        "float32 warm": [],
        "bfloat16 cold": [],
        "bfloat16 warm": [],
    }
    nbytes = {
        "floor": f32_bytes,
        "float32 cold": f32_bytes,
        "float32 warm": f32_bytes,
        "bfloat16 cold": f32_bytes // 2,
        "bfloat16 warm": f32_bytes // 2,
    }
    server_cpu: dict[str, list[float]] = {name: [] for name in samples}
    client_cpu: dict[str, list[float]] = {name: [] for name in samples}

    def measured(name: str, pids: Callable[[], list[int]], call: Callable[[], object]) -> None:
        server_before, client_before = cpu_seconds(pids()), time.process_time()
        t0 = time.perf_counter()
        call()
        samples[name].append(time.perf_counter() - t0)
        client_cpu[name].append(time.process_time() - client_before)
        server_cpu[name].append(cpu_seconds(pids()) - server_before)

    with posenc.Client(posenc_target, timeout=TIMEOUT) as client:
        floor = FloorClient(floor_target)
        try:
            floor.wait_ready()
            client.get_range(0, 1, d_model)  # connect
            floor.get(f32_bytes)  # allocates and touches the floor's target array

            def floor_unit(repeat: int) -> None:
                measured("floor", floor_pids, lambda: floor.get(f32_bytes, TIMEOUT))

            def posenc_unit(dtype: str, repeat: int) -> None:
                # A start no other call of the run uses: the server has to compute it.
                start = 5 * 10**9 + (repeat * 2 + (dtype == "bfloat16")) * 2**22
                for state in ("cold", "warm"):
                    measured(
                        f"{dtype} {state}",
                        posenc_pids,
                        lambda: client.get_range(start, start + rows, d_model, dtype=dtype),
                    )

            units: list[Callable[[int], None]] = [
                floor_unit,
                lambda r: posenc_unit("float32", r),
                lambda r: posenc_unit("bfloat16", r),
            ]
            for repeat in range(sizes.e2e_repeats):
                for unit in rotated(units, repeat):
                    unit(repeat)
        finally:
            floor.close()

    speeds = {name: mib_per_s(nbytes[name], median(s)) for name, s in samples.items()}
    floor_speed = speeds["floor"]
    table_rows: list[list[Any]] = []
    for name, values in samples.items():
        table_rows.append(
            [
                name,
                f"{nbytes[name] // MIB}",
                f"{median(values) * 1e3:.0f}",
                f"{min(values) * 1e3:.0f}",
                f"{speeds[name]:.0f}",
                f"{ratio(speeds[name], floor_speed):.2f}",
                f"{median(server_cpu[name]) * GIB / nbytes[name] * 1e3:.0f}",
                f"{median(client_cpu[name]) * GIB / nbytes[name] * 1e3:.0f}",
            ]
        )
    section.tables.append(
        Table(
            f"get_range {rows} x {d_model}",
            [
                "what",
                "MiB",
                "median ms",
                "best ms",
                "MiB/s",
                "x floor MiB/s",
                "server CPU ms/GiB",
                "client CPU ms/GiB",
            ],
            table_rows,
        )
    )
    section.targets += [
        Target(
            "warm float32 get_range / floor", ratio(speeds["float32 warm"], floor_speed), ">=", 0.8
        ),
        Target(
            "cold float32 get_range / floor", ratio(speeds["float32 cold"], floor_speed), ">=", 0.35
        ),
        Target(
            "warm bfloat16 get_range / floor (MiB/s)",
            ratio(speeds["bfloat16 warm"], floor_speed),
            "",
            0.0,
        ),
        Target(
            "cold bfloat16 get_range / floor (MiB/s)",
            ratio(speeds["bfloat16 cold"], floor_speed),
            "",
            0.0,
        ),
    ]
    section.data = {
        "seconds": samples,
        "bytes": nbytes,
        "mib_per_s": speeds,
        "server_cpu_s": server_cpu,
        "client_cpu_s": client_cpu,
    }
    return section
