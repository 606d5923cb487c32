"""``posenc serve``: hands the process over to the server's own command."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from posenc.cli._shared import EXIT_USAGE, _install_command


def run(argv: list[str]) -> int:
    """Hands the process over to the server's own command (``python -m posenc_server``),
    which parses its flags: the same process, so its signals, output and exit code are the
    server's. The SDK imports nothing of the server; it only looks for it."""
    if importlib.util.find_spec("posenc_server") is None:
        print(
            "posenc serve: the server is not installed.\n"
            f"Install it with: {_install_command('server')}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "posenc_server", *argv])


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``serve`` command: its flags are the server's, handed over untouched."""
    commands.add_parser(
        "serve",
        help="run a server (needs the [server] extra; `posenc serve --help` for its flags)",
        add_help=False,
    )
