"""Several server processes on one port, so that every core serves.

Python runs one thread at a time, so one process uses about one core however many requests
it has. ``posenc serve`` therefore starts ``processes`` workers that all listen on the same
port (SO_REUSEPORT: the kernel spreads incoming connections over them) and supervises them:
it forwards their logs, replaces a worker that dies or stops answering its health checks,
and on SIGTERM drains them all. Each worker has ``cache_bytes / processes`` of cache, so the
budget holds for the whole server.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from posenc_server import metrics, shm
from posenc_server.config import DEFAULT_METRICS_PORT, PROGRAM, ServerConfig, startup_fields

log = logging.getLogger("posenc_server")

# Set in a worker's environment by its supervisor: the worker's index and the supervisor's pid.
WORKER_INDEX_ENV = "POSENC_WORKER_INDEX"
SUPERVISOR_PID_ENV = "POSENC_SUPERVISOR_PID"
# Set in a worker's environment: a unix socket where it serves health alone, so that the
# supervisor can ask that one worker (the shared port reaches a worker the kernel picks). The
# socket is a file in a directory only the server's user may enter (0700): an abstract socket
# is open to every process of the network namespace: a plaintext side door.
HEALTH_SOCKET_ENV = "POSENC_WORKER_HEALTH_SOCKET"
#: What a supervisor sends a draining worker to stop it at once (a second SIGTERM, which a
#: signal to the whole process group also delivers, changes nothing in a worker).
HURRY_SIGNAL: Final = signal.SIGUSR1
# A unix socket's path must fit sockaddr_un's 108 bytes.
_MAX_SOCKET_PATH = 100
WORKER_READY = "worker listening"
# Workers compile the engine's kernels before they report ready when numba's cache holds
# none for this CPU: many seconds of CPU each, several at once on few cores.
_START_TIMEOUT = 180.0
_RESTART_DELAY = 1.0
# A worker that fails this many health checks in a row, one a second, each given a second
# to answer, is replaced: a hung worker keeps taking the connections the kernel sends it.
_HEALTH_INTERVAL = 1.0
_HEALTH_TIMEOUT = 1.0
_HEALTH_FAILURES = 3
# A worker that failed this many checks in a row serves no new call (/healthz says so) until
# it answers again or is replaced: one check slow on a busy machine is not enough.
_READY_FAILURES = 2
# A worker still running this long after its grace (or after a second signal) is killed.
_KILL_AFTER_GRACE = 5.0
#: How often a drain looks for a second signal (which cuts it short).
HURRY_CHECK_SECONDS: Final = 0.1


class PortInUseError(OSError):
    """A port the server needs is taken by another program (or another posenc server)."""


def check_port_free(host: str, port: int, setting: str) -> None:
    """Raise PortInUseError naming ``port`` and ``setting`` when something holds the port.

    The probe binds without SO_REUSEPORT, which fails while any socket is bound there, even
    one of another server that shares its port with SO_REUSEPORT: so a second server never
    silently joins a running one. Port 0 (any free port) is never busy.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR, as the server's own sockets have: connections of a server that just
        # stopped (TIME_WAIT) do not make the port busy, a listening socket still does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    errno.EADDRINUSE, f"port {port} is in use: choose another with {setting}"
                ) from None
            raise


def serve_metrics(
    config: ServerConfig,
    serving: Callable[[], bool],
    multiprocess_dir: str | None = None,
    alive: Callable[[], bool] | None = None,
) -> int:
    """Serve /metrics, /healthz (200 while ``serving()``) and /livez (200 while ``alive()``)
    as ``config`` says; the port, or -1 when metrics are off.

    A failure raises OSError whose message names the port and the setting that chose it.
    """
    if config.metrics_port < 0:
        return -1
    try:
        return metrics.serve(
            config.metrics_host, config.metrics_port, serving, multiprocess_dir, alive
        )
    except OSError as error:
        if config.metrics_port == DEFAULT_METRICS_PORT and error.errno == errno.EADDRINUSE:
            # A second server on a developer's machine: the default port is a convention,
            # not a promise, so it yields; a port chosen on purpose fails the start below.
            port = metrics.serve(config.metrics_host, 0, serving, multiprocess_dir, alive)
            log.warning(
                "metrics port busy: serving metrics on a free port",
                extra={"fields": {"busy_port": DEFAULT_METRICS_PORT, "metrics_port": port}},
            )
            return port
        raise OSError(
            f"cannot serve metrics on port {config.metrics_port}: {error} "
            "(choose another with --metrics-port (POSENC_METRICS_PORT), or -1 for none)"
        ) from None


