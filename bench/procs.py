"""Servers the harness starts: posenc and the raw floor, on 127.0.0.1 ephemeral ports.

Every process started here is registered and stopped (its own process group: SIGTERM, then
SIGKILL) when the harness ends, on success, failure, Ctrl-C or SIGTERM alike.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from bench.common import REPO, process_tree, tree_kib
from bench.harness import child_env

_started: list[ServerProcess] = []
_lock = threading.Lock()


class ServerProcess:
    """A server subprocess that logs a JSON ``listening`` line with its port to stderr."""

    def __init__(self, name: str, argv: Sequence[str]) -> None:
        self.name = name
        self.argv = list(argv)
        env = child_env()  # the harness runs from the checkout: `bench` imports in children
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: stop() reaches its workers too
            cwd=REPO,
            env=env,
        )
        with _lock:
            _started.append(self)
        self.port = 0
        self.log: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line.rstrip())
            if not self._ready.is_set() and "listening" in line:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self.port = int(json.loads(line)["port"])
                    self._ready.set()
        self._ready.set()  # the process ended: wake wait_ready

    def wait_ready(self, timeout: float = 60.0) -> ServerProcess:
        """Blocks until the server listens; raises with its log if it died or took too long."""
        self._ready.wait(timeout)
        if not self.port or self.process.poll() is not None:
            log = "\n".join(self.log)
            self.stop()
            raise RuntimeError(f"{self.name} did not start ({' '.join(self.argv)}):\n{log}")
        return self

    def rss_kib(self) -> int:
        """VmRSS summed over the server and its worker processes."""
        return tree_kib(self.pid, "VmRSS")

    def hwm_kib(self) -> int:
        """VmHWM (peak RSS) summed over the server and its worker processes."""
        return tree_kib(self.pid, "VmHWM")

    def pids(self) -> list[int]:
        return process_tree(self.pid)

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace`` seconds."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        # Workers of a server that exited may outlive it in the group: end them as well.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with _lock:
            if self in _started:
                _started.remove(self)


def stop_all() -> None:
    with _lock:
        servers = list(_started)
    for server in reversed(servers):
        server.stop()


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def install_cleanup() -> None:
    """Stop every started server at exit, and turn SIGTERM into a clean exit."""
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, _on_sigterm)


# -- posenc ----------------------------------------------------------------------------------


def posenc_help() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "posenc_server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    return out.stdout


def processes_flag(help_text: str) -> str | None:
    """The server's worker-processes flag, if this version has one (e.g. ``--processes``)."""
    flags = re.findall(r"(--[a-z-]*processes)\b", help_text)
    return flags[0] if flags else None


def start_posenc(extra: Sequence[str] = ()) -> ServerProcess:
    argv = [
        sys.executable,
        "-m",
        "posenc_server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--grace-seconds",
        "1",
        # A free metrics port: a server already running here must not stop the benchmark.
        "--metrics-port",
        "0",
        *extra,
    ]
    return ServerProcess("posenc server", argv)


# -- the raw floor ---------------------------------------------------------------------------


class FloorServer:
    """``processes`` floor server processes sharing one port with SO_REUSEPORT."""

    def __init__(self, processes: int) -> None:
        first = ServerProcess("floor server 0", _floor_argv(0)).wait_ready()
        self.members = [first]
        self.port = first.port
        for index in range(1, processes):
            self.members.append(
                ServerProcess(f"floor server {index}", _floor_argv(self.port)).wait_ready()
            )

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rss_kib(self) -> int:
        return sum(member.rss_kib() for member in self.members)

    def pids(self) -> list[int]:
        """Every floor process's pid (for their CPU)."""
        return [pid for member in self.members for pid in member.pids()]

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def _floor_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "bench.floor", "--port", str(port)]


@contextlib.contextmanager
def serving_pair(
    flags: Sequence[str], processes: int
) -> Iterator[tuple[ServerProcess, FloorServer]]:
    """A posenc server (``flags``) answering calls and a floor of ``processes`` processes,
    both stopped on leaving, whatever happens."""
    server = start_posenc(flags)
    try:
        floor = FloorServer(processes)
        try:
            server.wait_ready()
            wait_serving(server.target)
            yield server, floor
        finally:
            floor.stop()
    finally:
        server.stop()


def wait_serving(target: str, timeout: float = 30.0) -> None:
    """Waits until a posenc server answers GetServerInfo."""
    import posenc

    deadline = time.monotonic() + timeout
    with posenc.Client(target, timeout=5.0) as client:
        while True:
            try:
                client.server_info()
                return
            except posenc.PosencError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
