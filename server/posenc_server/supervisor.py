"""Several server processes on one port, so that every core serves.

Python runs one thread at a time, so one process uses about one core however many requests
it has. ``posenc serve`` therefore starts ``processes`` workers that all listen on the same
port (SO_REUSEPORT: the kernel spreads incoming connections over them) and supervises them:
it forwards their logs, replaces a worker that dies, and on SIGTERM drains them all. Each
worker has ``cache_bytes / processes`` of cache, so the budget holds for the whole server.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from posenc_server import metrics
from posenc_server.config import ServerConfig

log = logging.getLogger("posenc_server")

# Set in a worker's environment by its supervisor: the worker's index and the supervisor's pid.
WORKER_INDEX_ENV = "POSENC_WORKER_INDEX"
SUPERVISOR_PID_ENV = "POSENC_SUPERVISOR_PID"
WORKER_READY = "worker listening"
_START_TIMEOUT = 60.0
_RESTART_DELAY = 1.0


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
    ready: threading.Event = field(default_factory=threading.Event)


def _reserve_port(config: ServerConfig) -> socket.socket:
    """A socket holding the port (resolving port 0) for the server's lifetime.

    It shares the port with the workers (SO_REUSEPORT) but never listens, so it takes no
    connections; holding it keeps other programs off the port while a worker restarts.
    """
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((config.host, config.port))
    except OSError:
        sock.close()
        raise
    return sock


def _forward_logs(worker: _Worker) -> None:
    assert worker.process.stderr is not None
    for line in worker.process.stderr:
        sys.stderr.write(line)
        if WORKER_READY in line:
            worker.ready.set()


def supervise(
    config: ServerConfig, argv: Sequence[str], stop: threading.Event, signals: list[str]
) -> int:
    """Run ``config.process_count`` workers until ``stop`` is set, then drain them."""
    count = config.process_count
    try:
        port_holder = _reserve_port(config)
    except OSError as error:
        print(f"posenc serve: cannot listen on {config.address}: {error}", file=sys.stderr)
        return 1
    port = int(port_holder.getsockname()[1])
    # Workers write their metrics here; the supervisor serves the sum.
    metrics_dir = tempfile.TemporaryDirectory(prefix="posenc-metrics-")
    worker_argv = [
        *argv,
        # Later flags win: these override whatever argv said.
        *("--processes", "1", "--port", str(port)),
        *("--cache-bytes", str(config.cache_bytes // count)),
    ]

    def start(index: int) -> _Worker:
        process = subprocess.Popen(
            [sys.executable, "-m", "posenc_server", *worker_argv],
            env={
                **os.environ,
                WORKER_INDEX_ENV: str(index),
                SUPERVISOR_PID_ENV: str(os.getpid()),
                metrics.MULTIPROCESS_DIR_ENV: metrics_dir.name,
            },
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        worker = _Worker(index, process)
        threading.Thread(target=_forward_logs, args=(worker,), daemon=True).start()
        return worker

    workers = [start(index) for index in range(count)]
    try:
        deadline = time.monotonic() + _START_TIMEOUT
        for worker in workers:
            while not worker.ready.wait(0.1):
                if worker.process.poll() is not None or time.monotonic() > deadline:
                    log.error(
                        "a worker failed to start", extra={"fields": {"worker": worker.index}}
                    )
                    return 1
                if stop.is_set():
                    return 0
        from posenc_server.app import startup_fields  # app imports this module

        metrics_port = -1
        if config.metrics_port >= 0:
            try:
                metrics_port = metrics.serve(config.host, config.metrics_port, metrics_dir.name)
            except OSError as error:
                print(f"posenc serve: cannot serve metrics: {error}", file=sys.stderr)
                return 1
        fields = startup_fields(config, port, metrics_port)
        log.info("listening", extra={"fields": {**fields, "processes": count}})
        while not stop.wait(0.2):
            for position, worker in enumerate(workers):
                if worker.process.poll() is not None and not stop.is_set():
                    log.error(
                        "worker exited; starting a new one",
                        extra={
                            "fields": {"worker": worker.index, "code": worker.process.returncode}
                        },
                    )
                    metrics.forget_process(worker.process.pid, metrics_dir.name)
                    time.sleep(_RESTART_DELAY)
                    workers[position] = start(worker.index)
        log.info(
            "draining",
            extra={
                "fields": {"signal": signals[0] if signals else "", "grace": config.grace_seconds}
            },
        )
    finally:
        drained = _stop_workers(workers, config.grace_seconds)
        port_holder.close()
        metrics_dir.cleanup()
    log.info("stopped", extra={"fields": {"drained": drained}})
    return 0


def _stop_workers(workers: list[_Worker], grace: float) -> bool:
    """SIGTERM every worker (each drains), SIGKILL what is left after the grace."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace + 5.0
    drained = True
    for worker in workers:
        try:
            drained &= worker.process.wait(max(0.0, deadline - time.monotonic())) == 0
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
            drained = False
    return drained
