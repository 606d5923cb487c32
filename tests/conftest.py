"""Shared fixtures: real servers on ephemeral loopback ports, in-process or as subprocesses."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import settings

from posenc_protocol.v1 import posenc_pb2_grpc
from posenc_server.app import RunningServer, start_server
from posenc_server.config import ServerConfig

if TYPE_CHECKING:
    import posenc

ROOT = Path(__file__).resolve().parent.parent

# Property tests draw the same examples in every `make test` run (a failure there is a bug, not
# a roll of the dice) and explore new ones in `make soak`; what either finds becomes an
# @example of its test.
settings.register_profile("fixed", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("explore" if os.environ.get("POSENC_SOAK") == "1" else "fixed")


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What the memory tests allow a server process beyond its cache budget. It starts at about
# 205 MiB resident: the interpreter with numpy and gRPC (about 60 MiB) and numba's compiler
# with LLVM, loaded for the engine's kernel (about 145 MiB, 110 of it code mapped from
# llvmlite's shared library, shared between processes); the rest is calls in flight, the
# spec table and heap slack.
SERVER_HEADROOM_MIB = 280


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Until ``condition()`` holds (30 s at most: a hang guard, not a measure)."""
    deadline = time.monotonic() + 30
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition(), what


def worker_pids(supervisor_pid: int) -> list[int]:
    """The pids of a supervisor's worker processes, sorted."""
    workers: set[int] = set()
    for task in os.listdir(f"/proc/{supervisor_pid}/task"):
        try:
            with open(f"/proc/{supervisor_pid}/task/{task}/children") as listing:
                workers.update(int(pid) for pid in listing.read().split())
        except FileNotFoundError:
            continue  # the thread ended meanwhile
    return sorted(workers)


def fresh_probe(target: str, timeout: float = 30) -> object:
    """A health check on a new channel, as a kubelet probes: its status, or the call's code.

    The timeout only guards against a hang: a probe that is refused, or queued behind
    stalled calls until the server gives up on them, shows as a status code
    (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNAVAILABLE), not as a slow answer, so a loaded
    machine's slowness decides nothing."""
    with grpc.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        try:
            return check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError as error:
            return error.code()  # type: ignore[attr-defined]


def sizing_rule_mib(cache_mib: float, processes: int) -> float:
    """The memory a replica is sized for (docs/operations.md, "Memory sizing"): its cache
    budget, 310 MiB per server process (Python, gRPC and numpy, numba's compiler, the spec
    table, the calls in flight) and, with several processes, 64 MiB for their supervisor."""
    return cache_mib + 310 * processes + (64 if processes > 1 else 0)


def start_threads(run: Callable[[int], object], count: int) -> list[threading.Thread]:
    """``count`` daemon threads, started, running ``run(0)`` to ``run(count - 1)``."""
    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    return threads


def token_file(folder: Path, token: str) -> Path:
    """A file ``token`` in ``folder`` holding ``token``: what --auth-token-file reads."""
    path = folder / "token"
    path.write_text(token)
    return path


class _Closable(Protocol):
    def close(self) -> None: ...


_C = TypeVar("_C", bound=_Closable)


@contextmanager
def closing_all(things: list[_C]) -> Iterator[list[_C]]:
    """``things``, each closed when the block ends, however it ends."""
    try:
        yield things
    finally:
        for thing in things:
            thing.close()


def _status_mib(pid: int, field: str) -> float:
    """Process ``pid``'s ``field`` line of /proc/<pid>/status (a size in KiB), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def peak_rss_mib(pid: int) -> float:
    """The peak resident memory of process ``pid`` (VmHWM), in MiB."""
    return _status_mib(pid, "VmHWM")


def current_rss_mib(pid: int) -> float:
    """The resident memory of process ``pid`` now (VmRSS), in MiB."""
    return _status_mib(pid, "VmRSS")


class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """A client interceptor that records every call: its method, metadata and request."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str], Any]] = []

    def _record(self, details: grpc.ClientCallDetails, request: Any) -> None:
        self.calls.append((details.method, dict(details.metadata or ()), request))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._record(details, request)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self._record(details, request)
        return continuation(details, request)


