"""What every client command shares: exit codes, the target, TLS, token and timeout
arguments, the client they make, and how usage errors are reported."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import grpc

from posenc._channel import DEFAULT_TARGET, is_uri
from posenc._client import Client
from posenc.errors import DeadlineExceededError

# Exit codes. Docker reserves 2 for health checks, so every failure of a client command
# exits 1 (argparse's usage errors keep their conventional 2).
EXIT_OK = 0


EXIT_FAILURE = 1


EXIT_USAGE = 2


_TARGET_ENV = "POSENC_TARGET"


_TOKEN_FILE_ENV = "POSENC_TOKEN_FILE"


def _targets(args: argparse.Namespace) -> list[str]:
    given: list[str] = args.target or [os.environ.get(_TARGET_ENV) or DEFAULT_TARGET]
    # "a:1,b:2" is a list of replicas, unless it is a gRPC URI (ipv4:a:1,b:2 has commas too).
    targets: list[str] = []
    for value in given:
        if is_uri(value):
            targets.append(value)
        else:
            targets.extend(part.strip() for part in value.split(",") if part.strip())
    return targets


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _first_answer(client: Client, args: argparse.Namespace, seconds: float | None) -> Any:
    """The server's info, asked within ``seconds``: a target that does not answer in time
    is reported with its address and the flag that waits longer."""
    try:
        return client.server_info(timeout=seconds)
    except DeadlineExceededError as error:
        flag = "--connect-timeout" if args.command == "fetch" else "--timeout"
        raise DeadlineExceededError(
            f"no answer from {', '.join(_targets(args))} within {seconds:g} s: is a posenc "
            f"server listening there? (wait longer with {flag} SECONDS)",
            code=error.code,
        ) from None


def _add_client_arguments(parser: argparse.ArgumentParser, timeout: float | None) -> None:
    parser.add_argument(
        "--target",
        action="append",
        metavar="HOST:PORT",
        help=f"server address; repeat for round robin over replicas "
        f"(default: ${_TARGET_ENV} or {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=timeout,
        metavar="SECONDS",
        help=f"deadline of the whole command (default: {timeout or 'none'})",
    )
    security = parser.add_argument_group("security")
    security.add_argument(
        "--token-file",
        metavar="FILE",
        default=os.environ.get(_TOKEN_FILE_ENV),
        help=f"file holding the bearer token to send (default: ${_TOKEN_FILE_ENV})",
    )
    security.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA")
    security.add_argument(
        "--tls-cert", metavar="PEM", help="client certificate, for mutual TLS (with --tls-key)"
    )
    security.add_argument("--tls-key", metavar="PEM", help="client private key, for mutual TLS")
    security.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the server's certificate must carry (default: the target's host)",
    )
    security.add_argument(
        "--local",
        action="store_true",
        help="no TLS, to a server on this machine: gRPC checks the address is loopback "
        "(a --token-file token is sent only over TLS or --local)",
    )


def _client(args: argparse.Namespace, targets: Sequence[str], **settings: Any) -> Client:
    """A client for the command's targets, with its timeout, token and TLS settings."""
    token = None
    if args.token_file:
        token = Path(args.token_file).read_text(encoding="utf-8").strip()
    credentials = None
    if args.tls_ca or args.tls_cert:

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        credentials = grpc.ssl_channel_credentials(
            read(args.tls_ca), read(args.tls_key), read(args.tls_cert)
        )
    elif args.local:
        credentials = grpc.local_channel_credentials()
    if args.tls_server_name:
        settings["options"] = [("grpc.ssl_target_name_override", args.tls_server_name)]
    return Client(targets, timeout=args.timeout, token=token, credentials=credentials, **settings)


class _Parser(argparse.ArgumentParser):
    """Usage errors in two lines, the error and where the usage is, as the client commands'
    own usage errors are (argparse prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(
            f"{self.prog}: error: {message}\nSee '{self.prog} --help' for the usage.",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE)


@dataclass(frozen=True)
class _Command:
    """What ``posenc --help`` and ``posenc COMMAND --help`` say of a command: ``summary`` in
    the list of commands, ``description`` above its arguments, ``epilog`` below them (kept
    as written: examples, one a line); ``add_help`` False for a command that hands its flags
    on, ``--help`` included."""

    summary: str
    description: str | None = None
    epilog: str | None = None
    add_help: bool = True

    def add_to(
        self, commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str
    ) -> argparse.ArgumentParser:
        """The command's parser, added to ``commands`` as ``name``."""
        # An epilog's examples (and the description beside them) keep their lines; the
        # arguments' help is wrapped to the terminal.
        kept = self.epilog is not None
        formatter = argparse.RawDescriptionHelpFormatter if kept else argparse.HelpFormatter
        return commands.add_parser(
            name,
            help=self.summary,
            description=self.description,
            epilog=self.epilog,
            formatter_class=formatter,
            add_help=self.add_help,
        )


def _usage_error(message: str, command: str = "fetch") -> SystemExit:
    """A usage error, reported as argparse reports them."""
    print(f"posenc {command}: error: {message}", file=sys.stderr)
    return SystemExit(EXIT_USAGE)


def _checkout() -> tuple[str, str] | None:
    """Where posenc was installed from, when from a checkout: its directory and ``"-e "``
    if editable (else ``""``); None when from a package index."""
    try:
        direct_url = metadata.distribution("posenc").read_text("direct_url.json")
        origin = json.loads(direct_url or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        return None
    url = str(origin.get("url", ""))
    if not url.startswith("file://") or "dir_info" not in origin:
        return None
    return url.removeprefix("file://"), "-e " if origin["dir_info"].get("editable") else ""


def _install_command(extra: str) -> str:
    """The pip command that adds ``extra`` the way posenc itself was installed."""
    checkout = _checkout()
    if checkout is None:
        return f"pip install 'posenc[{extra}]'"
    path, editable = checkout
    return f"pip install {editable}'{path}[{extra}]'"
