"""h. Same host: ranges through a unix socket and the server's shared memory, against the
TCP floor, and several processes holding one table."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import posenc
from bench import procs
from bench.common import MIB, Section, Sizes, Table, median, ratio, runs_target
from bench.floor import FloorClient
from bench.harness import Servers, child_env

TIMEOUT = 600.0
# The processes holding one table, and the table: 1 GiB of float32 rows of d_model 4096.
HOLDERS = 8
HELD_ROWS, HELD_D_MODEL = 65536, 4096
# A holder: connect (its interpreter, imports and channel are not the table's memory), say
# so, wait for a line; then take the table as a view of the server's memory, read a value of
# every row (every page mapped), say so, and hold it until its stdin closes.
_HOLDER = """
import sys
import posenc
with posenc.Client({target}) as client:
    client.server_info()
    print("ready", flush=True)
    sys.stdin.readline()
    rows = client.get_range({start}, {start} + {rows}, {d_model}, copy=False)
    total = float(rows[:, 0].sum())
    print("holding", rows.nbytes, flush=True)
    sys.stdin.read()
"""


def _pss(pids: list[int]) -> int:
    """The proportional set size of ``pids`` in all, in bytes: each page shared by several
    of them counted once in all (a share in each)."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
    return total


def run(sizes: Sizes, servers: Servers) -> Section:
    rows, d_model = sizes.e2e_rows, sizes.e2e_d_model
    nbytes = rows * d_model * 4
    runs, repeats = sizes.e2e_runs, max(sizes.e2e_repeats // sizes.e2e_runs, 2)
    held = HELD_ROWS * HELD_D_MODEL * 4 if not sizes.quick else 256 * MIB
    held_rows = held // (HELD_D_MODEL * 4)
    section = Section(
        "h",
        "Same host: the unix socket and shared memory",
        method=(
            f"A posenc server of one process with `--unix-socket` and `--shm-bytes "
            f"{2 * held // MIB}MiB`; a client of target `unix:PATH`. Warm: `get_range` of "
            f"{rows} x {d_model} float32 ({nbytes // MIB} MiB), asked before (the range is "
            "in the server's shared memory), copied into the result (the default) and as a "
            "read-only view (`copy=False`: the rows mapped, not read), against the TCP "
            "floor (the same bytes pre-built and streamed by a minimal gRPC server, copied "
            f"into an already-touched array), interleaved: {runs} runs of {repeats} calls "
            "each, each run's ratio from its medians. Then "
            f"{HOLDERS} client processes each take a {held // MIB} MiB table (`copy=False`) "
            "and read a value of every row, a table the server had not computed: the memory "
            "they use in all, the server's copy of the table included, is the growth of the "
            "proportional set size (PSS: a page shared by several processes counted once in "
            "all) of the holders and the server, from before their calls (the processes "
            "connected, the server idle) to while all of them hold the table."
        ),
    )
    with tempfile.TemporaryDirectory(prefix="posenc-bench-unix-") as directory:
        path = os.path.join(directory, "posenc.sock")
        server = procs.start_posenc(
            ["--processes", "1", "--unix-socket", path, "--shm-bytes", str(2 * held)]
        ).wait_ready()
        try:
            procs.wait_serving(server.target)
            target = f"unix:{path}"
            copied_ratios, view_ratios = [], []
            copied_times: list[float] = []
            view_times: list[float] = []
            floor_times: list[float] = []
            floor = FloorClient(servers.floor_target)
            try:
                floor.wait_ready()
                floor.get(nbytes, TIMEOUT)
                with posenc.Client(target, timeout=TIMEOUT) as client:
                    client.get_range(0, rows, d_model)  # placed in shared memory, once
                    client.get_range(0, rows, d_model)
                    for _ in range(runs):
                        copies, views, floors = [], [], []
                        for _ in range(repeats):
                            t0 = time.perf_counter()
                            floor.get(nbytes, TIMEOUT)
                            t1 = time.perf_counter()
                            result = client.get_range(0, rows, d_model)
                            t2 = time.perf_counter()
                            view = client.get_range(0, rows, d_model, copy=False)
                            t3 = time.perf_counter()
                            del result, view
                            floors.append(t1 - t0)
                            copies.append(t2 - t1)
                            views.append(t3 - t2)
                        copied_ratios.append(ratio(median(floors), median(copies)))
                        view_ratios.append(ratio(median(floors), median(views)))
                        copied_times += copies
                        view_times += views
                        floor_times += floors
            finally:
                floor.close()
            used = _holders(target, held_rows, server.pids())
        finally:
            server.stop()
    section.tables.append(
        Table(
            f"warm get_range of {nbytes // MIB} MiB on the same host ({runs} runs)",
            ["path", "median ms", "MiB/s", "x TCP floor + copy (median run)"],
            [
                [
                    name,
                    f"{median(times) * 1e3:.1f}",
                    f"{nbytes / MIB / median(times):.0f}",
                    "" if ratios is None else f"{median(ratios):.2f}",
                ]
                for name, times, ratios in (
                    ("TCP floor + copy", floor_times, None),
                    ("unix socket, copied out of shared memory", copied_times, copied_ratios),
                    ("unix socket, copy=False (a view)", view_times, view_ratios),
                )
            ],
        )
    )
    section.tables.append(
        Table(
            f"{HOLDERS} processes holding one {held // MIB} MiB table",
            ["measure", "MiB"],
            [
                ["one table", f"{held / MIB:.0f}"],
                ["the holders' and the server's memory growth in all (PSS)", f"{used / MIB:.0f}"],
                ["a copy each (what copies would take)", f"{HOLDERS * held / MIB:.0f}"],
            ],
        )
    )
    section.targets += [
        runs_target(
            f"warm {nbytes // MIB} MiB get_range over the unix socket / TCP floor + copy",
            copied_ratios,
            ">=",
            3.0,
        ),
        runs_target(
            "the same, copy=False / TCP floor + copy",
            view_ratios,
            "",
            0.0,
        ),
        runs_target(
            f"{HOLDERS} processes holding one {held // MIB} MiB table: memory in all (MiB)",
            [used / MIB],
            "<=",
            1.25 * held / MIB,
            " MiB",
        ),
    ]
    section.data = {
        "bytes": nbytes,
        "copied_s": copied_times,
        "view_s": view_times,
        "floor_s": floor_times,
        "holders": HOLDERS,
        "held_bytes": held,
        "used_bytes": used,
    }
    return section


def _holders(target: str, held_rows: int, server: list[int]) -> int:
    """Start ``HOLDERS`` connected processes, then have each take the table; the growth of
    their memory and the server's (PSS), from before their calls to while they all hold
    it."""
    # A table the server has not computed before: its memory is part of what is measured.
    code = _HOLDER.format(start=10**7, rows=held_rows, d_model=HELD_D_MODEL, target=repr(target))
    holders: list[subprocess.Popen[str]] = []
    try:
        for _ in range(HOLDERS):
            holders.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=child_env(),
                )
            )
        _read_all(holders, "ready")
        pids = [*server, *(holder.pid for holder in holders)]
        before = _pss(pids)
        for holder in holders:
            assert holder.stdin is not None
            holder.stdin.write("\n")
            holder.stdin.flush()
        _read_all(holders, "holding")
        return _pss(pids) - before
    finally:
        for holder in holders:
            holder.kill()
            holder.wait(30)


def _read_all(holders: list[subprocess.Popen[str]], word: str) -> None:
    for holder in holders:
        assert holder.stdout is not None
        answer = holder.stdout.readline()
        if not answer.startswith(word):
            raise RuntimeError(f"a holder did not say {word!r}: {answer!r}")
