"""The ``posenc`` command: ``serve``, ``fetch``, ``plot``, ``info`` and ``health``.

Client subcommands print SDK failures as one line on stderr and exit non-zero, never with a
traceback: they run in scripts, cron jobs and container health checks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from posenc import _quiet
from posenc._version import __version__
from posenc.cli import fetch, health, info, plot, serve
from posenc.cli._shared import EXIT_FAILURE, EXIT_OK, _Parser
from posenc.cli._tables import _explain
from posenc.cli._writer import _Terminated
from posenc.errors import PosencError

__all__ = ["main"]

# The commands in the order of `posenc --help`; each module declares its help (COMMAND), adds
# its arguments (add_arguments) and runs it (run).
_COMMANDS: dict[str, ModuleType] = {
    "serve": serve,
    "fetch": fetch,
    "plot": plot,
    "info": info,
    "health": health,
}


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="posenc",
        description=(
            "Exact positional-encoding tables (sinusoidal, rotary, M-RoPE, sin-cos grids) "
            "from a posenc gRPC server."
        ),
    )
    parser.add_argument("--version", action="version", version=f"posenc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in _COMMANDS.items():
        command.add_arguments(command.COMMAND.add_to(commands, name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``posenc`` command line; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "serve":
        # The server parses its own flags: hand them over untouched.
        return serve.run(args_list[1:])
    args = _build_parser().parse_args(args_list)
    if argv is None:
        _quiet_grpc_core()
    handler: Callable[[argparse.Namespace], int] = _COMMANDS[args.command].run
    try:
        code = handler(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader of our output left (`posenc info | head`): it has what it wanted.
        # Later flushes (at exit) must not fail again.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (PosencError, ValueError, OSError) as error:  # ValueError: a bad --target, for one
        print(f"posenc {args.command}: {_explain(error, args)}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"posenc {args.command}: interrupted", file=sys.stderr)
        return 130
    except _Terminated as stopped:
        print(f"posenc {args.command}: {stopped}", file=sys.stderr)
        return 128 + stopped.signum
    return EXIT_FAILURE


def _quiet_grpc_core() -> None:
    """Keeps gRPC's C core from writing its own log lines (a failed TLS handshake, a bad
    target URI, once per attempt) into the terminal of a client command, whose failures
    are one line of its own: the core writes to file descriptor 2, which goes to
    /dev/null, while Python's ``sys.stderr`` keeps the terminal. The core reads
    ``GRPC_VERBOSITY`` when ``grpc`` is imported, before any command runs; whoever sets
    that variable gets the core's lines as before."""
    if _quiet.CHOSEN:
        return
    try:
        sys.stderr.flush()
        terminal = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no descriptor 2 (a closed stderr)
        return
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    sys.stderr = open(  # noqa: SIM115 (the process's stderr, for as long as it lives)
        terminal, "w", buffering=1, encoding=encoding, errors="backslashreplace", closefd=True
    )
