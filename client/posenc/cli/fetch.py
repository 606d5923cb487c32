"""``posenc fetch``: stream a table into a .npy or .safetensors file."""

from __future__ import annotations

import argparse
import itertools
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from posenc._channel import DEFAULT_TARGET
from posenc._client import Client
from posenc._query import as_positions, named_dtype
from posenc.cli._shared import (
    _TARGET_ENV,
    EXIT_OK,
    _add_client_arguments,
    _client,
    _Command,
    _first_answer,
    _positive_float,
    _targets,
    _usage_error,
)
from posenc.cli._tables import _add_table_arguments, _table
from posenc.cli._writer import _FORMATS, _check_output, _human_bytes, _Rows, _write
from posenc.spec import Spec, position_axes
from posenc_protocol.numbers import exact_integer, integer

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


COMMAND: Final = _Command(
    "stream a table into a .npy or .safetensors file",
    "Stream the rows of positions [START, STOP) of a table into a .npy or .safetensors file.",
    _FETCH_EPILOG,
)


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


# How long `fetch` waits for a server's first answer (its --connect-timeout): a table may
# take hours, but a server that answers nothing in this long is not going to.
_CONNECT_TIMEOUT = 20.0


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


def _slices(
    client: Client, args: argparse.Namespace, table: Spec, options: dict[str, Any]
) -> tuple[int, int, Iterator[tuple[int, npt.NDArray[Any]]]]:
    """The table's row count, the position of its first row, and its slices.

    Slices arrive labelled by position (range) or by index (list): the origin maps either to
    the row of the output array.
    """
    if args.positions_file is not None:
        if args.start is not None:
            raise _usage_error("give either START STOP or --positions-file, not both")
        positions = _load_positions(args.positions_file, position_axes(table.kind))
        return len(positions), 0, client.iter_positions(positions, table, **options)
    if args.start is None and args.stop is None and table.grid_shape is not None:
        # A grid kind without a range: the whole grid, written with its shape.
        return math.prod(table.grid_shape), 0, client.iter_grid(table, **options)
    if args.start is None or args.stop is None:
        raise _usage_error("START and STOP are required (or --positions-file)")
    slices = client.iter_range(args.start, args.stop, table, **options)
    return args.stop - args.start, args.start, slices


def _check_disk(output: Path, needed: int) -> None:
    """A table past the server's stream limit travels in several streams, so only the disk
    bounds what fetch can write: checked before the file is made."""
    free = shutil.disk_usage(output.parent).free
    if needed > free:
        raise OSError(
            f"cannot write {output}: the table takes {_human_bytes(needed)}, "
            f"and {output.parent} has {_human_bytes(free)} free"
        )


def run(args: argparse.Namespace) -> int:
    """``posenc fetch``: the table's rows into the output file."""
    table = _table(args)
    _check_output(args.output)
    options: dict[str, Any] = {"dtype": args.dtype, "chunk_bytes": args.chunk_bytes}
    with _client(args, _targets(args)) as client:
        rows, origin, slices = _slices(client, args, table, options)
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
        _check_disk(args.output, rows * width * dtype.itemsize)
        grid_shape = table.grid_shape if args.start is None and not args.positions_file else None
        file_shape = None if grid_shape is None else (*grid_shape, width)
        written = _Rows(slices, (rows, width), dtype, origin)
        _write(args.output, written, table, args.no_progress, file_shape)
    return EXIT_OK


def add_arguments(fetch: argparse.ArgumentParser) -> None:
    """The ``fetch`` command's arguments."""
    _add_rows_arguments(fetch)
    _add_table_arguments(fetch)
    _add_output_arguments(fetch)
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


def _add_rows_arguments(fetch: argparse.ArgumentParser) -> None:
    """Which rows: a range, or a file of positions."""
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


def _add_output_arguments(fetch: argparse.ArgumentParser) -> None:
    """Where the table goes, in what chunks, and whether a progress bar shows."""
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
