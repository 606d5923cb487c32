"""Runs the suite: ``python -m bench [--quick]`` or ``python bench/run.py [--quick]``.

Starts a posenc server and the raw floor server (same number of processes) on 127.0.0.1
ephemeral ports, measures sections a-h, p and s, writes ``bench/results/latest.{md,json,png}`` and
stops every process it started, whatever happens.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs
from bench.common import REPO, Section, Sizes, cpu_ticks, load_average, machine, steal_share
from bench.harness import Servers

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


# The sections run beside the idle servers, in this order: (key, title, module). Section a
# runs in-process once the servers are up and idle; b, s, h and p start servers of their
# own beside the idle ones.
_BESIDE_IDLE = (
    ("a", "Engine, cold", "engine_bench"),
    ("b", "End to end through the SDK", "e2e"),
    ("s", "Start-up and the first call", "startup"),
    ("c", "Decode-step latency", "latency"),
    ("d", "Concurrency", "concurrency"),
    ("g", "Inference integration", "integrations"),
    ("h", "Same host: the unix socket and shared memory", "shared"),
    ("p", "One client, several server processes", "processes"),
    ("e", "Growth", "growth"),
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument(
        "--sections", default=SECTIONS, help=f"which sections to run (default {SECTIONS})"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results", help="output directory"
    )
    parser.add_argument("--name", default="latest", help="output file stem (default latest)")
    return parser.parse_args(argv)


def _beside_idle(sizes: Sizes, wanted: set[str], flags: list[str], processes: int) -> list[Section]:
    """The sections measured against the suite's idle posenc and floor servers."""
    sections: list[Section] = []
    with procs.serving_pair(flags, processes) as (server, floor):
        servers = Servers(
            server.target, floor.target, server.pids, floor.pids, processes, tuple(flags)
        )
        for key, title, name in _BESIDE_IDLE:
            if key in wanted:
                module = importlib.import_module(f"bench.{name}")
                sections.append(_guarded(key, title, functools.partial(module.run, sizes, servers)))
    return sections


def _memory(sizes: Sizes, wanted: set[str], flags: list[str], sections: list[Section]) -> None:
    """Sections e (server RSS while streaming) and f, on a fresh posenc server of their own,
    once the idle servers are stopped: section e's figures join its growth figures."""
    from bench import memory

    growth_section = next((s for s in sections if s.key == "e"), None)
    fresh = procs.start_posenc(flags).wait_ready()
    try:
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
    finally:
        fresh.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    wanted = set(args.sections)
    from bench import report

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
    try:
        sections = _beside_idle(sizes, wanted, extra, server_processes)
        if "e" in wanted or "f" in wanted:
            _memory(sizes, wanted, extra, sections)
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
