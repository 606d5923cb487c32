"""The ``posenc`` command: ``serve``, ``fetch``, ``plot``, ``info`` and ``health``.

Client subcommands print SDK failures as one line on stderr and exit non-zero, never with a
traceback: they run in scripts, cron jobs and container health checks.
"""

from __future__ import annotations

import _ssl
import argparse
import contextlib
import errno
import http.client
import importlib.util
import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import FieldDescriptor
from tqdm import tqdm

from posenc import _quiet
from posenc._channel import DEFAULT_TARGET, is_uri
from posenc._client import Client
from posenc._query import DTYPE_NAMES, as_positions, named_dtype
from posenc._version import __version__
from posenc.errors import DeadlineExceededError, InvalidArgumentError, PosencError
from posenc.plot import BASES, FIGURES, default_spec, figure, render
from posenc.spec import (
    Spec,
    cases,
    choice_oneofs,
    enum_names,
    kind_message,
    kind_names,
    parameter_fields,
    position_axes,
)
from posenc.types import TableKind
from posenc_protocol.numbers import exact_integer, integer

__all__ = ["main"]

# Exit codes. Docker reserves 2 for health checks, so every failure of a client command
# exits 1 (argparse's usage errors keep their conventional 2).
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_TARGET_ENV = "POSENC_TARGET"
_TOKEN_FILE_ENV = "POSENC_TOKEN_FILE"

_FETCH_EPILOG = f"""\
The table is written to a temporary file next to OUTPUT (unnamed where the file system
allows) whose disk space is reserved before the first row, and renamed to OUTPUT when
complete: OUTPUT is never a partial table, and a full disk, Ctrl-C or SIGTERM leaves no
file behind. Memory stays at about one chunk, whatever the size of the table; an
interrupted stream (server restart) resumes where it stopped.

OUTPUT's suffix chooses the format. A .npy reads back with numpy.load(OUTPUT)
(mmap_mode="r" for large tables); bfloat16 tables hold ml_dtypes.bfloat16 values, but
.npy has no bfloat16 type: the header says '<V2' (2-byte void) and numpy.load returns
dtype |V2, viewed as bfloat16 with numpy.load(OUTPUT).view(ml_dtypes.bfloat16). A
.safetensors file holds one tensor, "table" (bfloat16 natively), and the spec in its
metadata ("posenc.spec").

Targets: --target may be repeated (calls are balanced round robin); the default is
${_TARGET_ENV} (comma-separated host:port list) or {DEFAULT_TARGET}.
"""


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


def _size(text: str) -> int:
    """A size as the server's settings take it: ``262144``, ``2**18``, ``256KiB``."""
    try:
        return integer(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes (262144, 2**18, 256KiB, 1MiB), got {text!r}"
        ) from None


