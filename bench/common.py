"""Shared pieces: run sizes, statistics, /proc readers, and the shape of a section's results."""

from __future__ import annotations

import dataclasses
import datetime
import operator
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20
GIB = 1 << 30
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Sizes:
    """Every size and count of one run; ``quick`` keeps ``make bench-quick`` under 3 minutes."""

    quick: bool
    repeats: int
    # a. engine
    engine_shapes: tuple[tuple[int, int], ...] = ((8192, 1024), (4096, 4096))
    engine_start: int = 10**6
    # b. end to end
    e2e_rows: int = 16384
    e2e_d_model: int = 4096
    e2e_runs: int = 3
    e2e_repeats: int = 24  # in all, e2e_runs runs of equal size
    # c. latency
    latency_rounds: int = 1000
    latency_runs: int = 3  # the measured rounds: latency_runs consecutive runs of equal size
    latency_warmup: int = 100
    latency_cpu_calls: int = 1000
    # d. concurrency
    concurrency_levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    concurrency_window: float = 3.0
    concurrency_stream_bytes: int = 64 * MIB
    concurrency_repeats: int = 3
    # e. growth
    growth_d_model: int = 256
    growth_rows: tuple[int, ...] = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
    growth_widths: tuple[int, ...] = (64, 256, 1024, 4096, 16384)
    growth_width_bytes: int = 64 * MIB
    stream_bytes: int = 8 * GIB
    # f. client memory
    client_get_bytes: int = GIB
    client_get_repeats: int = 3

    @classmethod
    def for_mode(cls, quick: bool) -> Sizes:
        if not quick:
            return cls(quick=False, repeats=5, latency_rounds=3000)
        return cls(
            quick=True,
            repeats=3,
            e2e_repeats=9,
            latency_rounds=1000,
            latency_warmup=50,
            latency_cpu_calls=300,
            concurrency_window=1.0,
            concurrency_repeats=3,
            growth_rows=(1, 10, 100, 1_000, 10_000, 100_000),
            growth_width_bytes=16 * MIB,
            stream_bytes=GIB,
        )


# -- statistics ------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def mib_per_s(nbytes: float, seconds: float) -> float:
    return nbytes / MIB / seconds if seconds > 0 else float("nan")


def runs_target(
    name: str, values: Sequence[float], op: str, threshold: float, unit: str = "x"
) -> Target:
    """A target measured in several runs: the median run, with the min and max."""
    finite = [value for value in values if value == value]
    if not finite:
        return Target(name, float("nan"), op, threshold, unit)
    return Target(name, median(finite), op, threshold, unit, (min(finite), max(finite)))


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` rotated left by ``shift``: interleaved runs change who goes first."""
    if not items:
        return []
    k = shift % len(items)
    return list(items[k:]) + list(items[:k])


# -- results ---------------------------------------------------------------------------------


@dataclass
class Target:
    """One target of issue 3: ``value op threshold``, or informational when ``op`` is empty."""

    name: str
    value: float
    op: str  # ">=", "<=", "<", ">" or "" (reported, not judged)
    threshold: float
    unit: str = "x"
    spread: tuple[float, float] | None = None
    """(min, max) over the runs whose median ``value`` is, when measured in several runs."""

    @property
    def passed(self) -> bool | None:
        if not self.op:
            return None
        if self.value != self.value:  # NaN: the measurement failed
            return False
        compare = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}
        return bool(compare[self.op](self.value, self.threshold))

    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "info"}[self.passed]

    def to_json(self) -> dict[str, Any]:
        # Every field as it is (the spread a JSON list), and the verdict they give.
        return {**dataclasses.asdict(self), "verdict": self.verdict()}


@dataclass
class Table:
    caption: str
    columns: list[str]
    rows: list[list[Any]]

    def to_json(self) -> dict[str, Any]:
        return {"caption": self.caption, "columns": self.columns, "rows": self.rows}


@dataclass
class Section:
    """What one section of the suite measured."""

    key: str
    title: str
    method: str = ""
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "method": self.method,
            "tables": [t.to_json() for t in self.tables],
            "targets": [t.to_json() for t in self.targets],
            "notes": self.notes,
            "data": self.data,
            "seconds": self.seconds,
            "error": self.error,
        }


# -- /proc -----------------------------------------------------------------------------------


def proc_status_kib(pid: int | str, key: str) -> int:
    """A ``kB`` field of /proc/PID/status (``VmRSS``, ``VmHWM``), in KiB; 0 if gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (none once it is gone), from /proc/PID/task/*/children."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                found.extend(int(child) for child in listed.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    seen: list[int] = []
    todo = [pid]
    while todo and len(seen) < 4096:
        current = todo.pop()
        if current not in seen:
            seen.append(current)
            todo.extend(children(current))
    return seen


def tree_kib(pid: int, key: str) -> int:
    """A status field summed over ``pid`` and its descendants."""
    return sum(proc_status_kib(p, key) for p in process_tree(pid))


def reset_peak_rss() -> bool:
    """Resets this process's VmHWM to its current RSS (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


# -- machine ---------------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("nan")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def load_average() -> str:
    """/proc/loadavg's 1, 5 and 15 minute averages: how busy the machine was."""
    try:
        with open("/proc/loadavg") as loadavg:
            return " ".join(loadavg.read().split()[:3])
    except OSError:
        return "unknown"


def cpu_ticks() -> tuple[int, int] | None:
    """The machine's (all, steal) CPU ticks so far, from /proc/stat; None elsewhere. On a
    virtual machine, steal is time the host ran something else while ours was runnable."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user, nice]
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def steal_share(start: tuple[int, int] | None, end: tuple[int, int] | None) -> str:
    """The share of the machine's CPU time the host took between two ``cpu_ticks()``."""
    if start is None or end is None or end[0] <= start[0]:
        return "unknown"
    return f"{100 * (end[1] - start[1]) / (end[0] - start[0]):.0f}%"


def machine() -> dict[str, Any]:
    """What the figures came from: hardware, software versions, code revision, date."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "ram_gib": round(_mem_total_gib(), 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "posenc": _version("posenc"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "load_average_at_start": load_average(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench", *sys.argv[1:]]),
    }


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (threads included)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / _TICKS
