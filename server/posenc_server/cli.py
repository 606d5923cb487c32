"""The ``posenc-server`` command (also ``python -m posenc_server`` and ``posenc serve``).

It takes the flags of ``ServerConfig`` and serves until SIGTERM or SIGINT. A dependency of
the server that is missing from the environment is said in one line with the pip command
that installs it, instead of a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from importlib import metadata

__all__ = ["main"]

# What a usage error and a missing dependency exit with (as `posenc serve`'s own).
_EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the server with ``argv`` (default: the process's arguments); its exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        from posenc_server.app import run
    except ImportError as error:
        missing = error.name or str(error)
        print(
            f"posenc-server: the server needs the module {missing}, which is not installed.\n"
            f"Install it with: {install_command()}",
            file=sys.stderr,
        )
        return _EXIT_USAGE
    return run(arguments)


def install_command() -> str:
    """The pip command that installs the server again the way it was installed: from its
    checkout's directory (editable if it was), or from the package index."""
    try:
        direct_url = metadata.distribution("posenc-server").read_text("direct_url.json")
        origin = json.loads(direct_url or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        origin = {}
    url = str(origin.get("url", ""))
    if not url.startswith("file://") or "dir_info" not in origin:
        return "pip install posenc-server"
    editable = "-e " if origin["dir_info"].get("editable") else ""
    return f"pip install {editable}'{url.removeprefix('file://')}'"
