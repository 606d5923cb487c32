"""c. Decode-step latency: get_positions of 1 and 64 positions against trivial unary calls."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

import posenc
from bench.common import Section, Sizes, Table, Target, cpu_seconds, median, percentile, ratio
from bench.floor import FloorClient

D_MODEL = 4096
BATCH = 64
# Prompt lengths far from any range the run fetches, so no step is a cache hit: every step
# is computed, as in a decode loop past the cached prompt.
FIRST_LENGTH = 1_000_003
LENGTH_STRIDE = 9_973


def run(
    sizes: Sizes,
    posenc_target: str,
    floor_target: str,
    posenc_pids: Callable[[], list[int]],
    floor_pids: Callable[[], list[int]],
) -> Section:
    one_bytes = D_MODEL * 4
    batch_bytes = BATCH * D_MODEL * 4
    section = Section(
        "c",
        "Decode-step latency",
        method=(
            f"A decode loop at d_model {D_MODEL}, float32: step t calls "
            f"`get_positions([L + t], {D_MODEL})` for one sequence, and "
            f"`get_positions([L_i + t for i in range({BATCH})], {D_MODEL})` for {BATCH} "
            f"sequences of distinct lengths L_i = {FIRST_LENGTH} + {LENGTH_STRIDE} i (L = "
            f"L_{BATCH}; never cached by the server before the loop reaches them). Two "
            "clients: the SDK's default, whose row cache reads ahead for sequences moving "
            "forward (up to 64 rows and 1 MiB per call, so the 1-sequence loop makes one call "
            f"every 64 steps while a {BATCH}-sequence step, already 1 MiB, goes to the server "
            "every time), and one with `row_cache_bytes=0`, where every step is a call; each "
            "on its own positions. Against unary calls to the trivial server: empty "
            f"(b'' -> b''), and pre-built payloads of the results' sizes ({one_bytes // 1024}"
            f" KiB, {batch_bytes // 1024} KiB) copied into a numpy array. One call of each kind "
            f"per round, in a random order each round; {sizes.latency_warmup} warm-up rounds, then "
            f"{sizes.latency_rounds} measured rounds. Client in the harness process. CPU per "
            "call: user + system CPU of the server's processes and of the harness process "
            f"over {sizes.latency_cpu_calls} further calls of each kind, run one kind after "
            "the other."
        ),
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
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    server_cpu: dict[str, float] = {}
    client_cpu: dict[str, float] = {}
    lengths = FIRST_LENGTH + LENGTH_STRIDE * np.arange(BATCH + 1, dtype=np.int64)
    one, batch = lengths[BATCH:], lengths[:BATCH]
    # The clients without a row cache walk their own positions: the server computes their
    # blocks too, as it does the default client's.
    elsewhere = 7_000_000
    with (
        posenc.Client(posenc_target, timeout=30.0) as client,
        posenc.Client(posenc_target, timeout=30.0, row_cache_bytes=0) as direct,
    ):
        floor = FloorClient(floor_target)
        try:
            floor.wait_ready()
            step = [0]
            calls: dict[str, Callable[[], object]] = {
                kinds[0]: lambda: client.get_positions(one + step[0], D_MODEL),
                kinds[1]: lambda: client.get_positions(batch + step[0], D_MODEL),
                kinds[2]: lambda: direct.get_positions(one + elsewhere + step[0], D_MODEL),
                kinds[3]: lambda: direct.get_positions(batch + elsewhere + step[0], D_MODEL),
                kinds[4]: floor.empty,
                kinds[5]: lambda: floor.unary(one_bytes),
                kinds[6]: lambda: floor.unary(batch_bytes),
            }
            # A fresh random order each round: no kind always follows the same other kind
            # (a call right after a heavy one finds the CPUs and caches busier).
            rng = np.random.default_rng(3)
            total = sizes.latency_warmup + sizes.latency_rounds
            for round_index in range(total):
                step[0] = round_index
                for kind in rng.permutation(kinds).tolist():
                    call = calls[kind]
                    t0 = time.perf_counter()
                    call()
                    elapsed = time.perf_counter() - t0
                    if round_index >= sizes.latency_warmup:
                        samples[kind].append(elapsed)
            # Where the time goes: CPU per call, server and client, in a separate
            # sequential pass (reading /proc between timed calls would disturb them).
            for kind in kinds:
                pids = posenc_pids if kind.startswith("posenc") else floor_pids
                server_before, client_before = cpu_seconds(pids()), time.process_time()
                for _ in range(sizes.latency_cpu_calls):
                    step[0] += 1
                    calls[kind]()
                server_cpu[kind] = (cpu_seconds(pids()) - server_before) / sizes.latency_cpu_calls
                client_cpu[kind] = (time.process_time() - client_before) / sizes.latency_cpu_calls
        finally:
            floor.close()

    p50 = {kind: median(v) for kind, v in samples.items()}
    p99 = {kind: percentile(v, 99) for kind, v in samples.items()}
    mean = {kind: sum(v) / len(v) for kind, v in samples.items()}
    empty = p50["empty unary"]
    same_size = {kinds[k]: p50["unary 16 KiB" if k % 2 == 0 else "unary 1 MiB"] for k in range(4)}
    rows: list[list[Any]] = []
    for kind in kinds:
        rows.append(
            [
                kind,
                f"{p50[kind] * 1e6:.0f}",
                f"{p99[kind] * 1e6:.0f}",
                f"{mean[kind] * 1e6:.0f}",
                f"{ratio(p50[kind], empty):.2f}",
                f"{ratio(mean[kind], mean['empty unary']):.2f}",
                f"{ratio(p50[kind], same_size[kind]):.2f}" if kind in same_size else "",
                f"{server_cpu[kind] * 1e6:.0f}",
                f"{client_cpu[kind] * 1e6:.0f}",
            ]
        )
    section.tables.append(
        Table(
            f"d_model {D_MODEL}, float32, {sizes.latency_rounds} calls each",
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
    section.targets += [
        Target("p50 get_positions(1) / p50 empty unary", ratio(p50[kinds[0]], empty), "<=", 1.3),
        Target(
            f"p50 get_positions({BATCH}) / p50 empty unary", ratio(p50[kinds[1]], empty), "<=", 1.6
        ),
        Target(
            "mean get_positions(1) / mean empty unary",
            ratio(mean[kinds[0]], mean["empty unary"]),
            "",
            0.0,
        ),
        Target(
            "p50 get_positions(1), row cache off / p50 empty unary",
            ratio(p50[kinds[2]], empty),
            "",
            0.0,
        ),
        Target(
            f"p50 get_positions({BATCH}), row cache off / p50 empty unary",
            ratio(p50[kinds[3]], empty),
            "",
            0.0,
        ),
        Target(
            "p50 unary 1 MiB (the bytes of one 64-position step, no work) / p50 empty unary",
            ratio(p50["unary 1 MiB"], empty),
            "",
            0.0,
        ),
        Target(
            "p50 get_positions(1), row cache off / p50 16 KiB unary",
            ratio(p50[kinds[2]], same_size[kinds[2]]),
            "",
            0.0,
        ),
        Target(
            f"p50 get_positions({BATCH}) / p50 1 MiB unary",
            ratio(p50[kinds[1]], same_size[kinds[1]]),
            "",
            0.0,
        ),
    ]
    section.data = {
        "calls": {kind: len(v) for kind, v in samples.items()},
        "p50_s": p50,
        "p90_s": {kind: percentile(v, 90) for kind, v in samples.items()},
        "p99_s": p99,
        "mean_s": mean,
        "min_s": {kind: min(v) for kind, v in samples.items()},
        "server_cpu_s_per_call": server_cpu,
        "client_cpu_s_per_call": client_cpu,
        "d_model": D_MODEL,
        "batch": BATCH,
    }
    return section