def same_bits(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Bit-for-bit equality (NaN-safe, and works for bfloat16)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")))


@pytest.fixture
def server_factory() -> Iterator[Callable[..., RunningServer]]:
    """Start in-process servers with config overrides; all are stopped at teardown."""
    started: list[RunningServer] = []

    def start(**overrides: object) -> RunningServer:
        config = ServerConfig(**{"port": 0, "grace_seconds": 1.0, **overrides})  # type: ignore[arg-type]
        running = start_server(config)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop(0)


@pytest.fixture
def server(server_factory: Callable[..., RunningServer]) -> RunningServer:
    """A server with the default limits on an ephemeral loopback port."""
    return server_factory()


@pytest.fixture
def client(server: RunningServer) -> Iterator[posenc.Client]:
    """An SDK client of :func:`server`, closed after the test."""
    import posenc  # here, not at the top: a test may set the SDK's environment first

    with posenc.Client(server.target) as client:
        yield client


@pytest.fixture
def stub(server: RunningServer) -> Iterator[posenc_pb2_grpc.PositionalEncodingServiceStub]:
    """A raw generated stub on ``server``, for protocol-level tests."""
    with grpc.insecure_channel(
        server.target, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        yield posenc_pb2_grpc.PositionalEncodingServiceStub(channel)


@dataclass
class ServerProcess:
    """A ``python -m posenc_server`` subprocess."""

    process: subprocess.Popen[str]
    port: int
    log_lines: list[str]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye."""
        self.process.kill()
        self.process.wait(10)

    def terminate(self) -> None:
        """SIGTERM: graceful drain."""
        self.process.send_signal(signal.SIGTERM)

    def logs(self) -> list[dict[str, object]]:
        """The structured log lines written so far."""
        return [json.loads(line) for line in list(self.log_lines) if line.startswith("{")]


# The type of the spawn_server fixture: spawn_server(*args) starts a server with those
# command-line arguments and returns once it serves.
Spawn = Callable[..., ServerProcess]


def _collect(stream: IO[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


# How long a starting server may go without using any CPU or writing a line before it is
# judged hung. No bound on the start as a whole: a first start compiles the kernels for a
# minute or more, several times that on a loaded machine, and is still starting.
_START_IDLE_SECONDS = 30.0


def _cpu_ticks(pid: int) -> int:
    """The CPU time (clock ticks) used so far by process ``pid`` and its workers."""
    total = 0
    for each in (pid, *worker_pids(pid)):
        try:
            with open(f"/proc/{each}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def wait_for_start(
    process: subprocess.Popen[str], lines: list[str], idle: float = _START_IDLE_SECONDS
) -> None:
    """Until the server ``process`` logs "listening" (its readiness signal) in ``lines``. It
    fails when the process exits, or when it neither uses CPU nor logs for ``idle`` seconds
    (hung): how long a start takes depends on the machine's load, progress does not."""
    progress = (-1, -1)
    idle_since = time.monotonic()
    while not any('"listening"' in line for line in lines):
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {''.join(lines)}")
        try:
            now = (_cpu_ticks(process.pid), len(lines))
        except OSError:  # the process ended meanwhile: poll() says so next
            now = progress
        if now != progress:
            progress, idle_since = now, time.monotonic()
        elif time.monotonic() - idle_since > idle:
            raise TimeoutError(
                f"server made no progress (no CPU, no log line) for {idle:g} s while "
                f"starting: {''.join(lines)}"
            )
        time.sleep(0.05)


@pytest.fixture
def spawn_server() -> Iterator[Spawn]:
    """Start ``python -m posenc_server`` subprocesses; returns once each one serves.

    One server process unless ``args`` say otherwise (``--processes N``), so that tests can
    watch the process that serves.
    """
    processes: list[ServerProcess] = []

    def spawn(port: int = 0, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        # Port 0: the server picks a free port and logs it, so no other process can take
        # it between our choice and its bind.
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "posenc_server", "--processes", "1", "--port", str(port)),
                *("--metrics-port", "0", *args),
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        lines: list[str] = []
        assert process.stderr is not None
        threading.Thread(target=_collect, args=(process.stderr, lines), daemon=True).start()
        handle = ServerProcess(process, port, lines)
        processes.append(handle)
        wait_for_start(process, lines)
        startup = next(entry for entry in handle.logs() if entry["message"] == "listening")
        handle.port = int(startup["port"])  # type: ignore[call-overload]
        return handle

    yield spawn
    for handle in processes:
        if handle.process.poll() is None:
            handle.process.kill()
            handle.process.wait(10)


# Modules that share the container images this session builds (containers.py's cached
# builds): one worker runs them all, one after another.
_CONTAINER_MODULES = frozenset({"test_containers", "test_compose", "test_balancer"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's workers (make test) take whole modules: a module's fixtures start
    their servers once, in one worker; the container modules go to one worker together."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "containers" if Path(path).stem in _CONTAINER_MODULES else path

    return ByModule(config, log)


# apt-get waits for another's dpkg lock (an unattended upgrade) instead of failing at once.
_APT_WAIT = ("-o", "DPkg::Lock::Timeout=600")
_APT_LOCK = Path(tempfile.gettempdir()) / "posenc-tests-apt.lock"


def apt_install(packages: Sequence[str], tool: str, *, recommends: bool = False) -> str | None:
    """Installs Debian's ``packages`` (which bring ``tool``) with apt-get; the reason when
    it cannot (not root, no apt-get, no registry). One test process at a time: two workers,
    or two runs, updating the package lists at once fail on apt's lock of them."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{tool} is missing and only root can `apt-get install {packages[0]}` here"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    options = () if recommends else ("--no-install-recommends",)

    def apt_get(*args: str) -> subprocess.CompletedProcess[str]:
        argv = ["apt-get", *_APT_WAIT, *args]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)

    with open(_APT_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        update = apt_get("update")
        if update.returncode != 0:
            return f"{tool} is missing and apt-get cannot reach the registry: {update.stderr}"
        install = apt_get("install", "-y", *options, *packages)
    if install.returncode != 0:
        raise RuntimeError(f"apt-get install {tool} failed: {install.stdout}{install.stderr}")
    return None
