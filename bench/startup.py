"""s. Start-up: what a server process does before it reports SERVING, and the first call of
every dtype on a freshly started server against the floor."""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

import numpy as np

import posenc
from bench import procs
from bench.common import MIB, Section, Sizes, Table, median, ratio, rotated, runs_target
from bench.floor import FloorClient
from bench.harness import Servers, child_env, run_python, timed

TIMEOUT = 600.0
DTYPES = ("float32", "bfloat16", "float16", "float64")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# What a server process runs before it listens (posenc_server.warmup, then the default cache
# budget faulted in: posenc_server.heap), timed in a fresh interpreter: its imports
# included, as a server process pays them.
_WARM_UP = (
    "import time; t = time.perf_counter(); from posenc_server import heap, warmup; "
    "heap.one_heap(); warmup.warm_up(); heap.prefault(512 << 20); "
    "print(time.perf_counter() - t)"
)


def _warm_up_seconds(cache_dir: str | None) -> float:
    """Seconds of the warm-up in a new process: with numba's cache as the harness finds it,
    or (``cache_dir``: an empty directory) compiling every kernel, as a new container's
    first process does."""
    env = child_env({"NUMBA_CACHE_DIR": cache_dir} if cache_dir is not None else None)
    out = run_python(["-c", _WARM_UP], TIMEOUT, env)
    return float(out.stdout.strip().splitlines()[-1])


