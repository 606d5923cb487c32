"""The tests' wait for a server to start (conftest's ``wait_for_start``): it waits as long as
the start makes progress, however slow a loaded machine makes it, and fails a start that
makes none."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_for_start

# Stands in for a server: busy (compiling) for SECONDS, or silent and idle, then ready.
_BUSY_THEN_READY = """
import sys, time
seconds, busy = float(sys.argv[1]), sys.argv[2] == "busy"
end = time.monotonic() + seconds
while time.monotonic() < end:
    if not busy:
        time.sleep(0.1)
print('{"message": "listening"}', file=sys.stderr, flush=True)
time.sleep(60)
"""


def _start(seconds: float, busy: bool) -> tuple[subprocess.Popen[str], list[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", _BUSY_THEN_READY, str(seconds), "busy" if busy else "idle"],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert process.stderr is not None
    stream = process.stderr
    threading.Thread(target=lambda: lines.extend(stream), daemon=True).start()
    return process, lines


def test_a_start_that_keeps_working_is_waited_for_past_the_idle_bound() -> None:
    """Busy for 3 s (a first start compiling, 6 times as long as the idle bound here): it
    is waited for, where a fixed bound shorter than the start would fail it."""
    process, lines = _start(3.0, busy=True)
    try:
        started = time.monotonic()
        wait_for_start(process, lines, idle=0.5)
        assert time.monotonic() - started >= 2.5
    finally:
        process.kill()
        process.wait(10)


def test_a_start_that_makes_no_progress_fails_after_the_idle_bound() -> None:
    process, lines = _start(30.0, busy=False)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no progress"):
            wait_for_start(process, lines, idle=1.0)
        assert time.monotonic() - started < 20
    finally:
        process.kill()
        process.wait(10)
