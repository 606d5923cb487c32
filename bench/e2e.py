"""b. End to end through the SDK: get_range of 256 MiB, cold and warm, against the raw floor."""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import posenc
from bench import procs
from bench.common import (
    GIB,
    MIB,
    Section,
    Sizes,
    Table,
    cpu_seconds,
    median,
    mib_per_s,
    ratio,
    runs_target,
)
from bench.engine_bench import plain_numpy
from bench.floor import FloorClient
from bench.harness import Servers

TIMEOUT = 600.0
# The local computation runs in slices of this many rows (its float64 temporaries stay small).
_LOCAL_SLICE_ROWS = 1024
_RIGHT_AFTER = "right after another was freed"
_IDLE_SECONDS = 2.0
_AFTER_IDLE = f"after the freed memory sat idle {_IDLE_SECONDS:.0f} s"
# The floor of half precision's transfers: half the bytes of float32's.
_HALF_FLOOR = "floor, half the bytes"
# The dtypes of the posenc units, in the order their ranges' starts are taken.
_DTYPES = ("float32", "bfloat16", "float16")


def run(sizes: Sizes, servers: Servers) -> Section:
    """Section b, each run on a posenc server (``servers.flags``) and a floor server of
    ``servers.processes`` processes started for it, beside the idle ``servers``."""
    rows, d_model = sizes.e2e_rows, sizes.e2e_d_model
    f32_bytes = rows * d_model * 4
    runs = sizes.e2e_runs
    per_run = max(1, sizes.e2e_repeats // runs)
    section = Section(
        "b",
        "End to end through the SDK",
        method=(
            f"`Client.get_range` of {rows} x {d_model} ({f32_bytes // MIB} MiB float32, "
            f"{f32_bytes // 2 // MIB} MiB bfloat16 or float16) from a posenc server process, in "
            "the harness "
            "process, into a new array. cold = a range no earlier call asked for (a new start "
            "each repetition, so the server computes it); warm = the same range again right "
            "after (served from the server's cache); new spec = cold, and the first table of "
            "a spec the server has never seen (a new base each repetition); out= = into "
            "an already-touched array (cold: another new range). floor = the trivial server "
            "of this harness streaming "
            f"{f32_bytes // MIB} pre-built 1 MiB `bytes` messages (identity serializers), "
            "received with the SDK's channel options and each copied once into one "
            "already-touched numpy array: the least a client must do; half precision's "
            f"floor streams {f32_bytes // 2 // MIB} MiB, the same transfer as theirs (its "
            "row: floor, half the bytes). local numpy = the same "
            "table computed in the harness with plain accurate numpy (float64 angles, np.sin, "
            f"np.cos; slices of {_LOCAL_SLICE_ROWS} rows into one array). Each run has a posenc "
            f"server and a floor server of {servers.processes} processes started for it (how "
            "fast a "
            "server process streams differs from one process to the next more than between "
            "runs on one process). After one repetition of every unit that is not counted "
            "(the server processes' heaps grow while their caches first fill), units run "
            "interleaved (a new order each repetition) in "
            f"{runs} runs of {per_run} repetitions, the local computation after each run's "
            "calls (it takes both cores for seconds); the table gives medians over all "
            "repetitions (best: the fastest), the targets the median "
            "run (min - max of the runs), each run's ratio a ratio of its medians. CPU: user + "
            "system seconds of the server's processes (/proc/PID/stat) and of the harness "
            "process (all its threads) during each call, per GiB of output. Last, what a "
            "new result array's pages cost: a new array of the float32 size touched once "
            "per page, right after another was freed, and after the freed memory sat idle."
        ),
    )
    names = [
        "floor",
        _HALF_FLOOR,
        "float32 cold",
        "float32 warm",
        "float32 warm, out=",
        "float32 cold, out=",
        "float32 cold, new spec",
        "bfloat16 cold",
        "bfloat16 warm",
        "float16 cold",
        "float16 warm",
        "local numpy float32",
    ]
    samples: dict[str, list[float]] = {name: [] for name in names}
    nbytes = {
        name: f32_bytes // 2 if name == _HALF_FLOOR or "float16" in name else f32_bytes
        for name in names
    }
    server_cpu: dict[str, list[float]] = {name: [] for name in samples}
    client_cpu: dict[str, list[float]] = {name: [] for name in samples}

    counting = False  # a run's first repetition is not counted

    def measured(name: str, pids: Callable[[], list[int]], call: Callable[[], object]) -> None:
        server_before, client_before = cpu_seconds(pids()), time.process_time()
        t0 = time.perf_counter()
        call()
        if counting:
            samples[name].append(time.perf_counter() - t0)
            client_cpu[name].append(time.process_time() - client_before)
            server_cpu[name].append(cpu_seconds(pids()) - server_before)

    local_out = np.ones((rows, d_model), dtype=np.float32)
    touched = np.ones((rows, d_model), dtype=np.float32)

    def local(start: int) -> None:
        for first in range(0, rows, _LOCAL_SLICE_ROWS):
            last = min(first + _LOCAL_SLICE_ROWS, rows)
            local_out[first:last] = plain_numpy(start + first, last - first, d_model)

    def measure_run(
        index: int, server: procs.ServerProcess, floor_server: procs.FloorServer
    ) -> None:
        nonlocal counting
        posenc_pids = server.pids
        floor_pids = floor_server.pids

        with (
            posenc.Client(server.target, timeout=TIMEOUT) as client,
            contextlib.closing(FloorClient(floor_server.target)) as floor,
        ):
            floor.wait_ready()
            client.get_range(0, 1, d_model)  # connect
            for name in ("floor", _HALF_FLOOR):  # allocates and touches the target arrays
                floor.get(nbytes[name])

            def floor_unit(name: str) -> Callable[[int], None]:
                call = functools.partial(floor.get, nbytes[name], TIMEOUT)
                return lambda repeat: measured(name, floor_pids, call)

            def posenc_unit(dtype: str, repeat: int) -> None:
                # A start no other call of the run uses: the server has to compute it.
                start = 5 * 10**9 + (repeat * 3 + _DTYPES.index(dtype) + 1) * 2**22
                for state in ("cold", "warm"):
                    measured(
                        f"{dtype} {state}",
                        posenc_pids,
                        lambda: client.get_range(start, start + rows, d_model, dtype=dtype),
                    )
                if dtype == "float32":
                    measured(
                        "float32 warm, out=",
                        posenc_pids,
                        lambda: client.get_range(start, start + rows, d_model, out=touched),
                    )
                    # Cold again, into the touched array: what is left without the new
                    # array's fresh pages (a range of this repetition no call asked for).
                    cold = start + 2**21
                    measured(
                        "float32 cold, out=",
                        posenc_pids,
                        lambda: client.get_range(cold, cold + rows, d_model, out=touched),
                    )

            def new_spec_unit(repeat: int) -> None:
                start = 6 * 10**9 + repeat * 2**22
                base = 10000.0 + 0.25 * (repeat + 1)  # a spec no call asked for before
                measured(
                    "float32 cold, new spec",
                    posenc_pids,
                    lambda: client.get_range(start, start + rows, d_model, base=base),
                )

            def local_unit(repeat: int) -> None:
                start = 5 * 10**9 + repeat * 3 * 2**22
                measured("local numpy float32", list, lambda: local(start))

            units: list[Callable[[int], None]] = [
                floor_unit("floor"),
                lambda r: posenc_unit("float32", r),
                new_spec_unit,
                floor_unit(_HALF_FLOOR),
                lambda r: posenc_unit("bfloat16", r),
                lambda r: posenc_unit("float16", r),
            ]
            # One repetition of every unit first, not counted (its starts and base are
            # none of the run's measured ones): the server processes' heaps grow while
            # their caches first fill, a page fault per page.
            counting = False
            for unit in units:
                unit(runs * per_run + index)
            counting = True
            for repeat in range(index * per_run, (index + 1) * per_run):
                # An order of its own (seeded), so that no unit always comes after the same
                # one: what ran just before a call changes how fast it runs.
                order = list(units)
                random.Random(repeat).shuffle(order)
                for unit in order:
                    unit(repeat)
            # The local computation after the calls, not among them: it takes both cores
            # for seconds and frees hundreds of MiB, which slows whatever call comes next.
            for repeat in range(index * per_run, (index + 1) * per_run):
                local_unit(repeat)

    for index in range(runs):
        with procs.serving_pair(servers.flags, servers.processes) as (server, floor_server):
            measure_run(index, server, floor_server)

    speeds = {name: mib_per_s(nbytes[name], median(s)) for name, s in samples.items()}
    # Each row against the floor of its bytes.
    floor_speeds = {nbytes[name]: speeds[name] for name in ("floor", _HALF_FLOOR)}
    table_rows: list[list[Any]] = []
    for name, values in samples.items():
        table_rows.append(
            [
                name,
                f"{nbytes[name] // MIB}",
                f"{median(values) * 1e3:.0f}",
                f"{min(values) * 1e3:.0f}",
                f"{speeds[name]:.0f}",
                f"{ratio(speeds[name], floor_speeds[nbytes[name]]):.2f}",
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

    def per_run_ratio(name: str, reference: str) -> list[float]:
        """Each run's speed of ``name`` over that of ``reference``, from the run's medians."""
        out = []
        for index in range(runs):
            part = slice(index * per_run, (index + 1) * per_run)
            speed = mib_per_s(nbytes[name], median(samples[name][part]))
            out.append(ratio(speed, mib_per_s(nbytes[reference], median(samples[reference][part]))))
        return out

    section.targets += [
        runs_target(
            "warm float32 get_range / floor", per_run_ratio("float32 warm", "floor"), ">=", 0.95
        ),
        runs_target(
            "cold float32 get_range / floor (spec known)",
            per_run_ratio("float32 cold", "floor"),
            ">=",
            0.7,
        ),
        runs_target(
            "cold float32 get_range, first table of a new spec / floor",
            per_run_ratio("float32 cold, new spec", "floor"),
            ">=",
            0.6,
        ),
        runs_target(
            "end to end: local plain numpy time / cold float32 get_range time",
            per_run_ratio("float32 cold", "local numpy float32"),
            ">=",
            4.0,
        ),
        runs_target(
            "cold float32 get_range into out= / floor",
            per_run_ratio("float32 cold, out=", "floor"),
            "",
            0.0,
        ),
        runs_target(
            "end to end, both into an already-touched array: local plain numpy time / cold "
            "float32 get_range time",
            per_run_ratio("float32 cold, out=", "local numpy float32"),
            "",
            0.0,
        ),
        runs_target(
            "warm float32 get_range into out= / floor",
            per_run_ratio("float32 warm, out=", "floor"),
            "",
            0.0,
        ),
    ]
    # Half precision at float32's speed per byte: the MiB/s of a floor of the same bytes.
    for dtype in _DTYPES[1:]:
        section.targets += [
            runs_target(
                f"warm {dtype} get_range / floor (MiB/s)",
                per_run_ratio(f"{dtype} warm", _HALF_FLOOR),
                ">=",
                0.95,
            ),
            runs_target(
                f"cold {dtype} get_range / floor (MiB/s, spec known)",
                per_run_ratio(f"{dtype} cold", _HALF_FLOOR),
                ">=",
                0.7,
            ),
        ]
    # What a new result array's pages cost here: a fresh array touched right after another
    # was freed, and after the freed memory sat idle for 2 s (a virtual machine whose host
    # takes freed guest memory back faults it in again, from the host, on the next touch).
    fresh: dict[str, list[float]] = {_RIGHT_AFTER: [], _AFTER_IDLE: []}
    for _ in range(max(runs, 3)):
        for name, idle in ((_RIGHT_AFTER, 0.0), (_AFTER_IDLE, _IDLE_SECONDS)):
            np.ones(f32_bytes // 4, dtype=np.float32)  # allocated, touched and freed
            time.sleep(idle)
            t0 = time.perf_counter()
            array = np.empty(f32_bytes // 4, dtype=np.float32)
            array[::1024] = 0  # one write per 4 KiB page
            fresh[name].append(time.perf_counter() - t0)
            del array
    section.tables.append(
        Table(
            f"a new {f32_bytes // MIB} MiB array, each page touched once",
            ["when", "median ms", "min ms", "max ms"],
            [
                [name, *(f"{f(v) * 1e3:.0f}" for f in (median, min, max))]
                for name, v in fresh.items()
            ],
        )
    )
    section.data = {
        "fresh_array_seconds": fresh,
        "runs": runs,
        "seconds": samples,
        "bytes": nbytes,
        "mib_per_s": speeds,
        "server_cpu_s": server_cpu,
        "client_cpu_s": client_cpu,
    }
    return section
