"""The ``posenc`` command: ``serve``, ``fetch``, ``info`` and ``health``.

Client subcommands print SDK failures as one line on stderr and exit non-zero, never with a
traceback: they run in scripts, cron jobs and container health checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from numpy.lib.format import open_memmap
from tqdm import tqdm

from posenc import _protocol as proto
from posenc._client import Client
from posenc._protocol import DTYPE_NAMES, LAYOUT_NAMES, SCHEDULE_NAMES
from posenc.errors import PosencError
from posenc.presets import SINUSOIDAL_PRESETS, RotaryPreset, SinusoidalPreset

__all__ = ["main"]

# Exit codes. Docker reserves 2 for health checks, so every failure of a client command
# exits 1 (argparse's usage errors keep their conventional 2).
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_TARGET_ENV = "POSENC_TARGET"
_TOKEN_FILE_ENV = "POSENC_TOKEN_FILE"

_FETCH_EPILOG = f"""\
The table is written to a temporary file next to OUTPUT and renamed to OUTPUT when
complete, so OUTPUT is never a partial table. Memory stays at about one chunk, whatever
the size of the table; an interrupted stream (server restart) resumes where it stopped.

Read it back with numpy.load(OUTPUT) (mmap_mode="r" for large tables). bfloat16 tables
hold ml_dtypes.bfloat16 values, but the .npy format has no bfloat16 type: the header
says '<V2' (2-byte void) and numpy.load returns dtype |V2. View them as bfloat16 with
numpy.load(OUTPUT).view(ml_dtypes.bfloat16).