# How long a count of a process's connections stands: /healthz may be asked for in a loop,
# and a count reads every descriptor of the process.
_CONNECTIONS_TTL_SECONDS = 1.0
_ESTABLISHED = "01"  # /proc/net/tcp's state
_CONNECTED = "03"  # /proc/net/unix's state
_MAX_COUNTED = 1024


def open_connections(pid: int, port: int, unix_socket: str) -> int:
    """The client connections process ``pid`` holds on TCP ``port`` and on ``unix_socket``
    (none: ""), as the kernel lists them: what gRPC's connection limit counts."""
    inodes: set[str] = set()
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):
            target = os.readlink(f"{fds}/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as lines:
            next(lines, None)
            for line in lines:
                fields = line.split()
                local_port = int(fields[1].rpartition(":")[2], 16)
                count += local_port == port and fields[3] == _ESTABLISHED and fields[9] in inodes
    if unix_socket:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/unix") as lines:
            next(lines, None)
            for line in lines:
                fields = line.split()
                # Accepted connections carry the listening socket's path.
                count += (
                    len(fields) > 7
                    and fields[7] == unix_socket
                    and fields[5] == _CONNECTED
                    and fields[6] in inodes
                )
    return count


class ConnectionRoom:
    """Whether processes have room for a new client connection under ``--max-connections``,
    counted at most once per ``_CONNECTIONS_TTL_SECONDS``. Thread-safe."""

    def __init__(self, config: ServerConfig, port: int) -> None:
        self._limit, self._port, self._unix = config.max_connections, port, config.unix_socket
        self._lock = threading.Lock()
        self._counted: dict[int, tuple[float, bool]] = {}

    def has_room(self, pid: int, unix: bool = True) -> bool:
        """Whether process ``pid`` (serving the unix socket too, if ``unix``) holds fewer
        connections than the limit (always, without one)."""
        if not self._limit:
            return True
        with self._lock:
            now = time.monotonic()
            counted, room = self._counted.get(pid, (-math.inf, True))
            if now - counted >= _CONNECTIONS_TTL_SECONDS:
                try:
                    held = open_connections(pid, self._port, self._unix if unix else "")
                except OSError:  # the process is gone: its own check says so
                    held = 0
                room = held < self._limit
                if len(self._counted) >= _MAX_COUNTED:  # replaced workers' pids
                    self._counted.clear()
                self._counted[pid] = (now, room)
            return room


_METRICS_DIR_PREFIX = "posenc-metrics-"
_HEALTH_DIR_PREFIX = "posenc-health-"


def _remove_orphaned_metrics_dirs() -> None:
    """Remove the metrics and health directories of supervisors that died without cleaning
    up (SIGKILL, OOM kill): each is named after its supervisor's pid, and a dead pid's is an
    orphan."""
    paths = [
        path
        for prefix in (_METRICS_DIR_PREFIX, _HEALTH_DIR_PREFIX)
        for parent in {tempfile.gettempdir(), "/tmp"}
        for path in Path(parent).glob(f"{prefix}*-*")
    ]
    for path in paths:
        pid = path.name.split("-")[2]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed an orphaned metrics directory", extra={"fields": {"path": str(path)}})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _private_directory(preferred: str) -> str:
    """A new directory only this user may enter (0700), for the workers' health sockets:
    in ``preferred``'s directory when a socket path there fits sockaddr_un, else in /tmp."""
    parent = os.path.dirname(preferred)
    if len(parent) + 40 > _MAX_SOCKET_PATH:
        parent = "/tmp"
    return tempfile.mkdtemp(prefix=f"{_HEALTH_DIR_PREFIX}{os.getpid()}-", dir=parent)


def _remove_socket(address: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(address.removeprefix("unix:"))


def worker_index() -> int | None:
    """This process's worker index when a supervisor started it, else None."""
    value = os.environ.get(WORKER_INDEX_ENV)
    return None if value is None else int(value)


def die_with_supervisor() -> None:
    """Make the kernel kill this worker when its supervisor dies, even by SIGKILL.

    Otherwise orphaned workers would keep the port and serve on after their supervisor is
    gone, and a restarted server would share the port with them.
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if str(os.getppid()) != os.environ.get(SUPERVISOR_PID_ENV):
        os._exit(1)  # the supervisor died before prctl took effect


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[str]
    health_socket: str
    ready: threading.Event = field(default_factory=threading.Event)
    failed_checks: int = 0

    def check_health(self) -> None:
        """Ask this worker (not the kernel's pick) for its health; count the failures."""
        with grpc.insecure_channel(self.health_socket) as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=_HEALTH_TIMEOUT
                )
                healthy = response.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                healthy = False
        self.failed_checks = 0 if healthy else self.failed_checks + 1

    def serving(self) -> bool:
        """Started, running, and not judged hung: fewer failed health checks in a row than
        get it replaced (one check that times out on a busy machine is not enough)."""
        return (
            self.ready.is_set()
            and self.failed_checks < _HEALTH_FAILURES
            and self.process.poll() is None
        )


def check_unix_socket_free(config: ServerConfig) -> None:
    """Raise PortInUseError naming ``--unix-socket`` when another server listens on it (or
    on its region socket), or when the path holds something else; a socket file no server
    listens on (left by one that died) is removed."""
    for path in (config.unix_socket, config.unix_socket + ".shm") if config.unix_socket else ():
        try:
            shm.remove_stale_socket(path)
        except OSError as error:
            raise PortInUseError(
                errno.EADDRINUSE, f"{error}: choose another with --unix-socket (POSENC_UNIX_SOCKET)"
            ) from None


def _reserve_port(config: ServerConfig) -> socket.socket:
    """A socket holding the port (resolving port 0) for the server's lifetime.

    It shares the port with the workers (SO_REUSEPORT) but never listens, so it takes no
    connections; holding it keeps other programs off the port while a worker restarts.
    """
    check_port_free(config.host, config.port, "--port (POSENC_PORT)")
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((config.host, config.port))
    except OSError:
        sock.close()
        raise
    return sock


def _hold_port(config: ServerConfig) -> socket.socket | None:
    """The socket holding the port (``_reserve_port``), once the unix socket is free too;
    None, said on stderr, when either is taken."""
    try:
        check_unix_socket_free(config)
        return _reserve_port(config)
    except OSError as error:
        print(f"{PROGRAM}: cannot listen on {config.address}: {error}", file=sys.stderr)
        return None


def _forward_logs(worker: _Worker) -> None:
    assert worker.process.stderr is not None
    for line in worker.process.stderr:
        sys.stderr.write(line)
        if WORKER_READY in line:
            worker.ready.set()


class _Pool:
    """The supervisor's workers on ``port``: how each is started, whether the server
    serves, and the loop that replaces a worker that exits."""

    def __init__(self, config: ServerConfig, argv: Sequence[str], port: int) -> None:
        self.config = config
        self.workers: list[_Worker] = []
        self.room = ConnectionRoom(config, port)
        # Workers write their metrics here; the supervisor serves the sum. Their health
        # sockets live here too.
        _remove_orphaned_metrics_dirs()
        self.metrics_dir = tempfile.TemporaryDirectory(
            prefix=f"{_METRICS_DIR_PREFIX}{os.getpid()}-"
        )
        self.health_dir = _private_directory(self.metrics_dir.name)
        self.generations = itertools.count()
        self.worker_argv = [
            *argv,
            # Later flags win: these override whatever argv said.
            *("--processes", "1", "--port", str(port)),
            *("--cache-bytes", str(config.cache_bytes // config.process_count)),
        ]

    def alive(self, stop: threading.Event) -> bool:
        """Not stopping, and some worker serves."""
        return not stop.is_set() and any(worker.serving() for worker in list(self.workers))

    def serving(self, stop: threading.Event) -> bool:
        """Whether a new call is served: no worker that takes connections fails its checks
        (the kernel hands a hung one its share of them), the unix socket's worker runs, and
        some worker has room for a connection under --max-connections."""
        current = [w for w in list(self.workers) if w.ready.is_set() and w.process.poll() is None]
        hung = any(w.failed_checks >= _READY_FAILURES for w in current)
        if stop.is_set() or not current or hung:
            return False
        if self.config.unix_socket and not any(w.index == 0 for w in current):
            return False
        return any(self.room.has_room(w.process.pid, unix=w.index == 0) for w in current)

    def start(self, index: int) -> _Worker:
        """Start worker ``index`` and forward its logs."""
        # In a directory only this user may enter; a new name for every worker started, so
        # that a replacement never meets its predecessor's socket file.
        path = os.path.join(self.health_dir, f"worker-{index}-{next(self.generations)}.sock")
        health_socket = f"unix:{path}"
        # The unix socket (one path) is the first worker's alone.
        unix = () if index == 0 else ("--unix-socket", "")
        process = subprocess.Popen(
            [sys.executable, "-m", "posenc_server", *self.worker_argv, *unix],
            env={
                **os.environ,
                WORKER_INDEX_ENV: str(index),
                SUPERVISOR_PID_ENV: str(os.getpid()),
                HEALTH_SOCKET_ENV: health_socket,
                metrics.MULTIPROCESS_DIR_ENV: self.metrics_dir.name,
            },
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        worker = _Worker(index, process, health_socket)
        threading.Thread(target=_forward_logs, args=(worker,), daemon=True).start()
        return worker

    def wait_ready(self, stop: threading.Event) -> int | None:
        """Wait for every worker to report ready: None when they all did, else the exit
        code (1: one failed to start in time, 0: ``stop`` came first)."""
        deadline = time.monotonic() + _START_TIMEOUT
        for worker in self.workers:
            while not worker.ready.wait(0.1):
                if worker.process.poll() is not None or time.monotonic() > deadline:
                    log.error(
                        "a worker failed to start", extra={"fields": {"worker": worker.index}}
                    )
                    return 1
                if stop.is_set():
                    return 0
        return None

    def serve_metrics(self, stop: threading.Event) -> int:
        """Serve the workers' summed metrics, /healthz and /livez (``serve_metrics``)."""
        return serve_metrics(
            self.config, lambda: self.serving(stop), self.metrics_dir.name, lambda: self.alive(stop)
        )

    def watch(self, stop: threading.Event) -> None:
        """Until ``stop``, replace each worker that exits (after ``_RESTART_DELAY``) or that
        the watchdog kills for failing its health checks."""
        watchdog = threading.Thread(
            target=_watch_health, args=(self.workers, stop), name="posenc-watchdog", daemon=True
        )
        watchdog.start()
        while not stop.wait(0.2):
            for position, worker in enumerate(self.workers):
                if worker.process.poll() is not None and not stop.is_set():
                    log.error(
                        "worker exited; starting a new one",
                        extra={
                            "fields": {"worker": worker.index, "code": worker.process.returncode}
                        },
                    )
                    metrics.forget_worker(worker.index, self.metrics_dir.name)
                    _remove_socket(worker.health_socket)
                    time.sleep(_RESTART_DELAY)
                    self.workers[position] = self.start(worker.index)

    def cleanup(self) -> None:
        """Remove the metrics and health directories."""
        self.metrics_dir.cleanup()
        shutil.rmtree(self.health_dir, ignore_errors=True)


def supervise(
    config: ServerConfig,
    argv: Sequence[str],
    stop: threading.Event,
    hurry: threading.Event,
    signals: list[str],
) -> int:
    """Run ``config.process_count`` workers until ``stop`` is set, then drain them (at once
    when ``hurry`` is set too: a second signal)."""
    port_holder = _hold_port(config)
    if port_holder is None:
        return 1
    port = int(port_holder.getsockname()[1])
    pool = _Pool(config, argv, port)
    # Metrics listen before any worker does: a busy metrics port fails the start while
    # nothing serves yet.
    try:
        metrics_port = pool.serve_metrics(stop)
    except OSError as error:
        port_holder.close()
        pool.cleanup()
        print(f"{PROGRAM}: {error}", file=sys.stderr)
        return 1
    pool.workers.extend(pool.start(index) for index in range(config.process_count))
    try:
        failed = pool.wait_ready(stop)
        if failed is not None:
            return failed
        fields = startup_fields(config, port, metrics_port)
        log.info("listening", extra={"fields": {**fields, "processes": config.process_count}})
        pool.watch(stop)
        log.info(
            "draining",
            extra={
                "fields": {"signal": signals[0] if signals else "", "grace": config.grace_seconds}
            },
        )
    finally:
        drained = _stop_workers(pool.workers, config.grace_seconds, hurry)
        port_holder.close()
        pool.cleanup()
    log.info("stopped", extra={"fields": {"drained": drained}})
    return 0


def _watch_health(workers: list[_Worker], stop: threading.Event) -> None:
    """Kill workers that stop answering their health checks; the supervisor's loop then
    replaces them as it replaces any worker that exits."""
    while not stop.wait(_HEALTH_INTERVAL):
        for worker in list(workers):
            if not worker.ready.is_set() or worker.process.poll() is not None:
                continue  # starting, or already gone
            worker.check_health()
            if worker.failed_checks >= _HEALTH_FAILURES and not stop.is_set():
                log.error(
                    "worker stopped answering its health checks; replacing it",
                    extra={"fields": {"worker": worker.index, "pid": worker.process.pid}},
                )
                worker.process.kill()


def _stop_workers(workers: list[_Worker], grace: float, hurry: threading.Event) -> bool:
    """SIGTERM every worker (each drains), SIGKILL what is left after the grace. Once
    ``hurry`` is set, each worker gets ``HURRY_SIGNAL``, which stops it at once."""

    def signal_all(signum: int) -> None:
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signum)

    signal_all(signal.SIGTERM)
    hurried = False
    deadline = time.monotonic() + grace + _KILL_AFTER_GRACE
    drained = True
    for worker in workers:
        while True:
            if hurry.is_set() and not hurried:
                hurried = True
                signal_all(HURRY_SIGNAL)
                deadline = min(deadline, time.monotonic() + _KILL_AFTER_GRACE)
            try:
                drained &= worker.process.wait(HURRY_CHECK_SECONDS) == 0
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() < deadline:
                    continue
                worker.process.kill()
                worker.process.wait()
                drained = False
                break
    return drained and not hurried
