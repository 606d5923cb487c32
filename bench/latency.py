"""c. Decode-step latency: get_positions of 1 and 64 positions against trivial unary calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

import posenc
from bench import decode
from bench.common import Section, Sizes, Table, cpu_seconds, median, percentile, ratio, runs_target
from bench.floor import FloorClient
from bench.harness import Servers, timed
from posenc._rows import LEAD_STEPS

D_MODEL = 4096
BATCH = 64
# Prompt lengths far from any range the run fetches, so no step is a cache hit: every step
# is computed, as in a decode loop past the cached prompt.
FIRST_LENGTH = 1_000_003
LENGTH_STRIDE = 9_973
# The model's forward pass between two decode steps (a 4096-wide model takes far longer).
MODEL_SECONDS = 0.005


def _settle(client: posenc.Client) -> None:
    """Until the client's background read-ahead has landed (untimed): no transfer of it
    may overlap another measured call."""
    while client._core.rows.in_flight:
        time.sleep(0.0005)


def _method(sizes: Sizes) -> str:
    """Section c's method, as latest.md prints it above its tables."""
    one_bytes = D_MODEL * 4
    batch_bytes = BATCH * D_MODEL * 4
    runs = sizes.latency_runs
    per_run = max(1, sizes.latency_rounds // runs)
    measured = runs * per_run
    return (
        f"A decode loop at d_model {D_MODEL}, float32: step t calls "
        f"`get_positions([L + t], {D_MODEL})` for one sequence, and "
        f"`get_positions([L_i + t for i in range({BATCH})], {D_MODEL})` for {BATCH} "
        f"sequences of distinct lengths L_i = {FIRST_LENGTH} + {LENGTH_STRIDE} i (L = "
        f"L_{BATCH}; no position is cached by the server before the loop reaches it). "
        "Three clients, each on positions of its own. The SDK's default client reads "
        "ahead: in the call, up to 64 rows per sequence moving forward and 1 MiB per call; "
        "after the call, in the background, the next window of each sequence whose rows "
        f"run short, {LEAD_STEPS} steps ahead at least (for the 1 MiB steps of {BATCH} "
        "sequences, a step a call). In a "
        f"decode loop the model runs between steps: {MODEL_SECONDS * 1e3:.0f} ms here, "
        "then (untimed) until the client's background fetch has landed, so that it "
        "overlaps no other measured call. The same default client back to back, with "
        "nothing between steps, is measured in a phase of its own; so are two decode loops "
        "as a model runs them (model not waiting): each step, an empty unary call, the "
        f"step, then {MODEL_SECONDS * 1e3:.0f} ms of model time without waiting for the "
        "background fetches, which overlap the model (and a late one the next step); each "
        "step against the empty calls made beside it. `row_cache_bytes=0`: "
        "every step is a call of its own. Against unary calls to the trivial server: "
        f"empty (b'' -> b''), and pre-built payloads of the results' sizes ({one_bytes // 1024}"
        f" KiB, {batch_bytes // 1024} KiB) copied into a numpy array. One call of each kind "
        f"per round, in a random order each round; {sizes.latency_warmup} warm-up rounds, then "
        f"{measured} measured rounds. In each phase the measured rounds form {runs} "
        f"consecutive runs of {per_run} rounds each: the table gives figures over all "
        "measured rounds, the targets the median run (min - max of the runs), each run's "
        "ratio one of its own p50s or p99s. Client in the harness process. CPU per "
        "call: user + system CPU of the server's processes and of the harness process "
        f"(all its threads) over {sizes.latency_cpu_calls} further calls of each kind, run "
        "one kind after the other. Then, against memory (bench/decode.py): cached "
        "steps (the rows in the row cache before each step, waited for untimed) of 1 and "
        "64 sequences at d_model 128 and 4096, blocking and asyncio clients, back to back "
        f"and after {MODEL_SECONDS * 1e3:.0f} ms of model time, each beside a numpy "
        "gather of as many rows of a float32 table in memory (after the same pause): "
        "step / gather per run (its p50s); and 64 sequences x 4096 advancing back to "
        "back with nothing waited for, against the gather plus the step's bytes at the "
        "floor's stream bandwidth measured in the same run."
    )


def run(sizes: Sizes, servers: Servers) -> Section:
    one_bytes = D_MODEL * 4
    batch_bytes = BATCH * D_MODEL * 4
    runs = sizes.latency_runs
    per_run = max(1, sizes.latency_rounds // runs)
    measured = runs * per_run
    section = Section(
        "c",
        "Decode-step latency",
        method=_method(sizes),
    )
    kinds = [
        "posenc 1 position",
        f"posenc {BATCH} positions",
        "posenc 1 position, row cache off",
        f"posenc {BATCH} positions, row cache off",
        "empty unary",
        "unary 16 KiB",
        "unary 1 MiB",
    ]
    back_to_back = [
        "posenc 1 position, back to back",
        f"posenc {BATCH} positions, back to back",
    ]
    free_running = [
        "posenc 1 position, model not waiting",
        f"posenc {BATCH} positions, model not waiting",
    ]
    beside = [f"empty unary, beside {kind}" for kind in free_running]
    samples: dict[str, list[float]] = {
        kind: [] for kind in kinds + back_to_back + free_running + beside
    }
    server_cpu: dict[str, float] = {}
    client_cpu: dict[str, float] = {}
    lengths = FIRST_LENGTH + LENGTH_STRIDE * np.arange(BATCH + 1, dtype=np.int64)
    one, batch = lengths[BATCH:], lengths[:BATCH]
    # Each client walks positions of its own: the server computes its blocks too.
    direct_offset, back_to_back_offset = 7_000_000, 14_000_000
    with (
        posenc.Client(servers.posenc_target, timeout=30.0) as client,
        posenc.Client(servers.posenc_target, timeout=30.0) as hurried,
        posenc.Client(servers.posenc_target, timeout=30.0, row_cache_bytes=0) as direct,
    ):
        floor = FloorClient(servers.floor_target)
        try:
            floor.wait_ready()
            step = [0]
            calls: dict[str, Callable[[], object]] = {
                kinds[0]: lambda: client.get_positions(one + step[0], D_MODEL),
                kinds[1]: lambda: client.get_positions(batch + step[0], D_MODEL),
                kinds[2]: lambda: direct.get_positions(one + direct_offset + step[0], D_MODEL),
                kinds[3]: lambda: direct.get_positions(batch + direct_offset + step[0], D_MODEL),
                kinds[4]: floor.empty,
                kinds[5]: lambda: floor.unary(one_bytes),
                kinds[6]: lambda: floor.unary(batch_bytes),
            }
            model_runs_after = set(kinds[:2])

            def model() -> None:
                time.sleep(MODEL_SECONDS)
                _settle(client)

            # A fresh random order each round: no kind always follows the same other kind
            # (a call right after a heavy one finds the CPUs and caches busier).
            rng = np.random.default_rng(3)
            total = sizes.latency_warmup + measured
            for round_index in range(total):
                step[0] = round_index
                for kind in rng.permutation(kinds).tolist():
                    elapsed = timed(calls[kind])
                    if kind in model_runs_after:
                        model()
                    if round_index >= sizes.latency_warmup:
                        samples[kind].append(elapsed)
            # The default client with nothing between steps: background fetches overlap the
            # steps, so this phase measures nothing else.
            hurried_calls: dict[str, Callable[[], object]] = {
                back_to_back[0]: lambda: hurried.get_positions(
                    one + (back_to_back_offset + step[0]), D_MODEL
                ),
                back_to_back[1]: lambda: hurried.get_positions(
                    batch + (back_to_back_offset + step[0]), D_MODEL
                ),
            }
            for round_index in range(total):
                step[0] = round_index
                for kind in back_to_back:
                    elapsed = timed(hurried_calls[kind])
                    if round_index >= sizes.latency_warmup:
                        samples[kind].append(elapsed)
            # Decode loops as a model runs them: nothing waits for the background fetches,
            # which overlap the model's time (and, when late, the next step). Each step is
            # measured beside an empty unary call made just before it.
            loop_offset = 21_000_000
            with (
                posenc.Client(servers.posenc_target, timeout=30.0) as loop_one,
                posenc.Client(servers.posenc_target, timeout=30.0) as loop_batch,
            ):
                for round_index in range(total):
                    position = loop_offset + round_index
                    for kind, loop_client, positions in (
                        (free_running[0], loop_one, one),
                        (free_running[1], loop_batch, batch),
                    ):
                        t0 = time.perf_counter()
                        floor.empty()
                        t1 = time.perf_counter()
                        loop_client.get_positions(positions + position, D_MODEL)
                        t2 = time.perf_counter()
                        time.sleep(MODEL_SECONDS)
                        if round_index >= sizes.latency_warmup:
                            samples[kind].append(t2 - t1)
                            samples[f"empty unary, beside {kind}"].append(t1 - t0)
            # Where the time goes: CPU per call, server and client, in a separate
            # sequential pass (reading /proc between timed calls would disturb them).
            for kind in kinds:
                pids = servers.posenc_pids if kind.startswith("posenc") else servers.floor_pids
                server_before, client_before = cpu_seconds(pids()), time.process_time()
                for _ in range(sizes.latency_cpu_calls):
                    step[0] += 1
                    calls[kind]()
                    if kind in model_runs_after:
                        model()
                server_cpu[kind] = (cpu_seconds(pids()) - server_before) / sizes.latency_cpu_calls
                client_cpu[kind] = (time.process_time() - client_before) / sizes.latency_cpu_calls
        finally:
            floor.close()

    p50 = {kind: median(v) for kind, v in samples.items()}
    p99 = {kind: percentile(v, 99) for kind, v in samples.items()}
    mean = {kind: sum(v) / len(v) for kind, v in samples.items()}
    empty, mean_empty = p50["empty unary"], mean["empty unary"]
    same_size = {
        kind: p50["unary 1 MiB" if str(BATCH) in kind else "unary 16 KiB"]
        for kind in [*kinds[:4], *back_to_back, *free_running]
    }
    rows: list[list[Any]] = []
    for kind in [*kinds[:2], *back_to_back, *free_running, *beside, *kinds[2:]]:
        rows.append(
            [
                kind,
                f"{p50[kind] * 1e6:.0f}",
                f"{p99[kind] * 1e6:.0f}",
                f"{mean[kind] * 1e6:.0f}",
                f"{ratio(p50[kind], empty):.2f}",
                f"{ratio(mean[kind], mean_empty):.2f}",
                f"{ratio(p50[kind], same_size[kind]):.2f}" if kind in same_size else "",
                f"{server_cpu[kind] * 1e6:.0f}" if kind in server_cpu else "",
                f"{client_cpu[kind] * 1e6:.0f}" if kind in client_cpu else "",
            ]
        )
    section.tables.append(
        Table(
            f"d_model {D_MODEL}, float32, {measured} calls each",
            [
                "call",
                "p50 us",
                "p99 us",
                "mean us",
                "p50 x empty",
                "mean x empty",
                "p50 x same-size unary",
                "server CPU us/call",
                "client CPU us/call",
            ],
            rows,
        )
    )

    # The samples of each kind in round order: run i is the same slice of every kind's.
    parts = [slice(index * per_run, (index + 1) * per_run) for index in range(runs)]

    def stat(values: list[float], q: int) -> float:
        return median(values) if q == 50 else percentile(values, q)

    def per_run_ratio(kind: str, reference: str, q: int = 50, reference_q: int = 50) -> list[float]:
        """Each run's p``q`` of ``kind`` over its p``reference_q`` of ``reference``."""
        return [
            ratio(stat(samples[kind][part], q), stat(samples[reference][part], reference_q))
            for part in parts
        ]

    call_1, call_batch = "get_positions(1)", f"get_positions({BATCH})"
    empty_unary, beside_it = "empty unary", "empty unary beside it"
    loop = f"decode loop, {MODEL_SECONDS * 1e3:.0f} ms model"
    waiting = "model not waiting"
    # The targets: each run's ratio against its bound.
    bounded: list[tuple[str, list[float], str, float]] = [
        (
            f"p50 {call_1} / p50 {empty_unary} ({loop})",
            per_run_ratio(kinds[0], empty_unary),
            "<=",
            1.3,
        ),
        (
            f"p50 {call_batch} / p50 {empty_unary} ({loop})",
            per_run_ratio(kinds[1], empty_unary),
            "<=",
            1.6,
        ),
        (
            f"p50 {call_batch} / p50 {beside_it} (decode loop, {waiting} for read-ahead)",
            per_run_ratio(free_running[1], beside[1]),
            "<=",
            1.0,
        ),
        (
            f"p99 {call_batch} / p99 {beside_it} ({waiting})",
            per_run_ratio(free_running[1], beside[1], 99, 99),
            "<=",
            2.0,
        ),
        (
            f"p99 {call_1} / p99 {beside_it} ({waiting})",
            per_run_ratio(free_running[0], beside[0], 99, 99),
            "<=",
            1.0,
        ),
        (
            f"p50 {call_1} / p50 {beside_it} ({waiting})",
            per_run_ratio(free_running[0], beside[0]),
            "<=",
            0.5,
        ),
    ]
    # The figures reported beside them, bound to nothing.
    reported: dict[str, list[float]] = {
        f"p99 {call_batch} / p50 {beside_it} ({waiting})": per_run_ratio(
            free_running[1], beside[1], 99, 50
        ),
        f"p99 {call_1} / p50 {beside_it} ({waiting})": per_run_ratio(
            free_running[0], beside[0], 99, 50
        ),
        f"p99 {call_1} / p99 {empty_unary}": per_run_ratio(kinds[0], empty_unary, 99, 99),
        f"p99 {call_batch} / p99 {empty_unary}": per_run_ratio(kinds[1], empty_unary, 99, 99),
        f"p50 {call_1}, back to back / p50 {empty_unary}": per_run_ratio(
            back_to_back[0], empty_unary
        ),
        f"p50 {call_batch}, back to back / p50 {empty_unary}": per_run_ratio(
            back_to_back[1], empty_unary
        ),
        f"p50 {call_1}, row cache off / p50 {empty_unary}": per_run_ratio(kinds[2], empty_unary),
        f"p50 {call_batch}, row cache off / p50 {empty_unary}": per_run_ratio(
            kinds[3], empty_unary
        ),
        f"p50 unary 1 MiB (the bytes of one 64-position step, no work) / p50 {empty_unary}": (
            per_run_ratio("unary 1 MiB", empty_unary)
        ),
    }
    measured_targets = bounded + [(name, values, "", 0.0) for name, values in reported.items()]
    section.targets += [
        runs_target(name, values, op, threshold) for name, values, op, threshold in measured_targets
    ]
    section.data = {
        "calls": {kind: len(v) for kind, v in samples.items()},
        "runs": {name: values for name, values, _, _ in measured_targets},
        "rounds_per_run": per_run,
        "p50_s": p50,
        "p90_s": {kind: percentile(v, 90) for kind, v in samples.items()},
        "p99_s": p99,
        "mean_s": mean,
        "min_s": {kind: min(v) for kind, v in samples.items()},
        "server_cpu_s_per_call": server_cpu,
        "client_cpu_s_per_call": client_cpu,
        "d_model": D_MODEL,
        "batch": BATCH,
        "model_seconds": MODEL_SECONDS,
    }
    # Cached steps against a numpy gather, and 64 sequences back to back against the gather
    # plus the wire (bench/decode.py): after the phases above, on positions of their own.
    decode.add_to(section, sizes, servers.posenc_target, servers.floor_target)
    return section