def run(sizes: Sizes, servers: Servers) -> Section:
    rows, d_model = sizes.e2e_rows, sizes.e2e_d_model
    runs = 3
    section = Section(
        "s",
        "Start-up and the first call",
        method=(
            "For each dtype, in each of "
            f"{runs} runs: a fresh posenc server (`{' '.join(servers.flags) or 'defaults'}`) is "
            "started and timed until it logs `listening` and until it answers "
            "GetServerInfo (SERVING); then a new client connects (GetServerInfo) and makes "
            f"the first table call the server ever serves, `get_range` of {rows} x {d_model} "
            "in that dtype from position 10^6 (so a spec it has never seen); right after "
            "it, a new floor client connects (its empty call) and streams the same bytes. "
            "Both copy the bytes into an already-touched array (`out=` for posenc): what "
            "is measured is the server's first call, not the client's fresh memory. Both "
            "are first streams of a new connection, whose flow-control window has yet to "
            "grow. The harness's own client ran every dtype before (its own imports are "
            "not the server's). Its ratio: floor time / first call time. The warm-up "
            "(what a server process runs before it listens: "
            "`posenc_server.warmup.warm_up`, numba's kernels for every array type and a "
            "table of every kind and layout in every dtype; then "
            "`posenc_server.heap.prefault`, the default 512 MiB cache budget faulted in) "
            "is also timed alone in a new interpreter, its "
            "imports included: with numba's on-disk cache in place (median of 3), and"
            + (
                " once with an empty cache directory (every kernel compiled: a new "
                "container's first process)."
                if not sizes.quick
                else " (full mode only) with an empty cache directory."
            )
            + " Then a fresh client process (bench/fresh_client.py, bytecode compiled as an "
            "installed package's) imports posenc, makes a client and connects it (untimed), "
            f"and times its first call, `get_range` of {rows} x {d_model} in bfloat16 or "
            "float32 from the harness's warm server, into an array touched before; a fresh "
            "floor client process streams the same bytes; and `import posenc` is timed "
            "against `import grpc, numpy` in pairs of fresh processes."
        ),
    )
    nbytes = {dtype: rows * d_model * _ITEMSIZE[dtype] for dtype in DTYPES}
    listening: list[float] = []
    serving: list[float] = []
    first: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    floor_times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    with posenc.Client(servers.posenc_target, timeout=TIMEOUT) as client:
        # The harness's lazy imports (ml_dtypes), paid here; and the arrays the first calls
        # fill, touched (as the floor's).
        touched = {
            dtype: np.ones_like(client.get_range(0, rows, d_model, dtype=dtype)) for dtype in DTYPES
        }
    # Each floor process builds a size's payload when first asked for it: every size is
    # asked for first on a few connections, which reach both processes.
    for _ in range(4):
        warming = FloorClient(servers.floor_target)
        try:
            warming.wait_ready()
            for size in sorted(set(nbytes.values())):
                warming.get(size, TIMEOUT)
        finally:
            warming.close()
    for index in range(runs):
        for dtype in DTYPES[index % len(DTYPES) :] + DTYPES[: index % len(DTYPES)]:
            started = time.perf_counter()
            server = procs.start_posenc(servers.flags).wait_ready()
            listening.append(time.perf_counter() - started)
            try:
                procs.wait_serving(server.target)
                serving.append(time.perf_counter() - started)
                with posenc.Client(server.target, timeout=TIMEOUT) as fresh:
                    fresh.server_info()  # connected, as the floor's client below
                    call = functools.partial(
                        fresh.get_range,
                        10**6,
                        10**6 + rows,
                        d_model,
                        dtype=dtype,
                        out=touched[dtype],
                    )
                    first[dtype].append(timed(call))
            finally:
                server.stop()
            new_floor = FloorClient(servers.floor_target)
            try:
                new_floor.wait_ready()
                new_floor.touch(nbytes[dtype])
                stream = functools.partial(new_floor.get, nbytes[dtype], TIMEOUT)
                floor_times[dtype].append(timed(stream))
            finally:
                new_floor.close()
    warm = [_warm_up_seconds(None) for _ in range(3)]
    compiled: float | None = None
    if not sizes.quick:
        with tempfile.TemporaryDirectory(prefix="posenc-bench-numba-") as empty:
            compiled = _warm_up_seconds(empty)

    section.tables.append(
        Table(
            f"first call of a fresh server, get_range {rows} x {d_model} ({runs} runs)",
            ["dtype", "MiB", "first call median ms", "floor median ms", "x floor (median run)"],
            [
                [dtype, f"{nbytes[dtype] // MIB}", *_versus_floor(first[dtype], floor_times[dtype])]
                for dtype in DTYPES
            ],
        )
    )
    section.tables.append(
        Table(
            "start-up of a server process",
            ["what", "median s", "min s", "max s"],
            [
                [name, *(f"{f(values):.2f}" for f in (median, min, max))]
                for name, values in (
                    ("started to listening (fresh server)", listening),
                    ("started to SERVING (fresh server)", serving),
                    ("warm-up alone (512 MiB of cache faulted in), numba's cache in place", warm),
                    *(
                        (("the same, empty numba cache (compiling)", [compiled]),)
                        if compiled is not None
                        else ()
                    ),
                )
            ],
        )
    )
    _first_call_targets(section, "server", first, floor_times)
    new_clients = _fresh_clients(
        section, servers.posenc_target, servers.floor_target, rows, d_model, runs
    )
    section.targets.append(runs_target("warm-up before SERVING (s)", warm, "", 0.0, " s"))
    if compiled is not None:
        section.targets.append(
            runs_target("warm-up with an empty numba cache (s)", [compiled], "", 0.0, " s")
        )
    section.data = {
        "runs": runs,
        "bytes": nbytes,
        "first_call_s": first,
        "floor_s": floor_times,
        "listening_s": listening,
        "serving_s": serving,
        "warm_up_s": warm,
        "warm_up_empty_cache_s": compiled,
        "fresh_client": new_clients,
    }
    return section


# The fresh client processes' dtypes: bfloat16 loads ml_dtypes, float32 needs nothing more.
_CLIENT_DTYPES = ("bfloat16", "float32")
_IMPORT_RUNS = 10


