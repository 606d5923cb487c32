"""``posenc serve``: hands the process over to the server's own command."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Final

from posenc.cli._shared import EXIT_USAGE, _checkout, _Command

# Its flags are the server's, handed over untouched: no --help of its own.
COMMAND: Final = _Command(
    "run a server (needs posenc-server installed; `posenc serve --help` for its flags)",
    add_help=False,
)


def run(argv: list[str]) -> int:
    """Hands the process over to the server's own command (``python -m posenc_server``),
    which parses its flags: the same process, so its signals, output and exit code are the
    server's. The SDK imports nothing of the server; it only looks for it."""
    if importlib.util.find_spec("posenc_server") is None:
        print(
            f"posenc serve: the server is not installed.\nInstall it with: {_install_command()}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "posenc_server", *argv])


def _install_command() -> str:
    """The pip command that adds the server (the distribution ``posenc-server``) the way
    posenc was installed: from the same checkout's ``server/`` directory, or the index."""
    checkout = _checkout()
    if checkout is None or not Path(checkout[0], "server", "pyproject.toml").is_file():
        return "pip install posenc-server"
    path, editable = checkout
    return f"pip install {editable}'{Path(path, 'server')}'"


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """None: the server parses the ``serve`` command's flags (:func:`run` hands them over)."""