def _position(text: str) -> int:
    """A position as the user writes it: ``1000000``, ``1_000_000``, ``0x100``, ``2**20``,
    ``-2**40`` or ``1e6`` (an exact integer)."""
    cleaned = text.strip().replace("_", "")
    try:
        sign, body = (-1, cleaned[1:]) if cleaned.startswith("-") else (1, cleaned)
        try:
            return sign * exact_integer(body)
        except ValueError:
            number = float(body)
            if not number.is_integer() or abs(number) >= 2**53:
                raise ValueError from None
            return sign * int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer position (e.g. 1000000, 1e6, 2**20, -2**40), got {text!r}"
        ) from None


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _bases(text: str) -> list[float]:
    values = [_positive_float(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated bases, e.g. 100,1e4")
    return values


# How long `fetch` waits for a server's first answer (its --connect-timeout): a table may
# take hours, but a server that answers nothing in this long is not going to.
_CONNECT_TIMEOUT = 20.0


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


# The classic table's fields are flags of their own (--d-model, --base, --layout, ...); they
# also set the field of that name of another --table that has one (--d-model of whisper).
_CLASSIC_KIND = "sinusoidal"
_INTEGERS = (
    FieldDescriptor.CPPTYPE_INT32,
    FieldDescriptor.CPPTYPE_INT64,
    FieldDescriptor.CPPTYPE_UINT32,
    FieldDescriptor.CPPTYPE_UINT64,
)
_REALS = (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT)


def _flag(field: FieldDescriptor) -> str:
    return "--" + field.name.replace("_", "-")


def _parse_scalar(field: FieldDescriptor, text: str) -> object:
    """A flag's text as a value of ``field``'s type (the Spec checks enum names)."""
    cpp_type = field.cpp_type
    if cpp_type == FieldDescriptor.CPPTYPE_BOOL:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{field.name} must be true or false, got {text!r}")
        return text.lower() in ("true", "1")
    try:
        if cpp_type in _INTEGERS:
            return int(text)
        if cpp_type in _REALS:
            return float(text)
    except ValueError:
        kind = "an integer" if cpp_type in _INTEGERS else "a number"
        raise ValueError(f"{field.name} must be {kind}, got {text!r}") from None
    return text


def _parse_value(field: FieldDescriptor, text: str) -> object:
    if field.is_repeated:  # comma-separated
        return [_parse_scalar(field, part.strip()) for part in text.split(",") if part.strip()]
    return _parse_scalar(field, text)


class _FlagValue:
    """The ``type=`` of a table field's flag: its text as the field's value, or a usage
    error that says what the flag takes (argparse names the function otherwise)."""

    def __init__(self, field: FieldDescriptor) -> None:
        self.field = field

    def __call__(self, text: str) -> object:
        try:
            return _parse_value(self.field, text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None


class _Parser(argparse.ArgumentParser):
    """Usage errors in two lines, the error and where the usage is, as the client commands'
    own usage errors are (argparse prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(
            f"{self.prog}: error: {message}\nSee '{self.prog} --help' for the usage.",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE)


def _parameters_of(kind: str) -> dict[str, FieldDescriptor | None]:
    """What ``--param`` takes for ``kind``: its fields, its oneofs (None: a name), and the
    fields of each oneof's messages."""
    message = kind_message(kind)
    known: dict[str, FieldDescriptor | None] = {f.name: f for f in parameter_fields(message)}
    for oneof in choice_oneofs(message):
        known[oneof.name] = None
        for case in cases(oneof).values():
            assert case.message_type is not None
            known.update((f.name, f) for f in case.message_type.fields)
    return known


def _add_table_arguments(fetch: argparse.ArgumentParser) -> None:
    """The table flags of ``fetch``, from the descriptors of the table kinds."""
    table = fetch.add_argument_group(
        "table",
        "The classic sinusoidal table by default, whose fields are the flags below;\n"
        "any other kind with --table KIND and --param NAME=VALUE (posenc info lists them).",
    )
    table.add_argument(
        "--table",
        choices=kind_names(),
        default=None,
        metavar="KIND",
        help=f"the table kind: {', '.join(kind_names())} (default: {_CLASSIC_KIND})",
    )
    for field in parameter_fields(kind_message(_CLASSIC_KIND)):
        options: dict[str, Any] = {"default": None, "help": f"the table's {field.name}"}
        if field.cpp_type == FieldDescriptor.CPPTYPE_ENUM:
            assert field.enum_type is not None
            options["choices"] = tuple(enum_names(field.enum_type))
            options["help"] += f" (default: {options['choices'][0]})"
        else:
            options["type"] = _FlagValue(field)
            options["metavar"] = "N" if field.cpp_type in _INTEGERS else "X"
            if field.has_presence:
                options["help"] += " (default: the server's)"
        table.add_argument(_flag(field), dest=f"classic_{field.name}", **options)
    table.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a parameter of the --table kind, e.g. padding_idx=1, scaling=yarn, factor=8.0, "
        "short_factor=1.0,1.1,... (repeatable)",
    )
    table.add_argument(
        "--rope-config",
        type=Path,
        metavar="CONFIG_JSON",
        help="a transformers config.json: its rotary table (implies --table rotary; "
        "--param values override the config's)",
    )
    table.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=DTYPE_NAMES[0],
        help=f"element type (default: {DTYPE_NAMES[0]})",
    )


def _usage_error(message: str, command: str = "fetch") -> SystemExit:
    """A usage error, reported as argparse reports them."""
    print(f"posenc {command}: error: {message}", file=sys.stderr)
    return SystemExit(EXIT_USAGE)


def _table_given(args: argparse.Namespace) -> bool:
    """Whether any table flag was given (``plot`` has a default table per figure)."""
    classic = parameter_fields(kind_message(_CLASSIC_KIND))
    return (
        args.table is not None
        or args.rope_config is not None
        or bool(args.param)
        or any(getattr(args, f"classic_{field.name}") is not None for field in classic)
    )


def _table(args: argparse.Namespace) -> Spec:
    """The table of a fetch (or plot): --table, the classic flags, --param, --rope-config."""
    kind = args.table or ("rotary" if args.rope_config is not None else _CLASSIC_KIND)
    if args.rope_config is not None and kind != "rotary":
        raise _usage_error("--rope-config goes with --table rotary", args.command)
    known = _parameters_of(kind)
    values: dict[str, object] = {}
    for field in parameter_fields(kind_message(_CLASSIC_KIND)):
        value = getattr(args, f"classic_{field.name}")
        if value is None:
            continue
        if field.name not in known:
            raise _usage_error(f"{_flag(field)} does not apply to --table {kind}", args.command)
        values[field.name] = value
    for item in args.param:
        name, sep, text = item.partition("=")
        if not sep or name not in known:
            raise _usage_error(
                f"--param {item!r}: expected NAME=VALUE with NAME one of {', '.join(known)}",
                args.command,
            )
        parameter = known[name]
        values[name] = text if parameter is None else _parse_value(parameter, text)
    if args.rope_config is not None:
        config = json.loads(args.rope_config.read_text())
        # No --param layout: the family's own (GPT-J's is "gptj"), as Spec.from_config reads it.
        layout = values.get("layout")
        spec = Spec.from_config(config, layout=None if layout is None else str(layout))
        return Spec(spec.kind, **{**spec.parameters, **values})
    if kind == _CLASSIC_KIND and "d_model" not in values:
        raise _usage_error("--d-model is required (or another --table)", args.command)
    return Spec(kind, **values)


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

    commands.add_parser(
        "serve",
        help="run a server (needs the [server] extra; `posenc serve --help` for its flags)",
        add_help=False,
    )

    fetch = commands.add_parser(
        "fetch",
        help="stream a table into a .npy or .safetensors file",
        description="Stream the rows of positions [START, STOP) of a table into a .npy or "
        ".safetensors file.",
        epilog=_FETCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fetch.add_argument(
        "start", type=_position, nargs="?", metavar="START", help="first position (1e6, 2**20)"
    )
    fetch.add_argument(
        "stop", type=_position, nargs="?", metavar="STOP", help="end position, excluded"
    )
    fetch.add_argument(
        "--positions-file",
        type=Path,
        metavar="FILE",
        help="fetch these positions instead of a range: a .npy integer array, or text "
        "with one integer per line",
    )
    _add_table_arguments(fetch)
    fetch.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        help=f"the file to write; its suffix chooses the format: {', '.join(_FORMATS)}",
    )
    fetch.add_argument(
        "--chunk-bytes",
        type=_size,
        metavar="BYTES",
        help="stream chunk size: 262144, 256KiB, 1MiB (the server's default)",
    )
    fetch.add_argument(
        "--no-progress", action="store_true", help="no progress bar (shown on a terminal)"
    )
    _add_client_arguments(fetch, timeout=None)
    fetch.add_argument(
        "--connect-timeout",
        type=_positive_float,
        default=_CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="how long the server may take to answer at all, before any row (default: "
        f"{_CONNECT_TIMEOUT:g}): a port that accepts connections and never answers fails "
        "after this, while --timeout bounds the whole table",
    )

    plot = commands.add_parser(
        "plot",
        help="draw a figure of the tables into a .png or .svg (needs the [plot] extra)",
        description="Draw figure KIND of a table, from a server's rows, into a .png or .svg.",
        epilog=_PLOT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plot.add_argument("kind", choices=tuple(FIGURES), metavar="KIND", help=", ".join(FIGURES))
    _add_table_arguments(plot)
    plot.add_argument(
        "--bases",
        type=_bases,
        default=list(BASES),
        metavar="B1,B2,...",
        help="the bases of similarity and wavelength (default: "
        + ",".join(f"{base:g}" for base in BASES)
        + ")",
    )
    plot.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        help=f"the file to write; its suffix chooses the format: {', '.join(_PLOT_FORMATS)}",
    )
    _add_client_arguments(plot, timeout=120.0)

    info = commands.add_parser("info", help="describe the server: version, limits, cache")
    info.add_argument("--json", action="store_true", help="print JSON")
    _add_client_arguments(info, timeout=10.0)

    health = commands.add_parser(
        "health",
        help="check health: exit 0 when SERVING, 1 otherwise",
        description="Print the grpc.health.v1 status; exit 0 when SERVING, 1 otherwise "
        "(NOT_SERVING, unreachable, timeout). With several --target, checks each one. "
        f"Without TLS flags, when ${_SERVER_CERT_ENV} is set (the probe runs next to a TLS "
        "server, with its environment), it connects with TLS trusting that certificate, "
        f"under the name it carries, and presents it as its own when ${_SERVER_CLIENT_CA_ENV} "
        "is set (mutual TLS).",
    )
    health.add_argument("--service", default="", help='service name (default "": the server)')
    health.add_argument(
        "--http",
        nargs="?",
        const="",
        metavar="URL",
        help="ask the metrics port's /healthz over HTTP instead (200 SERVING, 503 NOT_SERVING), "
        "which answers whatever holds the gRPC port's connections (NOT_SERVING when they "
        "leave no room for a new call; /livez: SERVING all the same); URL defaults to "
        f"http://127.0.0.1:${_SERVER_METRICS_PORT_ENV}/healthz ({_DEFAULT_METRICS_PORT} when "
        "unset): the server's own metrics port where the probe runs beside it",
    )
    _add_client_arguments(health, timeout=2.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``posenc`` command line; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "serve":
        # The server parses its own flags: hand them over untouched.
        return _serve(args_list[1:])
    args = _build_parser().parse_args(args_list)
    if argv is None:
        _quiet_grpc_core()
    handler = {"fetch": _fetch, "plot": _plot, "info": _info, "health": _health}[args.command]
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


def _explain(error: Exception, args: argparse.Namespace) -> str:
    """The line a failure is reported with. A parameter the user never set reaches the
    server as 0 (proto3 sends no "unset"), and its refusal says "got 0": said here as not
    set, with the flag that sets it."""
    if not isinstance(error, InvalidArgumentError) or not error.field_violations:
        return str(error)
    given = _given_parameters(args)
    parts = []
    for field, description in error.field_violations:
        name = field.rpartition(".")[2]
        unset = re.search(r",? got 0(\.0)?( \(or not set\))?$", description)
        if unset is not None and name not in given and field.startswith("spec."):
            flag = f"--param {name}=VALUE"
            if args.command in ("fetch", "plot") and name in _classic_names():
                flag = _flag_of(name)
            description = f"not set ({description[: unset.start()]}): give it with {flag}"
        parts.append(f"{field}: {description}")
    return f"{error.code.name}: {'; '.join(parts)}"


def _classic_names() -> set[str]:
    return {field.name for field in parameter_fields(kind_message(_CLASSIC_KIND))}


def _flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given_parameters(args: argparse.Namespace) -> set[str]:
    """The table parameters the command line set (flags, --param, --rope-config's)."""
    given = {item.partition("=")[0] for item in getattr(args, "param", None) or ()}
    given |= {
        name for name in _classic_names() if getattr(args, f"classic_{name}", None) is not None
    }
    if getattr(args, "rope_config", None) is not None:
        with contextlib.suppress(Exception, SystemExit):  # read before, so it reads
            given |= set(_table(args).parameters)
    return given


def _serve(argv: list[str]) -> int:
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


def _install_command(extra: str) -> str:
    """The pip command that adds ``extra`` the way posenc itself was installed."""
    try:
        direct_url = metadata.distribution("posenc").read_text("direct_url.json")
        origin = json.loads(direct_url or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        origin = {}
    url = str(origin.get("url", ""))
    if url.startswith("file://") and "dir_info" in origin:  # from a checkout
        path = url.removeprefix("file://")
        editable = "-e " if origin["dir_info"].get("editable") else ""
        return f"pip install {editable}'{path}[{extra}]'"
    return f"pip install 'posenc[{extra}]'"


# -- fetch ------------------------------------------------------------------------------


def _load_positions(path: Path, axes: int) -> npt.NDArray[np.int64]:
    """A positions file's rows: ``[n]`` positions, or ``[n, axes]`` coordinates for a kind of
    several position axes (text: a row's coordinates on one line)."""
    if path.suffix == ".npy":
        data = np.load(path, allow_pickle=False)
    else:
        data = np.loadtxt(path, dtype=np.int64, ndmin=2 if axes > 1 else 1)
    if axes == 1:
        return as_positions(data)
    if data.ndim != 2 or data.shape[1] != axes:
        raise ValueError(
            f"{path}: a table of {axes} position axes takes [rows, {axes}] coordinates, "
            f"got shape {list(data.shape)}"
        )
    return np.stack([as_positions(column) for column in data.T], axis=1)


def _human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if size < 1024 or unit == "EiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError("unreachable")


def _check_output(
    output: Path, formats: Sequence[str] | None = None, command: str = "fetch"
) -> None:
    """Refuse an output that cannot be written before anything is fetched."""
    formats = tuple(_FORMATS) if formats is None else formats
    if output.is_dir():
        raise _usage_error(f"-o {output} is a directory: give a file name in it", command)
    if output.suffix not in formats:
        raise _usage_error(
            f"-o {output}: unknown format {output.suffix or '(no suffix)'!r}; "
            f"the suffix chooses it: {', '.join(formats)}",
            command,
        )
    parent = output.parent
    if not parent.is_dir():
        raise _usage_error(f"-o {output}: directory {parent} does not exist", command)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _usage_error(f"-o {output}: directory {parent} is not writable", command)


def _fetch(args: argparse.Namespace) -> int:
    table = _table(args)
    _check_output(args.output)
    options: dict[str, Any] = {"dtype": args.dtype, "chunk_bytes": args.chunk_bytes}
    with _client(args, _targets(args)) as client:
        # Slices arrive labelled by position (range) or by index (list): `origin` maps
        # either to the row of the output array.
        slices: Iterator[tuple[int, npt.NDArray[Any]]]
        if args.positions_file is not None:
            if args.start is not None:
                raise _usage_error("give either START STOP or --positions-file, not both")
            positions = _load_positions(args.positions_file, position_axes(table.kind))
            rows, origin = len(positions), 0
            slices = client.iter_positions(positions, table, **options)
        elif args.start is None and args.stop is None and table.grid_shape is not None:
            # A grid kind without a range: the whole grid, written with its shape.
            grid = table.grid_shape
            rows, origin = math.prod(grid), 0
            slices = client.iter_grid(table, **options)
        else:
            if args.start is None or args.stop is None:
                raise _usage_error("START and STOP are required (or --positions-file)")
            rows, origin = args.stop - args.start, args.start
            slices = client.iter_range(args.start, args.stop, table, **options)
        # A server that does not answer at all is given --connect-timeout, not --timeout
        # (none by default: a table may take hours).
        connect = args.connect_timeout
        _first_answer(client, args, connect if args.timeout is None else min(connect, args.timeout))
        # The first slice carries the server's verdict on the request (limits, bad
        # arguments) and the table's width: have it before creating a file of that size.
        first = next(slices, None)
        if first is None:  # an empty table: ask for its width
            width = client.get_range(origin, origin, table, dtype=args.dtype).shape[1]
        else:
            width = first[1].shape[1]
            slices = itertools.chain([first], slices)
        dtype = named_dtype(args.dtype)
        # A table past the server's stream limit travels in several streams, so only the
        # disk bounds what fetch can write: check it before the file is made.
        needed, free = rows * width * dtype.itemsize, shutil.disk_usage(args.output.parent).free
        if needed > free:
            raise OSError(
                f"cannot write {args.output}: the table takes {_human_bytes(needed)}, "
                f"and {args.output.parent} has {_human_bytes(free)} free"
            )
        grid_shape = table.grid_shape if args.start is None and not args.positions_file else None
        file_shape = None if grid_shape is None else (*grid_shape, width)
        _write(
            args.output, slices, (rows, width), dtype, table, origin, args.no_progress, file_shape
        )
    return EXIT_OK


def _npy(shape: tuple[int, ...], dtype: np.dtype[Any], spec: Spec) -> bytes:
    """The header of a .npy file holding an array of ``shape`` (what ``numpy.save`` writes
    before the data)."""
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": shape,
    }
    buffer = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:  # a header over 64 KiB: format 2.0
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


# safetensors names of the dtypes (bfloat16 is native there, unlike in .npy).
_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def _safetensors(shape: tuple[int, ...], dtype: np.dtype[Any], spec: Spec) -> bytes:
    """The header of a safetensors file holding one tensor ``table`` of ``shape``.

    The format is an 8-byte little-endian header length, a JSON header (padded with spaces
    to 8-byte alignment) and the raw little-endian bytes: written here directly, so that a
    table of any size streams into the file instead of being built in memory first.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    header = {
        "__metadata__": {"posenc.spec": json.dumps({"kind": spec.kind, **spec.parameters})},
        "table": {
            "dtype": _SAFETENSORS_DTYPES[dtype.name],
            "shape": list(shape),
            "data_offsets": [0, nbytes],
        },
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


_FORMATS = {".npy": _npy, ".safetensors": _safetensors}
"""Output formats by file suffix: the header written before the rows."""


def _seconds(elapsed: float) -> str:
    return f"{elapsed:.1f} s" if elapsed >= 1 else f"{elapsed * 1e3:.0f} ms"


# The longest file name most file systems take, in bytes.
_NAME_MAX = 255


def _partial_name(output: Path) -> Path:
    """The hidden name beside ``output`` that a table is written under until it is complete:
    within the file system's name limit whatever the length of ``output``'s own name."""
    suffix = f".{os.getpid()}.partial"
    room = _NAME_MAX - 1 - len(suffix)
    stem = os.fsencode(output.name)[:room].decode(errors="ignore")
    return output.with_name(f".{stem}{suffix}")


class _Partial:
    """The file a table is written into before it becomes ``output``.

    Where the file system has them (Linux: ext4, xfs, btrfs, tmpfs), an unnamed file in
    ``output``'s directory (``O_TMPFILE``), which the system removes whatever ends the
    process (SIGKILL included), given its name only when complete; elsewhere a hidden named
    file, removed on any error or signal this process sees.
    """

    def __init__(self, output: Path) -> None:
        self.output = output
        self.named: Path | None = None
        flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
        tmpfile = getattr(os, "O_TMPFILE", 0)
        fd = -1
        if tmpfile and os.path.isdir("/proc/self/fd"):  # where commit() links it from
            with contextlib.suppress(OSError):  # not supported there: a named file
                fd = os.open(output.parent, flags | tmpfile, 0o666)
        if fd < 0:
            self.named = _partial_name(output)
            fd = os.open(self.named, flags | os.O_CREAT | os.O_EXCL, 0o666)
        self.fd = fd

    def reserve(self, size: int) -> None:
        """Allocates ``size`` bytes on the disk now: a disk too full to hold the table fails
        here, before anything is fetched, and no other writer can take the space after."""
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(self.fd, size)  # a file system without allocation: writes tell

    def write(self, offset: int, data: memoryview) -> None:
        """Writes all of ``data`` at ``offset`` (a full disk: OSError, never a signal)."""
        while data:
            written = os.pwrite(self.fd, data, offset)
            data, offset = data[written:], offset + written

    def commit(self) -> None:
        """Makes the complete file ``output`` (replacing any file of that name)."""
        os.fsync(self.fd)
        if self.named is None:
            # An unnamed file gets a name by a link to it, then takes the output's by rename.
            # linkat(2) follows /proc/self/fd/N to the file only when asked to, which os.link
            # does only with a directory descriptor given.
            self.named = _partial_name(self.output)
            descriptors = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.link(str(self.fd), self.named, src_dir_fd=descriptors, follow_symlinks=True)
            finally:
                os.close(descriptors)
        os.replace(self.named, self.output)
        self.named = None

    def discard(self) -> None:
        """Closes the file, and removes it unless it became ``output``."""
        with contextlib.suppress(OSError):
            os.close(self.fd)
        if self.named is not None:
            with contextlib.suppress(OSError):
                self.named.unlink()


class _Terminated(Exception):
    """SIGTERM or SIGHUP arrived: the fetch stops, and its partial file is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _stop_on_termination() -> Iterator[None]:
    """SIGTERM and SIGHUP end the fetch as Ctrl-C does, through its clean-up, instead of
    killing the process where it stands."""

    def stop(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _write(
    output: Path,
    slices: Iterator[tuple[int, npt.NDArray[Any]]],
    shape: tuple[int, int],
    dtype: np.dtype[Any],
    spec: Spec,
    origin: int,
    no_progress: bool,
    file_shape: tuple[int, ...] | None = None,
) -> None:
    """Write the table into a file beside ``output`` that becomes it when complete
    (``file_shape``: the array's shape in the file, a grid's ``[*grid_shape, width]``; rows
    are written as ``shape`` either way). On any failure, a full disk included, nothing is
    left behind and the error is an OSError naming ``output``."""
    started = time.monotonic()
    row_bytes = shape[1] * dtype.itemsize
    partial: _Partial | None = None
    try:
        with _stop_on_termination():
            partial = _Partial(output)
            header = _FORMATS[output.suffix](file_shape or shape, dtype, spec)
            partial.reserve(len(header) + shape[0] * row_bytes)
            partial.write(0, memoryview(header))
            with tqdm(
                total=shape[0],
                unit="row",
                unit_scale=True,
                dynamic_ncols=True,
                file=sys.stderr,
                disable=no_progress or not sys.stderr.isatty(),
            ) as bar:
                for label, rows in slices:
                    first = label - origin
                    data = np.ascontiguousarray(rows, dtype=dtype).view(np.uint8).reshape(-1)
                    partial.write(len(header) + first * row_bytes, data.data)
                    bar.update(len(rows))
                    bar.set_postfix_str(_human_bytes(bar.n * row_bytes), refresh=False)
                # Writing the file's pages out can take seconds after the last row: the bar
                # says so, and its clock runs until it is done.
                bar.set_postfix_str(f"{_human_bytes(bar.n * row_bytes)}, writing to disk")
                partial.commit()
    except OSError as error:
        if isinstance(error, PosencError):
            raise  # the server's failure (UNAVAILABLE is a ConnectionError), not the file's
        # Name the user's file, not the hidden one beside it.
        raise OSError(f"cannot write {output}: {error.strerror or error}") from None
    finally:
        if partial is not None:
            partial.discard()
    elapsed = max(time.monotonic() - started, 1e-9)
    size = shape[0] * row_bytes
    print(
        f"posenc fetch: wrote {shape[0]:,} x {shape[1]} {dtype.name} rows "
        f"({_human_bytes(size)}) to {output} in {_seconds(elapsed)} "
        f"({shape[0] / elapsed:,.0f} rows/s, {_human_bytes(size / elapsed)}/s)",
        file=sys.stderr,
    )


# -- plot -------------------------------------------------------------------------------

_PLOT_FORMATS = (".png", ".svg")

_PLOT_EPILOG = """\
Figures (posenc.plot has the functions that return each figure's data):
  drift         largest error per position, 1 to 2**42: posenc's --dtype table, the naive
                float32 position * div_term table and, for rotary tables with transformers
                installed, LlamaRotaryEmbedding's, against exact values (mpmath)
                (default: --d-model 512; also --table tensor2tensor, whisper, fairseq with
                an even --d-model, and --table rotary without scaling)
  rope-scaling  inverse frequency per index of default, linear, dynamic, yarn, llama3 and
                longrope scalings of a rotary table (default: head_dim 128, theta 500000)
  heatmap       rows [0, 256) of the table and each row's distance to its nearest other
  rotation      max |PE(p + k) - R(k) PE(p)| over p, R(k) from the row at position k
  similarity    cosine similarity of PE(p) and PE(p + k) against k, for --bases
  wavelength    2 pi / inv_freq per pair of columns, for --bases
The sinusoidal figures take the classic table's --d-model (default 128) and --base.
"""


def _plot(args: argparse.Namespace) -> int:
    spec = _table(args) if _table_given(args) else default_spec(args.kind)
    _check_output(args.output, _PLOT_FORMATS, "plot")
    try:  # the [plot] extra, checked before connecting
        import matplotlib  # noqa: F401
        import mpmath  # noqa: F401
    except ImportError as error:
        print(
            f"posenc plot: needs the module {error.name}, which is not installed.\n"
            f"Install it with: {_install_command('plot')}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    with _client(args, _targets(args)) as client:
        _first_answer(client, args, args.timeout)
        drawn = figure(args.kind, client, spec, bases=args.bases, dtype=args.dtype)
    render(drawn, args.output)
    print(f"posenc plot: wrote {args.kind} of {spec!r} to {args.output}", file=sys.stderr)
    return EXIT_OK


# -- info, health -----------------------------------------------------------------------


def _info(args: argparse.Namespace) -> int:
    with _client(args, _targets(args)) as client:
        info = _first_answer(client, args, args.timeout)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return EXIT_OK
    print(f"version:       {info.version}")
    print(f"server_id:     {info.server_id}")
    print(f"dtypes:        {', '.join(info.dtypes)}")
    # Named as fetch takes them: --table KIND, and a variant of a kind (rotary.yarn) with
    # --param ONEOF=NAME (scaling=yarn).
    names = [kind.name for kind in info.table_kinds]
    print(f"table kinds:   {', '.join(n for n in names if '.' not in n)} (fetch --table KIND)")
    for kind in dict.fromkeys(n.partition(".")[0] for n in names if "." in n):
        variants = [n.partition(".")[2] for n in names if n.startswith(kind + ".")]
        with contextlib.suppress(PosencError):
            for oneof in choice_oneofs(kind_message(kind)):
                print(
                    f"  {kind} {oneof.name}: {', '.join(variants)} "
                    f"(--table {kind} --param {oneof.name}=NAME)"
                )
    print(f"rows_computed: {info.rows_computed:,}")
    for title, section in (("limits", info.limits), ("cache", info.cache)):
        print(f"{title}:")
        for name, value in vars(section).items():
            print(f"  {name + ':':<27}{value:,}")
    _print_parameters(info.table_kinds)
    return EXIT_OK


def _print_parameters(kinds: Sequence[TableKind]) -> None:
    """Each kind's parameters, named as ``fetch --param`` takes them, with their defaults
    (none: required) and meaning."""
    print("parameters:   (fetch --table KIND --param NAME=VALUE; no default: required)")
    for kind in kinds:
        print(f"  {kind.name}: {kind.description}")
        for parameter in kind.parameters:
            name = parameter.field.rpartition(".")[2]
            default = f"= {parameter.default}" if parameter.default else "(required)"
            print(f"    {name:<33} {default:<14} {parameter.description}")


# The server's TLS settings (posenc_server.config): `posenc health` runs where the server
# runs (`podman exec`, a Kubernetes exec probe), with the server's environment, so a TLS
# server's probe speaks TLS without flags of its own.
_SERVER_CERT_ENV = "POSENC_TLS_CERT_FILE"
_SERVER_KEY_ENV = "POSENC_TLS_KEY_FILE"
_SERVER_CLIENT_CA_ENV = "POSENC_TLS_CLIENT_CA_FILE"
# And its metrics port (posenc_server.config), where /healthz answers (posenc_server.metrics).
_SERVER_METRICS_PORT_ENV = "POSENC_METRICS_PORT"
_DEFAULT_METRICS_PORT = 9464
_HEALTH_PATH = "/healthz"
# /healthz's body is one word; more is not read.
_HEALTH_BODY_BYTES = 64


def _certificate_name(path: str) -> str | None:
    """The first DNS name (else the common name) of the first certificate in ``path``."""
    try:
        # The standard library's own certificate decoder (what SSLSocket.getpeercert()
        # returns), which it exposes under this name only; no X.509 dependency needed.
        decoded = _ssl._test_decode_cert(path)  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):  # AttributeError: a Python without it
        return None
    for kind, value in decoded.get("subjectAltName", ()):
        if kind == "DNS":
            return str(value)
    for rdn in decoded.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def _probe_tls_from_server_environment(args: argparse.Namespace) -> None:
    """Without TLS flags, next to a TLS server (``POSENC_TLS_CERT_FILE``): trust exactly the
    certificate the server serves, under the name it carries, and under mutual TLS
    (``POSENC_TLS_CLIENT_CA_FILE``) present that certificate and key as the client's."""
    cert = os.environ.get(_SERVER_CERT_ENV)
    if not cert or args.tls_ca or args.tls_cert:
        return
    args.tls_ca = cert
    if os.environ.get(_SERVER_CLIENT_CA_ENV):
        args.tls_cert, args.tls_key = cert, os.environ.get(_SERVER_KEY_ENV)
    if not args.tls_server_name:
        args.tls_server_name = _certificate_name(cert)


def _health(args: argparse.Namespace) -> int:
    if args.http is not None:
        if args.target or args.service:
            print("posenc health: --http asks a URL: no --target or --service", file=sys.stderr)
            return EXIT_USAGE
        url = args.http or _default_health_url()
        if url is None:
            return EXIT_USAGE
        return _http_health(url, args.timeout)
    _probe_tls_from_server_environment(args)
    targets = _targets(args)
    healthy = True
    for target in targets:
        # A probe reports the present: no retries, and a short deadline.
        with _client(args, [target], max_retries=0) as client:
            try:
                status = client.health(args.service)
            except PosencError as error:
                status = "UNREACHABLE"
                print(f"posenc health: {target}: {error}", file=sys.stderr)
        healthy = healthy and status == "SERVING"
        print(status if len(targets) == 1 else f"{target}: {status}")
    return EXIT_OK if healthy else EXIT_FAILURE


def _default_health_url() -> str | None:
    """/healthz of ``$POSENC_METRICS_PORT`` (9464 unset) on 127.0.0.1, or None (said why)
    when that is not a port to probe: 0 (a port the server picks) or -1 (metrics off)."""
    value = os.environ.get(_SERVER_METRICS_PORT_ENV) or str(_DEFAULT_METRICS_PORT)
    if not value.isdecimal() or not 1 <= int(value) <= 65535:
        print(
            f"posenc health: {_SERVER_METRICS_PORT_ENV}={value[:32]!r} is no port to probe "
            "(/healthz needs the metrics port on, at a fixed port): give --http URL",
            file=sys.stderr,
        )
        return None
    return f"http://127.0.0.1:{int(value)}{_HEALTH_PATH}"


class _EveryStatus(urllib.request.HTTPErrorProcessor):
    """A probe reports the answer it got, whatever its status: no error is raised for a
    503 or a 404, and no redirect is followed (a redirect is an answer: ``HTTP 302``)."""

    def http_response(self, request: Any, response: Any) -> Any:
        return response

    https_response = http_response


# /healthz's answers (posenc_server.metrics); any other is printed as its HTTP status.
_HEALTH_WORDS = frozenset({"SERVING", "NOT_SERVING"})


def _http_health(url: str, timeout: float) -> int:
    """``posenc health --http``: GET ``url``; prints its status word (UNREACHABLE when there
    is no HTTP answer) and exits 0 on 200 SERVING alone."""
    if not url.startswith(("http://", "https://")):
        print(
            f"posenc health: --http takes an http:// or https:// URL: {url[:64]!r}", file=sys.stderr
        )
        return EXIT_USAGE
    # Straight to the URL: a proxy from the environment has no business with a local probe.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _EveryStatus())
    try:
        with opener.open(url, timeout=timeout) as response:
            code, body = response.status, response.read(_HEALTH_BODY_BYTES)
    except http.client.HTTPException as error:  # such as the gRPC port's HTTP/2 frames
        reason: object = f"no HTTP/1.x answer ({type(error).__name__})"  # not its bytes
    except (OSError, ValueError) as error:  # refused, timed out, a malformed URL
        reason = getattr(error, "reason", None) or error
    else:
        words = body.decode("ascii", "replace").split()
        status = words[0] if words and words[0] in _HEALTH_WORDS else f"HTTP {code}"
        print(status)
        return EXIT_OK if (code, status) == (200, "SERVING") else EXIT_FAILURE
    print(f"posenc health: {url}: {reason}", file=sys.stderr)
    print("UNREACHABLE")
    return EXIT_FAILURE