def _fresh(mode: str, *arguments: str) -> list[float]:
    """The figures a fresh client process (bench/fresh_client.py) prints. Its bytecode is
    compiled (in a cache directory of its own), as an installed package's is."""
    env = child_env(
        {"PYTHONPYCACHEPREFIX": str(Path(tempfile.gettempdir()) / "posenc-bench-pycache")},
        drop=["PYTHONDONTWRITEBYTECODE"],
    )
    out = run_python(["-m", "bench.fresh_client", mode, *arguments], TIMEOUT, env)
    return [float(value) for value in out.stdout.split()]


def _fresh_clients(
    section: Section, posenc_target: str, floor_target: str, rows: int, d_model: int, runs: int
) -> dict[str, object]:
    """A fresh client process's first call (its imports and client made before, untimed)
    against a fresh floor client's stream of the same bytes, on the warm harness servers;
    and ``import posenc`` against ``import grpc, numpy``, each in fresh processes."""
    _fresh("import")  # the bytecode cache filled
    first: dict[str, list[float]] = {dtype: [] for dtype in _CLIENT_DTYPES}
    floor_times: dict[str, list[float]] = {dtype: [] for dtype in _CLIENT_DTYPES}
    setup: dict[str, list[float]] = {dtype: [] for dtype in _CLIENT_DTYPES}
    for index in range(runs):
        for dtype in rotated(_CLIENT_DTYPES, index):
            # The range the harness's client fetched (so the server's cache holds it): what
            # is measured is the client process's first call, not the server's.
            size = [dtype, str(rows), str(d_model), "0"]
            _, made, call = _fresh("call", posenc_target, *size)
            first[dtype].append(call)
            setup[dtype].append(made)
            floor_times[dtype].append(_fresh("floor", floor_target, *size)[2])
    imports: list[float] = []
    import_ratios: list[float] = []
    for _ in range(_IMPORT_RUNS):
        posenc_import, floor_import = _fresh("import")[0], _fresh("import-floor")[0]
        imports.append(posenc_import)
        import_ratios.append(ratio(posenc_import, floor_import))
    section.tables.append(
        Table(
            f"a fresh client process's first call, get_range {rows} x {d_model} from a warm "
            f"server ({runs} runs); import times in {_IMPORT_RUNS} pairs of fresh processes",
            ["dtype", "client made ms", "first call ms", "floor ms", "x floor (median run)"],
            [
                [
                    dtype,
                    f"{median(setup[dtype]) * 1e3:.0f}",
                    *_versus_floor(first[dtype], floor_times[dtype]),
                ]
                for dtype in _CLIENT_DTYPES
            ]
            + [["import posenc", "", f"{median(imports) * 1e3:.0f}", "", ""]],
        )
    )
    _first_call_targets(section, "client process", first, floor_times)
    section.targets.append(
        runs_target(
            "import posenc / import grpc, numpy (fresh processes)", import_ratios, "<=", 1.5
        )
    )
    return {
        "first_call_s": first,
        "floor_s": floor_times,
        "client_made_s": setup,
        "import_s": imports,
        "import_ratios": import_ratios,
    }


def _ratios(floor_times: list[float], call_times: list[float]) -> list[float]:
    """Each run's floor time over its call's time: the call's speed as a share of the floor's."""
    return [ratio(f, c) for f, c in zip(floor_times, call_times, strict=True)]


def _versus_floor(first: list[float], floor_times: list[float]) -> list[str]:
    """A table row's first-call and floor medians (ms) and the median run's ratio."""
    return [
        f"{median(first) * 1e3:.0f}",
        f"{median(floor_times) * 1e3:.0f}",
        f"{median(_ratios(floor_times, first)):.2f}",
    ]


def _first_call_targets(
    section: Section, fresh: str, first: dict[str, list[float]], floor_times: dict[str, list[float]]
) -> None:
    """Each dtype's target: the first call of a fresh ``fresh`` streams at least half as fast
    as a fresh floor client streams the same bytes."""
    for dtype, times in first.items():
        section.targets.append(
            runs_target(
                f"first {dtype} call of a fresh {fresh} / floor (MiB/s)",
                _ratios(floor_times[dtype], times),
                ">=",
                0.5,
            )
        )
