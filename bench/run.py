"""Runs the suite: ``python -m bench [--quick]`` or ``python bench/run.py [--quick]``.

Starts a posenc server and the raw floor server (same number of processes) on 127.0.0.1
ephemeral ports, measures sections a-h, p and s, writes ``bench/results/latest.{md,json,png}`` and
stops every process it started, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness, procs
from bench.common import REPO, Section, Sizes, cpu_ticks, load_average, machine, steal_share

SECTIONS = "abcdefghps"


def _guarded(key: str, title: str, body: Callable[[], Section]) -> Section:
    """Runs one section; a failure is reported in the results instead of ending the run."""
    print(f"[bench] {key}. {title} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        section = body()
    except Exception as error:
        traceback.print_exc()
        section = Section(key, title, error=f"{type(error).__name__}: {error}")
    section.seconds = time.monotonic() - t0
    print(f"[bench] {key}. done in {section.seconds:.1f} s", file=sys.stderr, flush=True)
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument(
        "--sections", default=SECTIONS, help=f"which sections to run (default {SECTIONS})"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results", help="output directory"
    )
    parser.add_argument("--name", default="latest", help="output file stem (default latest)")
    args = parser.parse_args(argv)
    wanted = set(args.sections)

    from bench import concurrency, e2e, engine_bench, growth, integrations, latency, memory, report

    procs.install_cleanup()
    sizes = Sizes.for_mode(args.quick)
    started = time.monotonic()
    about = machine()
    ticks_at_start = cpu_ticks()
    flag = procs.processes_flag(procs.posenc_help())
    server_processes = (os.cpu_count() or 1) if flag else 1
    extra = [flag, str(server_processes)] if flag else []
    about["posenc_server_flags"] = " ".join(extra) or "(defaults)"
    about["server_processes"] = server_processes
    sections: list[Section] = []
    try:
        server = procs.start_posenc(extra)
        floor = procs.FloorServer(server_processes)

        servers = harness.Servers(
            server.target,
            floor.target,
            server.pids,
            lambda: [pid for member in floor.members for pid in member.pids()],
            server_processes,
        )
        server.wait_ready()
        procs.wait_serving(server.target)
        if "a" in wanted:  # in-process, once the servers are up and idle
            sections.append(_guarded("a", "Engine, cold", lambda: engine_bench.run(sizes)))
        if "b" in wanted:  # fresh servers of its own for each run, beside the idle ones
            sections.append(
                _guarded(
                    "b",
                    "End to end through the SDK",
                    lambda: e2e.run(sizes, extra, server_processes),
                )
            )
        if "s" in wanted:  # fresh servers of its own, beside the idle ones
            from bench import startup

            sections.append(
                _guarded(
                    "s",
                    "Start-up and the first call",
                    lambda: startup.run(sizes, server.target, floor.target, extra),
                )
            )
        if "c" in wanted:
            sections.append(
                _guarded(
                    "c",
                    "Decode-step latency",
                    lambda: latency.run(sizes, servers),
                )
            )
        if "d" in wanted:
            sections.append(
                _guarded(
                    "d",
                    "Concurrency",
                    lambda: concurrency.run(sizes, servers),
                )
            )
        if "g" in wanted:
            sections.append(
                _guarded(
                    "g",
                    "Inference integration",
                    lambda: integrations.run(sizes, server.target, floor.target),
                )
            )
        if "h" in wanted:  # its own server, on a unix socket
            from bench import shared

            sections.append(
                _guarded(
                    "h",
                    "Same host: the unix socket and shared memory",
                    lambda: shared.run(sizes, floor.target),
                )
            )
        if "p" in wanted:  # its own servers of 1 and 2 processes
            from bench import processes

            sections.append(
                _guarded("p", "One client, several server processes", lambda: processes.run(sizes))
            )
        growth_section: Section | None = None
        if "e" in wanted:
            growth_section = _guarded(
                "e", "Growth", lambda: growth.run(sizes, server.target, floor.target)
            )
            sections.append(growth_section)
        server.stop()
        floor.stop()
        if "e" in wanted or "f" in wanted:
            fresh = procs.start_posenc(extra).wait_ready()
            procs.wait_serving(fresh.target)
            stream: dict[str, object] = {}

            def server_rss() -> Section:
                stream.update(memory.stream_with_server_rss(sizes, fresh))
                target = growth_section or Section("e", "Growth")
                memory.add_server_rss(target, stream)
                return target

            rss = _guarded("e", "Growth: server RSS while streaming", server_rss)
            if growth_section is None:
                sections.append(rss)
            elif rss.error:
                growth_section.error = rss.error
            else:
                growth_section.seconds += rss.seconds
            if "f" in wanted:
                sections.append(
                    _guarded(
                        "f",
                        "Client memory",
                        lambda: memory.client_memory(sizes, fresh.target, stream),
                    )
                )
            fresh.stop()
    finally:
        procs.stop_all()
    sections.sort(key=lambda s: s.key)
    wall = time.monotonic() - started
    about["wall_seconds"] = round(wall, 1)
    about["load_average_at_end"] = load_average()
    about["steal"] = steal_share(ticks_at_start, cpu_ticks())
    about["mode"] = "quick" if sizes.quick else "full"
    paths = report.write(args.out, args.name, about, sizes, sections)
    print(f"[bench] {wall:.0f} s; wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0 if all(s.error is None for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
