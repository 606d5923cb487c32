"""The one harness every section times and compares with: interleaved timing, step loops,
the servers a section measures, and the child processes it starts.

A section only says what it compares; how the two sides are timed (alternating which goes
first, so that load on the machine hits both alike), how a decode loop's steps are timed
(the model's pause between them untimed) and how a child Python process is started (with
``bench`` importable) are written here once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.common import REPO


@dataclass(frozen=True)
class Servers:
    """The idle posenc and floor servers the suite started, as a section sees them."""

    posenc_target: str
    floor_target: str
    posenc_pids: Callable[[], list[int]]
    """The posenc server's current pids (for their CPU)."""
    floor_pids: Callable[[], list[int]]
    processes: int
    """How many processes each of the two servers has."""
    flags: tuple[str, ...] = ()
    """The posenc server's flags beyond its defaults: a section starting servers of its own
    starts them alike."""


def timed(function: Callable[[], object]) -> float:
    """Seconds one call of ``function`` takes (its result is dropped before returning)."""
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def interleaved(
    first: Callable[[], float], second: Callable[[], float], repeats: int
) -> tuple[list[float], list[float]]:
    """``repeats`` timings of each, alternating which goes first."""
    a: list[float] = []
    b: list[float] = []
    for i in range(repeats):
        if i % 2:
            b.append(second())
            a.append(first())
        else:
            a.append(first())
            b.append(second())
    return a, b


def step_times(step: Callable[[int], object], rounds: int, pause: float = 0.0) -> list[float]:
    """Seconds of each of ``rounds`` calls ``step(0)``, ``step(1)``, ...; after each, an
    untimed ``pause`` (the model's compute between a decode loop's steps)."""
    times: list[float] = []
    for index in range(rounds):
        start = time.perf_counter()
        step(index)
        times.append(time.perf_counter() - start)
        if pause:
            time.sleep(pause)
    return times


def child_env(updates: Mapping[str, str] | None = None, drop: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment for a child run from the checkout: ``bench`` importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in drop:
        env.pop(name, None)
    env.update(updates or {})
    return env


def run_python(
    arguments: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``python *arguments`` in a child from the checkout, its output captured as text."""
    return subprocess.run(
        [sys.executable, *arguments],
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
        cwd=REPO,
        env=dict(env) if env is not None else child_env(),
    )