Targets: --target may be repeated (calls are balanced round robin); the default is
${_TARGET_ENV} (comma-separated host:port list) or {proto.DEFAULT_TARGET}.
"""


def _targets(args: argparse.Namespace) -> list[str]:
    given: list[str] = args.target or [os.environ.get(_TARGET_ENV) or proto.DEFAULT_TARGET]
    # "a:1,b:2" is a list of replicas, unless it is a gRPC URI (ipv4:a:1,b:2 has commas too).
    targets: list[str] = []
    for value in given:
        if proto.is_uri(value):
            targets.append(value)
        else:
            targets.extend(part.strip() for part in value.split(",") if part.strip())
    return targets


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_client_arguments(parser: argparse.ArgumentParser, timeout: float | None) -> None:
    parser.add_argument(
        "--target",
        action="append",
        metavar="HOST:PORT",
        help=f"server address; repeat for round robin over replicas "
        f"(default: ${_TARGET_ENV} or {proto.DEFAULT_TARGET})",
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
    return Client(targets, timeout=args.timeout, token=token, credentials=credentials, **settings)


def _build_parser() -> argparse.ArgumentParser:
    from posenc import __version__

    parser = argparse.ArgumentParser(
        prog="posenc",
        description="Exact sinusoidal positional-encoding tables from a posenc gRPC server.",
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
        help="stream a table into a .npy file",
        description="Stream the rows of positions [START, STOP) into a .npy file.",
        epilog=_FETCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fetch.add_argument("start", type=int, nargs="?", metavar="START", help="first position")
    fetch.add_argument("stop", type=int, nargs="?", metavar="STOP", help="end position (excl.)")
    fetch.add_argument(
        "--positions-file",
        type=Path,
        metavar="FILE",
        help="fetch these positions instead of a range: a .npy integer array, or text "
        "with one integer per line",
    )
    fetch.add_argument(
        "--d-model", type=int, metavar="N", help="row width (a rotary preset sets its own)"
    )
    fetch.add_argument("--base", type=float, default=10000.0, help="frequency base (10000)")
    fetch.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    fetch.add_argument("--layout", choices=LAYOUT_NAMES, default="interleaved")
    fetch.add_argument("--schedule", choices=SCHEDULE_NAMES, default="paper")
    fetch.add_argument(
        "--preset",
        choices=(*SINUSOIDAL_PRESETS, "rotary"),
        help="a model family's table (README: Presets); 'rotary' takes --preset-param "
        "head_dim=... rope_type=... or --rope-config",
    )
    fetch.add_argument(
        "--preset-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a preset parameter, e.g. padding_idx=1, factor=8.0, short_factor=1.0,1.1,... "
        "(repeatable)",
    )
    fetch.add_argument(
        "--rope-config",
        type=Path,
        metavar="CONFIG_JSON",
        help="a transformers config.json: its rotary preset (implies --preset rotary)",
    )
    fetch.add_argument("-o", "--output", type=Path, required=True, help="the .npy file to write")
    fetch.add_argument(
        "--chunk-bytes", type=int, metavar="BYTES", help="stream chunk size (server default)"
    )
    fetch.add_argument(
        "--no-progress", action="store_true", help="no progress bar (shown on a terminal)"
    )
    _add_client_arguments(fetch, timeout=None)

    info = commands.add_parser("info", help="describe the server: version, limits, cache")
    info.add_argument("--json", action="store_true", help="print JSON")
    _add_client_arguments(info, timeout=10.0)

    health = commands.add_parser(
        "health",
        help="check health: exit 0 when SERVING, 1 otherwise",
        description="Print the grpc.health.v1 status; exit 0 when SERVING, 1 otherwise "
        "(NOT_SERVING, unreachable, timeout). With several --target, checks each one.",
    )
    health.add_argument("--service", default="", help='service name (default "": the server)')
    _add_client_arguments(health, timeout=2.0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``posenc`` command line; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "serve":
        # The server parses its own flags: hand them over untouched.
        return _serve(args_list[1:])
    args = _build_parser().parse_args(args_list)
    handler = {"fetch": _fetch, "info": _info, "health": _health}[args.command]
    try:
        return handler(args)
    except (PosencError, ValueError, OSError) as error:  # ValueError: a bad --target, for one
        print(f"posenc {args.command}: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"posenc {args.command}: interrupted", file=sys.stderr)
        return 130
    return EXIT_FAILURE


def _serve(argv: list[str]) -> int:
    try:
        from posenc_server.app import run
    except ImportError as error:
        print(
            f"posenc serve: the server is not installed ({error}).\n"
            "Install it with: pip install 'posenc[server]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return run(argv)


# -- fetch ------------------------------------------------------------------------------


def _load_positions(path: Path) -> npt.NDArray[np.int64]:
    if path.suffix == ".npy":
        data = np.load(path, allow_pickle=False)
    else:
        data = np.loadtxt(path, dtype=np.int64, ndmin=1)
    return proto.as_positions(data)


def _human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError("unreachable")


def _preset_value(field: dataclasses.Field[Any], text: str) -> Any:
    kind = str(field.type)
    if "Sequence" in kind:
        return [float(part) for part in text.split(",") if part.strip()]
    if "bool" in kind:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{field.name} must be true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if "int" in kind:
        return int(text)
    if "float" in kind:
        return float(text)
    return text


def _preset(args: argparse.Namespace) -> SinusoidalPreset | RotaryPreset | None:
    """The --preset, --preset-param and --rope-config of a fetch."""
    name = "rotary" if args.rope_config is not None else args.preset
    if name is None:
        if args.preset_param:
            raise ValueError("--preset-param needs --preset")
        return None
    cls: type[SinusoidalPreset] | type[RotaryPreset]
    cls = RotaryPreset if name == "rotary" else SinusoidalPreset
    known = {field.name: field for field in dataclasses.fields(cls) if field.name != "name"}
    values: dict[str, Any] = {}
    for item in args.preset_param:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            raise ValueError(
                f"--preset-param {item!r}: expected KEY=VALUE with KEY one of {', '.join(known)}"
            )
        values[key] = _preset_value(known[key], text)
    if name != "rotary":
        return SinusoidalPreset(name, **values)
    if args.rope_config is None:
        if "head_dim" not in values:
            raise ValueError("--preset rotary needs --preset-param head_dim=N (or --rope-config)")
        return RotaryPreset(**values)
    config = json.loads(args.rope_config.read_text())
    preset = RotaryPreset.from_config(config, layout=values.pop("layout", "transformers"))
    return dataclasses.replace(preset, **values)


def _fetch(args: argparse.Namespace) -> int:
    preset = _preset(args)
    if isinstance(preset, RotaryPreset):
        args.d_model = args.d_model or preset.width
    elif args.d_model is None:
        # A usage error, as argparse reports them.
        print(
            "posenc fetch: error: --d-model is required (except with a rotary preset)",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE)
    spec: dict[str, Any] = {
        "base": args.base,
        "dtype": args.dtype,
        "layout": args.layout,
        "schedule": args.schedule,
        "chunk_bytes": args.chunk_bytes,
        "preset": preset,
    }
    with _client(args, _targets(args)) as client:
        # Slices arrive labelled by position (range) or by index (list): `origin` maps
        # either to the row of the output array.
        slices: Iterator[tuple[int, npt.NDArray[Any]]]
        if args.positions_file is not None:
            if args.start is not None:
                raise ValueError("give either START STOP or --positions-file, not both")
            positions = _load_positions(args.positions_file)
            rows, origin = len(positions), 0
            slices = client.iter_positions(positions, args.d_model, **spec)
        else:
            if args.start is None or args.stop is None:
                raise ValueError("START and STOP are required (or --positions-file)")
            rows, origin = args.stop - args.start, args.start
            slices = client.iter_range(args.start, args.stop, args.d_model, **spec)
        dtype = proto.numpy_dtype(args.dtype)
        _write_npy(args.output, slices, (rows, args.d_model), dtype, origin, args.no_progress)
    return EXIT_OK


def _write_npy(
    output: Path,
    slices: Iterator[tuple[int, npt.NDArray[Any]]],
    shape: tuple[int, int],
    dtype: np.dtype[Any],
    origin: int,
    no_progress: bool,
) -> None:
    partial = output.with_name(f".{output.name}.{os.getpid()}.partial")
    started = time.monotonic()
    row_bytes = shape[1] * dtype.itemsize
    # The first slice carries the server's verdict on the request (limits, bad arguments):
    # have it before creating a file of the requested size.
    first_slice = next(slices, None)
    slices = itertools.chain([] if first_slice is None else [first_slice], slices)
    try:
        table = open_memmap(partial, mode="w+", dtype=dtype, shape=shape)
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
                table[first : first + len(rows)] = rows
                bar.update(len(rows))
                bar.set_postfix_str(_human_bytes(bar.n * row_bytes), refresh=False)
        table.flush()
        del table  # unmaps the file before it is renamed
        os.replace(partial, output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    elapsed = max(time.monotonic() - started, 1e-9)
    size = shape[0] * row_bytes
    print(
        f"posenc fetch: wrote {shape[0]:,} x {shape[1]} {dtype.name} rows "
        f"({_human_bytes(size)}) to {output} in {elapsed:.1f} s "
        f"({shape[0] / elapsed:,.0f} rows/s, {_human_bytes(size / elapsed)}/s)",
        file=sys.stderr,
    )


# -- info, health -----------------------------------------------------------------------


def _info(args: argparse.Namespace) -> int:
    with _client(args, _targets(args)) as client:
        info = client.server_info()
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return EXIT_OK
    print(f"version:       {info.version}")
    print(f"server_id:     {info.server_id}")
    print(f"dtypes:        {', '.join(info.dtypes)}")
    print(f"layouts:       {', '.join(info.layouts)}")
    print(f"schedules:     {', '.join(info.schedules)}")
    print(f"presets:       {', '.join(preset.name for preset in info.presets)}")
    print(f"rows_computed: {info.rows_computed:,}")
    for title, section in (("limits", info.limits), ("cache", info.cache)):
        print(f"{title}:")
        for name, value in vars(section).items():
            print(f"  {name + ':':<27}{value:,}")
    return EXIT_OK


def _health(args: argparse.Namespace) -> int:
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
